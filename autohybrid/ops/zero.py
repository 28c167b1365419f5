"""ZeRO's flat shards over the data-parallel axis, and ZeRO-3's gather-before-use op.

Layout (every ZeRO stage, and `runtime/zero.py`): a parameter of n elements (the whole
parameter, or this rank's tensor-parallel shard of it) is flattened, zero-padded to
`dp · c` with `c = ceil(n / dp)`, and dp rank r holds elements `[r·c, (r+1)·c)`: a 1-D
shard of c elements. Several parameters go through one collective by concatenating their
shards: all-gather then gives a `(dp, Σc)` tensor whose row r is rank r's shards, and a
reduce-scatter of gradients laid out as `(dp, Σc)` leaves each rank its rows' sums.

ZeRO-3 graphs gather a layer's parameters before use in two nodes (passes/zero.py):
`zero_gather_start(shards, dp, axis)` issues the all-gather (asynchronously) and returns
the flat buffer it fills; `zero_gather_wait(flat, shards, shapes, ndims, axis)` waits and
gives the whole parameters of `shapes`. Between the two, other work runs
(passes/overlap.py moves starts up within a budget of bytes in flight). Backward (of the
wait) reduce-scatters (sums) the parameters' gradients back to the shards, so each
rank's shard gradient is the dp sum, as a bucketed all-reduce would give; in
`reduce_dtype` when given (`Plan.grad_reduce_dtype`), in the gradients' own otherwise.
Inside `deferred_reductions()` (the executor's backward outside a pipeline) the
reduce-scatter is issued asynchronously and its sums added to the shards' `.grad` when
done, while the backward goes on (below). The pending
work of a start is found by the identity of its buffer. `zero_gather(shards, shapes,
axis)` is the two back to back.

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


def gather_start(shards: Sequence[torch.Tensor], group: dist.ProcessGroup | None,
                 async_op: bool = False) -> tuple[torch.Tensor, object | None]:
    """Issue the all-gather of every rank's flat `shards`: (the flat `(dp, Σc)` result,
    its pending work or None). The result is valid only after `gather_finish`."""
    pieces = [s.detach().reshape(-1) for s in shards]
    if group is None:
        return torch.cat(pieces), None
    # this rank's shards concatenated straight into their row of the result, which is
    # then gathered in place (all_gather_single: broadcasts on gloo); shards of several
    # dtypes are concatenated in their promoted one first, as torch.cat does
    mixed = torch.cat(pieces) if len({p.dtype for p in pieces}) > 1 else None
    like = pieces[0] if mixed is None else mixed
    flat = like.new_empty(dist.get_world_size(group) * sum(p.numel() for p in pieces))
    row = flat.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
    if mixed is None:
        torch.cat(pieces, out=row)
    else:
        row.copy_(mixed)
    return flat, groups.all_gather_single(flat, row, group=group, async_op=async_op)


def gather_finish(flat: torch.Tensor, work: object | None, sizes: Sequence[int],
                  shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Wait for `work`, then the whole tensors of `shapes` out of `flat` (their shards
    have `sizes` elements each): new contiguous tensors, not views."""
    if work is not None:
        work.wait()
    outs = [flat.new_empty(tuple(shape)) for shape in shapes]
    copy_gathered(flat, sizes, outs)
    return outs


def copy_gathered(flat: torch.Tensor, sizes: Sequence[int],
                  targets: Sequence[torch.Tensor]) -> None:
    """Write each whole tensor out of a gathered `flat` (`(dp, Σ sizes)`, the shards of
    `sizes` elements) into `targets` (contiguous, or copied through a temporary): one
    copy per rank's piece, no intermediate."""
    rows = flat.view(-1, sum(sizes))
    offset = 0
    for size, target in zip(sizes, targets):
        whole = target.view(-1) if target.is_contiguous() else None
        if whole is None:
            target.copy_(rows[:, offset: offset + size].reshape(-1)[: target.numel()]
                         .view_as(target))
        else:
            n = whole.numel()
            for r in range(rows.shape[0]):
                lo = r * size
                if lo >= n:
                    break
                hi = min(n, lo + size)
                whole[lo:hi].copy_(rows[r, offset: offset + hi - lo])
        offset += size


