"""ZeRO's flat shards over the data-parallel axis, and ZeRO-3's gather-before-use op.

Layout (every ZeRO stage, and `runtime/zero.py`): a parameter of n elements (the whole
parameter, or this rank's tensor-parallel shard of it) is flattened, zero-padded to
`dp · c` with `c = ceil(n / dp)`, and dp rank r holds elements `[r·c, (r+1)·c)`: a 1-D
shard of c elements. Several parameters go through one collective by concatenating their
shards: all-gather then gives a `(dp, Σc)` tensor whose row r is rank r's shards, and a
reduce-scatter of gradients laid out as `(dp, Σc)` leaves each rank its rows' sums.

`zero_gather(shards, shapes, axis)` is what ZeRO-3 graphs run before a layer uses its
parameters (passes/zero.py): forward all-gathers the shards into whole parameters of
`shapes`; backward reduce-scatters (sums) their gradients back to the shards, so each
rank's shard gradient is the dp sum, as a bucketed all-reduce would give.

Release after use: a gathered parameter dies once the graph no longer reads it, except
where autograd saves it (or a view of it) for backward. `release_gathered()` is the
saved-tensor hook context the runtime runs forward in: a saved gathered parameter is
replaced by a handle (its gather and the view's geometry). When backward first needs
one of a gather's parameters, the whole gather runs again in one all-gather (as FSDP
re-gathers a block in backward); the other saved views of that layer read the same
result, which is dropped when the gather's own backward (the reduce-scatter) runs, that
is once every use of the layer's parameters has its gradient. The forward's last gather
is kept, not gathered again: its layer's backward comes first, right after forward (FSDP
keeps its root's parameters so). Gathers made inside the context are tracked by
identity; the tracking ends when the context exits.

Example::

    (w,) = zero_gather([shard], [[64, 32]], "dp")   # the whole (tp-local) weight
"""
from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from . import groups


def chunk(numel: int, dp: int) -> int:
    """Elements of each rank's shard of a parameter of `numel` elements."""
    return max(1, math.ceil(numel / dp))


