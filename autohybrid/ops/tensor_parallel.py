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

The ops that communicate in forward (tp_reduce, tp_gather, sp_gather, sp_reduce_scatter)
also come as an issue/wait pair, `<op>_start` and `<op>_wait` (`ASYNC_FORMS`), whose
composition equals the sync op in value and gradient: passes/overlap.py splits the sync
nodes of a graph into them and runs compute between the two.

The module-level names are the `CustomOpDef`s, callable as plain functions:
``tp_copy(x, "tp")`` is ``torch.ops.autohybrid.tp_copy(x, "tp")``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from . import groups


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
    groups.reduce_scatter_single(out, src, group=group, input_scratch=_fresh(src, x))
    return out.movedim(0, dim).contiguous()


def _fresh(copy: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `copy` (made from `x` by `_front`) holds its own memory: a collective may
    then use it as scratch (never an input of an op, which must stay as it came)."""
    return copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def _slice(x: torch.Tensor, dim: int, group: dist.ProcessGroup, axis: str) -> torch.Tensor:
    n = dist.get_world_size(group)
    size = _shard_shape(x, dim, n, "tp_split", axis)[dim]
    shard = x.narrow(dim, dist.get_rank(group) * size, size)
    return shard.clone(memory_format=torch.contiguous_format)  # never a view of x


# ------------------------------------------------------------------ the ops and fakes

@torch.library.custom_op("autohybrid::tp_copy", mutates_args=())
def tp_copy(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity; backward all-reduces (sums) the gradient over `axis`."""
    groups.peers(axis)  # an unbound axis fails here as in every other op
    return x.clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("autohybrid::tp_reduce", mutates_args=())
def tp_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """All-reduce (sum) over `axis`; backward passes the gradient through."""
    out = x.clone(memory_format=torch.contiguous_format)
    group = groups.peers(axis)
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


@torch.library.custom_op("autohybrid::tp_gather", mutates_args=())
def tp_gather(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """All-gather equal shards along `dim`; backward keeps this rank's slice."""
    group = groups.peers(axis)
    return x.clone(memory_format=torch.contiguous_format) if group is None \
        else _all_gather(x, dim, group)


@torch.library.custom_op("autohybrid::tp_split", mutates_args=())
def tp_split(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """This rank's equal slice along `dim`; backward all-gathers the gradient."""
    group = groups.peers(axis)
    return x.clone(memory_format=torch.contiguous_format) if group is None \
        else _slice(x, dim, group, axis)


@torch.library.custom_op("autohybrid::sp_reduce_scatter", mutates_args=())
def sp_reduce_scatter(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Reduce-scatter (sum) along `dim`; backward all-gathers the gradient."""
    group = groups.peers(axis)
    return x.clone(memory_format=torch.contiguous_format) if group is None \
        else _reduce_scatter(x, dim, group, axis)


@torch.library.custom_op("autohybrid::sp_gather", mutates_args=())
def sp_gather(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """All-gather along `dim`; backward reduce-scatters (sums) the gradient."""
    group = groups.peers(axis)
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
    group = groups.peers(axis)
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
    groups.peers(axis)
    return x.clone(memory_format=torch.contiguous_format)


@tp_replicated.register_fake
def _(x, ways, axis):
    return x.new_empty(x.shape)


def _replicated_setup(ctx, inputs, output) -> None:
    ctx.args = inputs[1:]


def _replicated_backward(ctx, grad):
    return tp_sum_replicas(grad, *ctx.args), None, None


tp_replicated.register_autograd(_replicated_backward, setup_context=_replicated_setup)


# ------------------------------------------------------------------ issue / wait forms
# The forward collectives above (tp_reduce, tp_gather, sp_gather, sp_reduce_scatter) also
# come as two ops each, so that passes/overlap.py can run compute while they transfer:
#
#     buffer = <op>_start(x, [dim,] axis)     issues the collective (async_op=True) and
#                                             returns the buffer it fills
#     y      = <op>_wait(buffer, x, [dim,] axis)  waits, then gives the result (a new
#                                             contiguous tensor, equal to <op>(x, ...))
#
# The buffer holds the result with `dim` moved to the front (what the collective writes;
# for tp_reduce, the result itself); it is valid only once its wait has run. The pending
# work of a start is found by the identity of its buffer, as zero_gather_start's is. The
# wait takes `x` too, so that autograd routes the gradient to it: the wait's backward is
# exactly the sync op's (its partner op on the gradient); the start's buffer has none.

_PENDING: dict[int, tuple[object, torch.Tensor | None]] = {}  # id(buffer) → (work, its input)


def _issued(buffer: torch.Tensor, work: object | None, source: torch.Tensor | None
            ) -> torch.Tensor:
    """Remember `work` (and the tensor it reads, kept alive until it is done)."""
    if work is not None:
        _PENDING[id(buffer)] = (work, source)
    return buffer


def _waited(buffer: torch.Tensor, dim: int, ndim: int) -> torch.Tensor:
    """Wait for `buffer`'s collective; its result with the front dim moved back to `dim`
    (a new tensor: an op's output may not alias its input)."""
    pending = _PENDING.pop(id(buffer), None)
    if pending is not None:
        pending[0].wait()
    out = buffer.movedim(0, dim % ndim) if ndim else buffer
    return out.clone(memory_format=torch.contiguous_format)


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x` with `dim` moved to the front, contiguous (what a collective reads)."""
    return x.movedim(dim, 0).contiguous()


def _front_shape(x: torch.Tensor, dim: int, size) -> list[int]:
    """The shape of `x` with `dim` moved to the front and sized `size`."""
    shape = list(x.shape)
    shape.pop(dim % x.dim())
    return [size, *shape]


def _back_shape(buffer: torch.Tensor, dim: int, ndim: int) -> list[int]:
    shape = list(buffer.shape)
    shape.insert(dim % ndim, shape.pop(0))
    return shape


@torch.library.custom_op("autohybrid::tp_reduce_start", mutates_args=())
def tp_reduce_start(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Issue tp_reduce's all-reduce; the buffer it fills (wait with tp_reduce_wait)."""
    out = x.clone(memory_format=torch.contiguous_format)
    group = groups.peers(axis)
    work = None if group is None else dist.all_reduce(out, group=group, async_op=True)
    return _issued(out, work, None)


@torch.library.custom_op("autohybrid::tp_reduce_wait", mutates_args=())
def tp_reduce_wait(buffer: torch.Tensor, x: torch.Tensor, axis: str) -> torch.Tensor:
    """tp_reduce(x, axis), from the buffer of its start."""
    return _waited(buffer, 0, buffer.dim())


def _gather_start(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    group = groups.peers(axis)
    if group is None:
        return x.movedim(dim, 0).clone(memory_format=torch.contiguous_format)
    src = _front(x, dim)
    out = src.new_empty(_gathered_shape(src, 0, dist.get_world_size(group)))
    work = groups.all_gather_single(out, src, group=group, async_op=True)
    return _issued(out, work, src)


@torch.library.custom_op("autohybrid::tp_gather_start", mutates_args=())
def tp_gather_start(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Issue tp_gather's all-gather; the buffer it fills (wait with tp_gather_wait)."""
    return _gather_start(x, dim, axis)


@torch.library.custom_op("autohybrid::tp_gather_wait", mutates_args=())
def tp_gather_wait(buffer: torch.Tensor, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """tp_gather(x, dim, axis), from the buffer of its start."""
    return _waited(buffer, dim, x.dim())


@torch.library.custom_op("autohybrid::sp_gather_start", mutates_args=())
def sp_gather_start(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Issue sp_gather's all-gather; the buffer it fills (wait with sp_gather_wait)."""
    return _gather_start(x, dim, axis)


@torch.library.custom_op("autohybrid::sp_gather_wait", mutates_args=())
def sp_gather_wait(buffer: torch.Tensor, x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """sp_gather(x, dim, axis), from the buffer of its start."""
    return _waited(buffer, dim, x.dim())


@torch.library.custom_op("autohybrid::sp_reduce_scatter_start", mutates_args=())
def sp_reduce_scatter_start(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """Issue sp_reduce_scatter's reduce-scatter; the buffer it fills (wait with
    sp_reduce_scatter_wait)."""
    group = groups.peers(axis)
    if group is None:
        return x.movedim(dim, 0).clone(memory_format=torch.contiguous_format)
    src = _front(x, dim)
    n = dist.get_world_size(group)
    out = src.new_empty(_shard_shape(src, 0, n, "sp_reduce_scatter", axis))
    work = groups.reduce_scatter_single(out, src, group=group, async_op=True,
                                        input_scratch=_fresh(src, x))
    return _issued(out, work, src)


@torch.library.custom_op("autohybrid::sp_reduce_scatter_wait", mutates_args=())
def sp_reduce_scatter_wait(buffer: torch.Tensor, x: torch.Tensor, dim: int, axis: str
                           ) -> torch.Tensor:
    """sp_reduce_scatter(x, dim, axis), from the buffer of its start."""
    return _waited(buffer, dim, x.dim())


@tp_reduce_start.register_fake
def _(x, axis):
    return x.new_empty(x.shape)


@tp_reduce_wait.register_fake
def _(buffer, x, axis):
    return buffer.new_empty(buffer.shape)


def _gather_start_fake(x, dim, axis):
    return x.new_empty(_front_shape(x, dim, x.shape[dim] * groups.size(axis)))


tp_gather_start.register_fake(_gather_start_fake)
sp_gather_start.register_fake(_gather_start_fake)


@sp_reduce_scatter_start.register_fake
def _(x, dim, axis):
    n = groups.size(axis)
    return x.new_empty(_front_shape(x, dim,
                                    _shard_shape(x, dim, n, "sp_reduce_scatter", axis)[dim]))


def _wait_fake(buffer, x, dim, axis):
    return buffer.new_empty(_back_shape(buffer, dim, x.dim()))


for _wait in (tp_gather_wait, sp_gather_wait, sp_reduce_scatter_wait):
    _wait.register_fake(_wait_fake)


def _start_setup(ctx, inputs, output) -> None:
    ctx.count = len(inputs)
    ctx.mark_non_differentiable(output)


def _start_backward(ctx, grad):
    return (None,) * ctx.count  # x's gradient comes from the wait, which also reads x


def _wait_pair(wait, partner) -> None:
    """The backward of `wait(buffer, x, *args)` is `partner(grad, *args)` for x: the sync
    op's own backward."""
    def setup_context(ctx, inputs, output) -> None:
        ctx.args = inputs[2:]

    def backward(ctx, grad):
        return (None, partner(grad, *ctx.args), *[None] * len(ctx.args))

    wait.register_autograd(backward, setup_context=setup_context)


for _start in (tp_reduce_start, tp_gather_start, sp_gather_start, sp_reduce_scatter_start):
    _start.register_autograd(_start_backward, setup_context=_start_setup)
for _wait, _partner in ((tp_reduce_wait, tp_copy), (tp_gather_wait, tp_split),
                        (sp_gather_wait, sp_reduce_scatter),
                        (sp_reduce_scatter_wait, sp_gather)):
    _wait_pair(_wait, _partner)

#: sync op → (its start op, its wait op), as fx targets: passes/overlap.py splits each
#: such node of a graph into the two, `start(*args)` and `wait(start, *args)`.
ASYNC_FORMS = {
    torch.ops.autohybrid.tp_reduce.default: (torch.ops.autohybrid.tp_reduce_start.default,
                                             torch.ops.autohybrid.tp_reduce_wait.default),
    torch.ops.autohybrid.tp_gather.default: (torch.ops.autohybrid.tp_gather_start.default,
                                             torch.ops.autohybrid.tp_gather_wait.default),
    torch.ops.autohybrid.sp_gather.default: (torch.ops.autohybrid.sp_gather_start.default,
                                             torch.ops.autohybrid.sp_gather_wait.default),
    torch.ops.autohybrid.sp_reduce_scatter.default: (
        torch.ops.autohybrid.sp_reduce_scatter_start.default,
        torch.ops.autohybrid.sp_reduce_scatter_wait.default),
}