def gather(shards: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
           group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Whole tensors of `shapes` from every rank's flat `shards`, in one all-gather (new
    contiguous tensors, not views)."""
    flat, work = gather_start(shards, group)
    return gather_finish(flat, work, [s.numel() for s in shards], shapes)


def scatter_layout(grads: Sequence[torch.Tensor], dp: int) -> torch.Tensor:
    """Gradients of whole parameters as the flat `(dp, Σc)` input of a reduce-scatter
    (each gradient copied once into its columns, the padding zeroed)."""
    sizes = [chunk(g.numel(), dp) for g in grads]
    out = grads[0].new_empty(dp, sum(sizes))
    offset = 0
    for g, c in zip(grads, sizes):
        flat = g.reshape(-1)
        n = flat.numel()
        full = n // c                      # rows the gradient fills
        columns = out[:, offset: offset + c]
        if full:
            columns[:full].copy_(flat[: full * c].view(full, c))
        if full < dp:
            rest = n - full * c
            columns[full, :rest].copy_(flat[full * c:])
            columns[full, rest:].zero_()
            columns[full + 1:].zero_()
        offset += c
    return out.reshape(-1)


def reduce_scatter_flat(grads: Sequence[torch.Tensor],
                        group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """This rank's shard of Σ over ranks of each whole gradient, in one reduce-scatter."""
    if group is None or not grads:
        return [g.reshape(-1).clone() for g in grads]
    dp = dist.get_world_size(group)
    flat = scatter_layout(grads, dp)
    out = flat.new_empty(flat.numel() // dp)
    groups.reduce_scatter_single(out, flat, group=group, input_scratch=True)
    sizes = [chunk(g.numel(), dp) for g in grads]
    return list(out.split(sizes))


# ------------------------------------------------------------------ the op

def _unflatten(shapes: Sequence[int], ndims: Sequence[int]) -> list[list[int]]:
    out, offset = [], 0
    for nd in ndims:
        out.append(list(shapes[offset: offset + nd]))
        offset += nd
    return out


_PENDING: dict[int, object] = {}   # id(flat result of a start) → its pending work


@torch.library.custom_op("autohybrid::zero_gather_start", mutates_args=())
def _zero_gather_start(shards: list[torch.Tensor], dp: int, axis: str) -> torch.Tensor:
    group = groups.peers(axis)
    flat, work = gather_start(shards, group, async_op=True)
    if work is not None:
        _PENDING[id(flat)] = work
    return flat


@_zero_gather_start.register_fake
def _(shards, dp, axis):
    return shards[0].new_empty(dp * sum(s.numel() for s in shards))


def _start_setup(ctx, inputs, output) -> None:
    ctx.count = len(inputs[0])


def _start_backward(ctx, grad):
    return [None] * ctx.count, None, None  # the shards' gradients come from the wait


_zero_gather_start.register_autograd(_start_backward, setup_context=_start_setup)


@torch.library.custom_op("autohybrid::zero_gather_wait", mutates_args=())
def _zero_gather_wait(flat: torch.Tensor, shards: list[torch.Tensor], shapes: list[int],
                      ndims: list[int], axis: str,
                      reduce_dtype: str | None = None) -> list[torch.Tensor]:
    outs = gather_finish(flat, _PENDING.pop(id(flat), None), [s.numel() for s in shards],
                         _unflatten(shapes, ndims))
    if _TRACKING:
        _track(shards, outs, axis)
    return outs


@_zero_gather_wait.register_fake
def _(flat, shards, shapes, ndims, axis, reduce_dtype=None):
    return [s.new_empty(d) for s, d in zip(shards, _unflatten(shapes, ndims))]


def _setup(ctx, inputs, output) -> None:
    ctx.axis = inputs[4]
    ctx.shards = list(inputs[1])   # the shard parameters (deferred reductions add to them)
    ctx.reduce_dtype = inputs[5] if len(inputs) > 5 else None
    entry = _GATHERED.get(id(output[0])) if _TRACKING and output else None
    ctx.layer = entry.layer if entry is not None and entry.ref() is output[0] else None


def _backward(ctx, grads):
    if ctx.layer is not None:          # every use of the layer's parameters is done
        ctx.layer.release()
    # a parameter the loss does not reach gets no gradient, as in eager (every dp rank
    # runs the same graph, so all skip the same ones)
    present = [i for i, g in enumerate(grads) if g is not None]
    cast = getattr(torch, ctx.reduce_dtype) if ctx.reduce_dtype else None
    sent = [grads[i] if cast is None else grads[i].to(cast) for i in present]
    group = groups.peers(ctx.axis)
    out: list[torch.Tensor | None] = [None] * len(grads)
    rest = (None,) * (len(ctx.needs_input_grad) - 2)
    if _DEFERRING and group is not None and sent and all(
            ctx.shards[i].is_leaf and ctx.shards[i].requires_grad for i in present):
        # issued now, accumulated into the shards' .grad when done (deferred_reductions)
        _defer(sent, [ctx.shards[i] for i in present],
               [grads[i].dtype for i in present], group)
        return (None, out) + rest
    parts = reduce_scatter_flat(sent, group)
    for i, part in zip(present, parts):
        out[i] = part.to(grads[i].dtype) if cast is not None else part.clone()
    # one entry per input as autograd counts them (an optional argument not passed is
    # not one; ctx.needs_input_grad has that structure)
    return (None, out) + rest


_zero_gather_wait.register_autograd(_backward, setup_context=_setup)


# ------------------------------------------------------------------ deferred reductions

#: reduce-scatters a deferring backward keeps in flight (each holds its layer's whole
#: gradients until done): issuing one more first completes the oldest (FSDP2 keeps one)
REDUCTIONS_IN_FLIGHT = 2

_DEFERRING = False


@dataclass
class _Reduction:
    work: object
    sent: torch.Tensor                # the (dp, Σc) input, alive until the work is done
    out: torch.Tensor                 # this rank's Σc
    shards: list[torch.Tensor]
    dtypes: list[torch.dtype]

    def finish(self) -> None:
        self.work.wait()
        sizes = [s.numel() for s in self.shards]
        for shard, part, dtype in zip(self.shards, self.out.split(sizes), self.dtypes):
            part = part.to(dtype) if part.dtype != dtype else part.clone()
            if shard.grad is None:
                shard.grad = part
            else:
                shard.grad += part


_REDUCTIONS: list[_Reduction] = []


def _defer(sent: list[torch.Tensor], shards: list[torch.Tensor], dtypes: list[torch.dtype],
           group: dist.ProcessGroup) -> None:
    dp = dist.get_world_size(group)
    flat = scatter_layout(sent, dp)
    out = flat.new_empty(flat.numel() // dp)
    work = groups.reduce_scatter_single(out, flat, group=group, async_op=True,
                                        input_scratch=True)
    _REDUCTIONS.append(_Reduction(work, flat, out, shards, dtypes))
    while len(_REDUCTIONS) > REDUCTIONS_IN_FLIGHT:
        _REDUCTIONS.pop(0).finish()


@contextmanager
def deferred_reductions(enabled: bool = True) -> Iterator[None]:
    """Run a backward whose ZeRO-3 reduce-scatters are issued asynchronously: each
    layer's gradients are summed over dp while the backward of the layers before it
    computes (as FSDP2 overlaps them), at most `REDUCTIONS_IN_FLIGHT` at once, and added
    to the shard parameters' `.grad` when done; all are done when the context exits.
    Only around a plain `.backward()`: a step that asks autograd for the shards'
    gradients (torch.autograd.grad, a zero-bubble pipeline's weight step) needs them
    returned, which the synchronous reduction does. On an error the pending ones are
    dropped (their collectives still complete; their sums are not used)."""
    global _DEFERRING
    if not enabled or _DEFERRING:
        yield
        return
    _DEFERRING = True
    try:
        yield
    except BaseException:
        _REDUCTIONS.clear()
        raise
    finally:
        _DEFERRING = False
    while _REDUCTIONS:
        _REDUCTIONS.pop(0).finish()


def zero_gather(shards: Sequence[torch.Tensor], shapes: Sequence[Sequence[int]],
                axis: str) -> list[torch.Tensor]:
    """Whole parameters of `shapes` from every rank's flat `shards` over `axis`: a start
    and its wait, back to back."""
    dims = [int(d) for shape in shapes for d in shape]
    group = groups.peers(axis)
    dp = dist.get_world_size(group) if group is not None else 1
    flat = _zero_gather_start(list(shards), dp, axis)
    return _zero_gather_wait(flat, list(shards), dims, [len(s) for s in shapes], axis)


#: the ops graphs call (passes/zero.py): `flat = zero_gather_start_op(shards, dp, axis)`
#: issues the all-gather; `zero_gather_wait_op(flat, shards, flat shapes, ndims, axis)`
#: waits for it and gives the whole parameters. passes/overlap.py moves starts earlier.
zero_gather_start_op = torch.ops.autohybrid.zero_gather_start.default
zero_gather_wait_op = torch.ops.autohybrid.zero_gather_wait.default


# ------------------------------------------------------------------ release after use

class _Layer:
    """One gather made under `release_gathered`: its shards, and the whole parameters
    gathered again for backward while some saved view still needs them. `previous` is the
    forward's gather before it: backward needs that one next, so when this layer is
    gathered again the previous one's all-gather is issued too (prefetch) and runs while
    this layer's backward computes."""

    def __init__(self, shards: list[torch.Tensor], shapes: list[tuple[int, ...]], axis: str,
                 previous: "_Layer | None" = None):
        self.shards, self.shapes, self.axis = shards, shapes, axis
        self.previous = previous
        self.saved = 0                 # views of its parameters autograd saved (handles)
        self._whole: list[torch.Tensor] | None = None
        self._pending: tuple[torch.Tensor, object | None] | None = None

    def whole(self, index: int) -> torch.Tensor:
        if self._whole is None:
            flat, work = self._pending or gather_start(self.shards, groups.peers(self.axis))
            self._pending = None
            self._whole = gather_finish(flat, work, [s.numel() for s in self.shards],
                                        self.shapes)
            before = self.previous
            if before is not None and before.saved and before._whole is None \
                    and before._pending is None:
                before._pending = gather_start(before.shards, groups.peers(before.axis), True)
        return self._whole[index]

    def keep(self, whole: list[torch.Tensor]) -> None:
        self._whole = whole

    def release_kept(self) -> None:
        """Forward has moved on to the next gather: drop this one's whole parameters."""
        self._whole = None

    def release(self) -> None:
        """Its backward is done: drop the parameters gathered again."""
        self._whole = None
        self.previous = None


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


def _track(shards: list[torch.Tensor], outs: list[torch.Tensor], axis: str) -> None:
    global _LAST
    layer = _Layer([s.detach() for s in shards], [tuple(o.shape) for o in outs], axis, _LAST)
    for i, out in enumerate(outs):
        _GATHERED[id(out)] = _Gathered(weakref.ref(out), layer, i)
    if _LAST is not None:
        _LAST.release_kept()
    layer.keep(outs)
    _LAST = layer


def _pack(t: torch.Tensor):
    base = t if t._base is None else t._base
    entry = _GATHERED.get(id(base))
    if entry is not None and entry.ref() is base:
        entry.layer.saved += 1
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