def shard_of(t: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s flat shard of `t` (a new tensor, zero-padded at the end)."""
    flat = t.detach().reshape(-1)
    c = chunk(flat.numel(), dp)
    out = flat.new_zeros(c)
    piece = flat[rank * c: (rank + 1) * c]
    out[: piece.numel()] = piece
    return out


def _group(axis: str) -> dist.ProcessGroup | None:
    group = groups.get(axis)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def gather(shards: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
           group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Whole tensors of `shapes` from every rank's flat `shards`, in one all-gather (new
    contiguous tensors, not views)."""
    outs = [shards[0].new_empty(tuple(shape)) for shape in shapes]
    if group is None:
        for out, s in zip(outs, shards):
            out.view(-1).copy_(s.reshape(-1)[: out.numel()])
        return outs
    dp = dist.get_world_size(group)
    local = torch.cat([s.reshape(-1) for s in shards])
    flat = local.new_empty(dp * local.numel())
    groups.all_gather_single(flat, local, group=group)
    rows = flat.view(dp, local.numel())
    offset = 0
    for out, s in zip(outs, shards):
        out.view(-1).copy_(rows[:, offset: offset + s.numel()].reshape(-1)[: out.numel()])
        offset += s.numel()
    return outs


def scatter_layout(grads: Sequence[torch.Tensor], dp: int) -> torch.Tensor:
    """Gradients of whole parameters as the flat `(dp, Σc)` input of a reduce-scatter."""
    columns = []
    for g in grads:
        flat = g.reshape(-1)
        c = chunk(flat.numel(), dp)
        padded = flat.new_zeros(dp * c)
        padded[: flat.numel()] = flat
        columns.append(padded.view(dp, c))
    return torch.cat(columns, dim=1).reshape(-1)


def reduce_scatter_flat(grads: Sequence[torch.Tensor],
                        group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """This rank's shard of Σ over ranks of each whole gradient, in one reduce-scatter."""
    if group is None or not grads:
        return [g.reshape(-1).clone() for g in grads]
    dp = dist.get_world_size(group)
    flat = scatter_layout(grads, dp)
    out = flat.new_empty(flat.numel() // dp)
    groups.reduce_scatter_single(out, flat, group=group)
    sizes = [chunk(g.numel(), dp) for g in grads]
    return list(out.split(sizes))


# ------------------------------------------------------------------ the op

def _unflatten(shapes: Sequence[int], ndims: Sequence[int]) -> list[list[int]]:
    out, offset = [], 0
    for nd in ndims:
        out.append(list(shapes[offset: offset + nd]))
        offset += nd
    return out


@torch.library.custom_op("autohybrid::zero_gather", mutates_args=())
def _zero_gather(shards: list[torch.Tensor], shapes: list[int], ndims: list[int],
                 axis: str) -> list[torch.Tensor]:
    outs = gather(shards, _unflatten(shapes, ndims), _group(axis))
    if _TRACKING:
        global _LAST
        layer = _Layer([s.detach() for s in shards], [tuple(o.shape) for o in outs], axis)
        for i, out in enumerate(outs):
            _GATHERED[id(out)] = _Gathered(weakref.ref(out), layer, i)
        if _LAST is not None:
            _LAST.release()
        layer.keep(outs)
        _LAST = layer
    return outs


@_zero_gather.register_fake
def _(shards, shapes, ndims, axis):
    return [s.new_empty(d) for s, d in zip(shards, _unflatten(shapes, ndims))]


def _setup(ctx, inputs, output) -> None:
    ctx.axis = inputs[3]
    entry = _GATHERED.get(id(output[0])) if _TRACKING and output else None
    ctx.layer = entry.layer if entry is not None and entry.ref() is output[0] else None


def _backward(ctx, grads):
    if ctx.layer is not None:          # every use of the layer's parameters is done
        ctx.layer.release()
    # a parameter the loss does not reach gets no gradient, as in eager (every dp rank
    # runs the same graph, so all skip the same ones)
    present = [i for i, g in enumerate(grads) if g is not None]
    parts = reduce_scatter_flat([grads[i] for i in present], _group(ctx.axis))
    out: list[torch.Tensor | None] = [None] * len(grads)
    for i, part in zip(present, parts):
        out[i] = part.clone()
    return out, None, None, None


_zero_gather.register_autograd(_backward, setup_context=_setup)


def zero_gather(shards: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
                axis: str) -> list[torch.Tensor]:
    """Whole parameters of `shapes` from every rank's flat `shards` over `axis`."""
    flat = [int(d) for shape in shapes for d in shape]
    return _zero_gather(list(shards), flat, [len(s) for s in shapes], axis)


#: the op graphs call (passes/zero.py): `zero_gather_op(shards, flat shapes, ndims, axis)`
zero_gather_op = torch.ops.autohybrid.zero_gather.default


# ------------------------------------------------------------------ release after use

class _Layer:
    """One `zero_gather` call made under `release_gathered`: its shards, and the whole
    parameters gathered again for backward while some saved view still needs them."""

    def __init__(self, shards: list[torch.Tensor], shapes: list[tuple[int, ...]], axis: str):
        self.shards, self.shapes, self.axis = shards, shapes, axis
        self._whole: list[torch.Tensor] | None = None

    def whole(self, index: int) -> torch.Tensor:
        if self._whole is None:
            self._whole = gather(self.shards, self.shapes, _group(self.axis))
        return self._whole[index]

    def keep(self, whole: list[torch.Tensor]) -> None:
        self._whole = whole

    def release(self) -> None:
        self._whole = None


@dataclass
class _Gathered:
    ref: weakref.ref
    layer: _Layer
    index: int


@dataclass
class _Regather:
    """A saved view of a gathered parameter, kept as its layer's shards until backward."""

    source: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def value(self) -> torch.Tensor:
        whole = self.source.layer.whole(self.source.index)
        return whole.as_strided(self.size, self.stride, self.offset)


_GATHERED: dict[int, _Gathered] = {}
_TRACKING = False
_LAST: _Layer | None = None   # the latest gather of the forward, kept for its backward


def _pack(t: torch.Tensor):
    base = t if t._base is None else t._base
    entry = _GATHERED.get(id(base))
    if entry is not None and entry.ref() is base:
        return _Regather(entry, tuple(t.size()), tuple(t.stride()), t.storage_offset())
    return t


def _unpack(saved):
    return saved.value() if isinstance(saved, _Regather) else saved


@contextmanager
def release_gathered(enabled: bool = True) -> Iterator[None]:
    """Run a forward in which parameters gathered by `zero_gather` are not kept for
    backward (they are gathered again there)."""
    global _TRACKING, _LAST
    if not enabled or _TRACKING:
        yield
        return
    _TRACKING = True
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _TRACKING = False
        _LAST = None
        _GATHERED.clear()
