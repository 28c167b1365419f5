"""Megatron's tensor- and sequence-parallel collectives over a mesh axis, as custom ops.

The ops come in conjugate pairs: the backward of each is its partner's forward, and the
backward calls the partner op, so a joint (forward + backward) trace holds only
`autohybrid::` nodes. A pass inserts them as fx nodes (fake impls are registered). Every
op takes `axis`, a mesh axis name resolved with `groups.get` when it runs; a None group
or a one-rank group means no communication (the op then returns a copy).

    op                                forward                      backward
    tp_copy(x, axis)                  identity                     all-reduce sum  (f)
    tp_reduce(x, axis)                all-reduce sum               identity        (g)
    tp_gather(x, dim, axis)           all-gather along dim         this rank's slice
    tp_split(x, dim, axis)            this rank's slice            all-gather along dim
    sp_reduce_scatter(x, dim, axis)   reduce-scatter sum along dim all-gather along dim
    sp_gather(x, dim, axis)           all-gather along dim         reduce-scatter sum

`tp_gather` is for a replicated consumer (its gradient is the same on every rank, so a
slice suffices); `sp_gather` for a consumer whose gradient differs per rank (sequence
parallelism's replacement of f). Shards are equal and in rank order; `tp_split` and
`sp_reduce_scatter` raise `RuntimeFailure` when the size along `dim` does not divide by
the axis size. Outputs are new contiguous tensors, never aliases of the input.

The module-level names are the `CustomOpDef`s, callable as plain functions:
``tp_copy(x, "tp")`` is ``torch.ops.autohybrid.tp_copy(x, "tp")``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from . import groups


def _group(axis: str) -> dist.ProcessGroup | None:
    """The group of `axis`, or None when there is nobody to talk to."""
    group = groups.get(axis)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def _shard_shape(x: torch.Tensor, dim: int, n: int, op: str, axis: str) -> list[int]:
    shape = list(x.shape)
    if shape[dim] % n:
        raise RuntimeFailure(
            f"autohybrid::{op}: size {shape[dim]} along dim {dim} of a tensor of shape "
            f"{tuple(x.shape)} does not divide by the {n} ranks of mesh axis {axis!r}; "
            f"pad that dimension to a multiple of {n}")
    shape[dim] //= n
    return shape


def _gathered_shape(x: torch.Tensor, dim: int, n: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] *= n
    return shape


def _all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty(_gathered_shape(src, 0, dist.get_world_size(group)))
    groups.all_gather_single(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup, axis: str
                    ) -> torch.Tensor:
    src = x.movedim(dim, 0).contiguous()
    n = dist.get_world_size(group)
    out = src.new_empty(_shard_shape(src, 0, n, "sp_reduce_scatter", axis))
    groups.reduce_scatter_single(out, src, group=group)
    return out.movedim(0, dim).contiguous()


def _slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup, axis: str) -> torch.Tensor:
    n = dist.get_world_size(group)
    size = _shard_shape(x, dim, n, "tp_split", axis)[dim]
    shard = x.narrow(dim, dist.get_rank(group) * size, size)
    return shard.clone(memory_format=torch.contiguous_format)  # never a view of x


# ------------------------------------------------------------------ the ops and fakes

@torch.library.custom_op("autohybrid::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity; backward all-reduces (sums) the gradient over `axis`."""
    _group(axis)  # an unbound axis fails here as in every other op
    return x.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("autohybrid::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """All-reduce (sum) over `axis`; backward passes the gradient through."""
    out = x.clone(memory_format=torch.contiguous_format)
    group = _group(axis)
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


@torch.library.custom_op("autohybrid::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """All-gather equal shards along `dim`; backward keeps this rank's slice."""
    group = _group(axis)
    return x.clone(memory_format=torch.contiguous_format) if group is None \
        else _all_gather(x, dim, group)


@torch.library.custom_op("autohybrid::tp_split", mutates_args=())
def tp_split(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """This rank's equal slice along `dim`; backward all-gathers the gradient."""
    group = _group(axis)
    return x.clone(memory_format=torch.contiguous_format) if group is None \
        else _slice(x, dim, group, axis)


@torch.library.custom_op("autohybrid::sp_reduce_scatter", mutates_args=())
def sp_reduce_scatter(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Reduce-scatter (sum) along `dim`; backward all-gathers the gradient."""
    group = _group(axis)
    return x.clone(memory_format=torch.contiguous_format) if group is None \
        else _reduce_scatter(x, dim, group, axis)


@torch.library.custom_op("autohybrid::sp_gather", mutates_args=())
def sp_gather(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """All-gather along `dim`; backward reduce-scatters (sums) the gradient."""
    group = _group(axis)
    return x.clone(memory_format=torch.contiguous_format) if group is None \
        else _all_gather(x, dim, group)


@tp_copy.register_fake
def _(x, axis):
    return x.new_empty(x.shape)


@tp_reduce.register_fake
def _(x, axis):
    return x.new_empty(x.shape)


@tp_gather.register_fake
def _(x, dim, axis):
    return x.new_empty(_gathered_shape(x, dim, groups.size(axis)))


@sp_gather.register_fake
def _(x, dim, axis):
    return x.new_empty(_gathered_shape(x, dim, groups.size(axis)))


@tp_split.register_fake
def _(x, dim, axis):
    return x.new_empty(_shard_shape(x, dim, groups.size(axis), "tp_split", axis))


@sp_reduce_scatter.register_fake
def _(x, dim, axis):
    return x.new_empty(_shard_shape(x, dim, groups.size(axis), "sp_reduce_scatter", axis))


# ------------------------------------------------------------------ autograd: the pairs

def _pair(op, partner) -> None:
    """Make `partner` (same trailing arguments) the backward of `op`."""
    def setup_context(ctx, inputs, output) -> None:
        ctx.args = inputs[1:]

    def backward(ctx, grad):
        return (partner(grad, *ctx.args), *[None] * len(ctx.args))

    op.register_autograd(backward, setup_context=setup_context)


for _op, _partner in ((tp_copy, tp_reduce), (tp_reduce, tp_copy), (tp_gather, tp_split),
                      (tp_split, tp_gather), (sp_reduce_scatter, sp_gather),
                      (sp_gather, sp_reduce_scatter)):
    _pair(_op, _partner)


# ------------------------------------------------------------------ replicated shards
# With fewer key/value heads than tp ranks, each key/value shard lives on tp / ways ranks
# (replicas), and each replica's backward sees only its own query heads: the weight's
# gradient is the sum over the replicas.

@torch.library.custom_op("autohybrid::tp_sum_replicas", mutates_args=())
def tp_sum_replicas(x: torch.Tensor, ways: int, axis: str) -> torch.Tensor:
    """Σ of `x` over the ranks holding the same one of `ways` shards (consecutive tp ranks)."""
    group = _group(axis)
    if group is None:
        return x.clone(memory_format=torch.contiguous_format)
    n = dist.get_world_size(group)
    step = n // ways
    src = x.reshape(1, -1).contiguous()
    parts = src.new_empty((n, src.shape[1]))
    groups.all_gather_single(parts, src, group=group)
    first = dist.get_rank(group) // step * step
    return parts[first:first + step].sum(0).view(x.shape)


@tp_sum_replicas.register_fake
def _(x, ways, axis):
    return x.new_empty(x.shape)


@torch.library.custom_op("autohybrid::tp_replicated", mutates_args=())
def tp_replicated(x: torch.Tensor, ways: int, axis: str) -> torch.Tensor:
    """Identity on a shard held by tp / `ways` ranks; backward sums the replicas' grads."""
    _group(axis)
    return x.clone(memory_format=torch.contiguous_format)


@tp_replicated.register_fake
def _(x, ways, axis):
    return x.new_empty(x.shape)


def _replicated_setup(ctx, inputs, output) -> None:
    ctx.args = inputs[1:]


def _replicated_backward(ctx, grad):
    return tp_sum_replicas(grad, *ctx.args), None, None


tp_replicated.register_autograd(_replicated_backward, setup_context=_replicated_setup)
