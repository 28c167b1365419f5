"""Collective matmul: sequence-parallel all-gather → linear and linear → reduce-scatter in
chunks, so that the transfer of one chunk overlaps the matmul of another.

Under sequence parallelism (passes/sequence_parallel.py) a column-parallel linear reads
`sp_gather(x)`, the whole sequence gathered from every tp rank, and a row-parallel linear's
output goes through `sp_reduce_scatter`. Run one after the other, the link idles while the
matmul runs and the matmul waits for the whole transfer. Linear layers work row by row (a
row is a token), so both can be cut along the sequence into `chunks` pieces of each rank's
slice, and pipelined (Wang et al., "Overlap communication with dependent computation via
decomposition", ASPLOS 2023; Megatron-LM's `--tp-comm-overlap`):

    op                                    forward                       backward
    cm_gather_linear(x, ws, bs, d, ax, k)  AG chunk c+1 ‖ linear chunk c  linear' chunk c ‖ RS chunk c-1;
                                                                          weight grads ‖ the last RSs
    cm_linear_reduce_scatter(x, w, d, ax, k)  linear chunk c+1 ‖ RS chunk c  AG chunk c+1 ‖ linear' chunk c

Chunk c of a rank's slice is rows [o_c, o_c + s_c) of its S_l sequence positions
(`torch.tensor_split` sizes); all-gathering it gives those rows of every rank, i.e. rows
r·S_l + o_c … of the whole sequence for r = 0 … tp-1, so results are written back at those
rows. `cm_gather_linear` takes every linear that reads one gather (q, k and v; gate and up)
and returns their outputs plus the gathered input (in sequence-first layout), which the
backward needs for the weight gradients — the same tensor the unchunked linear keeps.

The backward of each op is its own custom op (`*_backward`), so joint traces hold only
`autohybrid::` nodes. A one-rank or unbound axis computes the plain linear. The values
equal the unchunked ops' up to the rounding of summing in another order (a row's matmul
is computed by another GEMM call); passes/collective_matmul.py chooses where to use them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import groups
from .tensor_parallel import _shard_shape


def bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """(offset, size) of each of `chunks` pieces of `length` rows (at most one per row)."""
    chunks = max(1, min(chunks, length))
    base, extra = divmod(length, chunks)
    out, offset = [], 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        out.append((offset, size))
        offset += size
    return out


def _rows(full: torch.Tensor, n: int, offset: int, size: int) -> torch.Tensor:
    """Rows [offset, offset + size) of each of the n rank blocks of sequence-first `full`,
    stacked rank-major: the layout a chunk's all-gather produces and its reduce-scatter
    consumes."""
    blocks = full.view(n, full.shape[0] // n, *full.shape[1:])
    return blocks[:, offset:offset + size].reshape(n * size, *full.shape[1:])


def _put(full: torch.Tensor, n: int, offset: int, part: torch.Tensor) -> None:
    """Write rank-major `part` (n × size rows) back at its rows of sequence-first `full`."""
    size = part.shape[0] // n
    blocks = full.view(n, full.shape[0] // n, *full.shape[1:])
    blocks[:, offset:offset + size] = part.view(n, size, *part.shape[1:])


def _start_gather(x: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    src = x.contiguous()
    out = src.new_empty((dist.get_world_size(group) * src.shape[0], *src.shape[1:]))
    return out, groups.all_gather_single(out, src, group=group, async_op=True)


def _start_scatter(x: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    src = x.contiguous()
    out = src.new_empty((src.shape[0] // dist.get_world_size(group), *src.shape[1:]))
    return out, groups.reduce_scatter_single(out, src, group=group, async_op=True)


def _gathered_chunks(xs: torch.Tensor, pieces: list[tuple[int, int]], group):
    """(offset, all-gathered rows) of each chunk of sequence-first `xs` in turn, the next
    chunk's all-gather issued before this one is waited for, so that it travels while
    the caller multiplies this one."""
    pending = _start_gather(xs[pieces[0][0]:pieces[0][0] + pieces[0][1]], group)
    for c, (offset, _) in enumerate(pieces):
        buf, work = pending
        if c + 1 < len(pieces):
            o, s = pieces[c + 1]
            pending = _start_gather(xs[o:o + s], group)
        work.wait()
        yield offset, buf


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


# ------------------------------------------------------------------ gather → linear

def gather_linear(x: torch.Tensor, weights: list[torch.Tensor],
                  biases: list[Optional[torch.Tensor]], dim: int, group, chunks: int
                  ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(linear(all_gather(x, dim), w_j, b_j) for each j, the gathered x sequence-first)."""
    xs = x.movedim(dim, 0)
    if group is None:
        full = xs.contiguous()
        return [F.linear(x, w, b) for w, b in zip(weights, biases)], full
    n = dist.get_world_size(group)
    full = xs.new_empty((n * xs.shape[0], *xs.shape[1:]))
    outs = [xs.new_empty((n * xs.shape[0], *xs.shape[1:-1], w.shape[0])) for w in weights]
    for offset, buf in _gathered_chunks(xs, bounds(xs.shape[0], chunks), group):
        _put(full, n, offset, buf)
        for out, w, b in zip(outs, weights, biases):
            _put(out, n, offset, F.linear(buf, w, b))
    return [o.movedim(0, dim).contiguous() for o in outs], full


def gather_linear_backward(grads: list[torch.Tensor], full: torch.Tensor,
                           weights: list[torch.Tensor], has_bias: list[bool], dim: int,
                           group, chunks: int) -> list[torch.Tensor]:
    """[grad x, grad w_j…, grad b_j for the j with a bias…]: the input gradient summed
    over the linears and reduce-scattered chunk by chunk, the weight gradients computed
    while the last chunks travel."""
    gs = [g.movedim(dim, 0).contiguous() for g in grads]
    n = 1 if group is None else dist.get_world_size(group)
    local = full.shape[0] // n
    parts = []
    for offset, size in bounds(local, chunks if group is not None else 1):
        rows = [_rows(g, n, offset, size) for g in gs]
        part = sum(r @ w for r, w in zip(rows, weights))
        parts.append(_start_scatter(part, group) if group is not None else (part, None))
    flat_x = _flat(full)
    weight_grads = [_flat(g).t() @ flat_x for g in gs]
    bias_grads = [_flat(g).sum(0) for g, has in zip(gs, has_bias) if has]
    for _, work in parts:
        if work is not None:
            work.wait()
    gx = torch.cat([p for p, _ in parts]).movedim(0, dim).contiguous()
    return [gx, *weight_grads, *bias_grads]


def _with_gaps(biases: list[torch.Tensor], has_bias: list[bool]) -> list[Optional[torch.Tensor]]:
    present = iter(biases)
    return [next(present) if has else None for has in has_bias]


@torch.library.custom_op("autohybrid::cm_gather_linear", mutates_args=())
def cm_gather_linear(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                     has_bias: list[bool], dim: int, axis: str, chunks: int
                     ) -> list[torch.Tensor]:
    """[linear(sp_gather(x, dim, axis), w_j, b_j) for each j…, the gathered x
    (sequence-first)], transferred and multiplied in `chunks` pipelined pieces. `biases`
    holds the biases of the linears j with `has_bias[j]`, in order."""
    outs, full = gather_linear(x, weights, _with_gaps(biases, has_bias), dim, groups.peers(axis),
                               chunks)
    return [*outs, full]


@cm_gather_linear.register_fake
def _(x, weights, biases, has_bias, dim, axis, chunks):
    n = groups.size(axis)
    shape = list(x.shape)
    shape[dim] = shape[dim] * n
    outs = [x.new_empty((*shape[:-1], w.shape[0])) for w in weights]
    first = [shape[dim]] + [s for i, s in enumerate(x.shape) if i != dim]
    return [*outs, x.new_empty(first)]


@torch.library.custom_op("autohybrid::cm_gather_linear_backward", mutates_args=())
def cm_gather_linear_backward(grads: list[torch.Tensor], full: torch.Tensor,
                              weights: list[torch.Tensor], has_bias: list[bool], dim: int,
                              axis: str, chunks: int) -> list[torch.Tensor]:
    """Backward of `cm_gather_linear`: [grad x, grad w_j…, grad b_j (with a bias)…]."""
    return gather_linear_backward(grads, full, weights, has_bias, dim, groups.peers(axis), chunks)


@cm_gather_linear_backward.register_fake
def _(grads, full, weights, has_bias, dim, axis, chunks):
    n = groups.size(axis)
    rest = list(full.shape[1:])
    shape = rest[:dim] + [full.shape[0] // n] + rest[dim:]
    return [full.new_empty(shape), *[w.new_empty(w.shape) for w in weights],
            *[full.new_empty((w.shape[0],)) for w, has in zip(weights, has_bias) if has]]


def _gather_setup(ctx, inputs, output) -> None:
    x, weights, biases, has_bias, dim, axis, chunks = inputs
    ctx.has_bias = list(has_bias)
    ctx.args = (dim, axis, chunks)
    ctx.save_for_backward(output[-1], *weights)


def _gather_backward(ctx, grads):
    full, *weights = ctx.saved_tensors
    result = cm_gather_linear_backward(list(grads[:-1]), full, weights, ctx.has_bias,
                                       *ctx.args)
    k = len(weights)
    return result[0], result[1:1 + k], result[1 + k:], None, None, None, None


cm_gather_linear.register_autograd(_gather_backward, setup_context=_gather_setup)


# ------------------------------------------------------------------ linear → reduce-scatter

def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, dim: int, group,
                          chunks: int) -> torch.Tensor:
    """reduce_scatter(linear(x, weight), dim): each chunk's rows reduce-scattered while the
    next chunk is multiplied."""
    if group is None:
        return F.linear(x, weight)
    n = dist.get_world_size(group)
    xs = x.movedim(dim, 0)
    local = _shard_shape(xs, 0, n, "cm_linear_reduce_scatter", "tp")[0]
    parts = [_start_scatter(F.linear(_rows(xs, n, offset, size), weight), group)
             for offset, size in bounds(local, chunks)]
    for _, work in parts:
        work.wait()
    return torch.cat([p for p, _ in parts]).movedim(0, dim).contiguous()


def linear_reduce_scatter_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   dim: int, group, chunks: int) -> list[torch.Tensor]:
    """[grad x, grad weight]: the output gradient all-gathered chunk by chunk, each chunk's
    input gradient computed while the next one travels."""
    if group is None:
        return [grad @ weight, _flat(grad).t() @ _flat(x)]
    n = dist.get_world_size(group)
    gs = grad.movedim(dim, 0)
    xs = x.movedim(dim, 0)
    whole = gs.new_empty((n * gs.shape[0], *gs.shape[1:]))
    gx = xs.new_empty(xs.shape)
    for offset, buf in _gathered_chunks(gs, bounds(gs.shape[0], chunks), group):
        _put(whole, n, offset, buf)
        _put(gx, n, offset, buf @ weight)
    return [gx.movedim(0, dim).contiguous(), _flat(whole).t() @ _flat(xs)]


@torch.library.custom_op("autohybrid::cm_linear_reduce_scatter", mutates_args=())
def cm_linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, dim: int, axis: str,
                             chunks: int) -> torch.Tensor:
    """sp_reduce_scatter(linear(x, weight), dim, axis), multiplied and reduce-scattered in
    `chunks` pipelined pieces."""
    return linear_reduce_scatter(x, weight, dim, groups.peers(axis), chunks)


@cm_linear_reduce_scatter.register_fake
def _(x, weight, dim, axis, chunks):
    shape = _shard_shape(x, dim, groups.size(axis), "cm_linear_reduce_scatter", axis)
    return x.new_empty((*shape[:-1], weight.shape[0]))


@torch.library.custom_op("autohybrid::cm_linear_reduce_scatter_backward", mutates_args=())
def cm_linear_reduce_scatter_backward(grad: torch.Tensor, x: torch.Tensor,
                                      weight: torch.Tensor, dim: int, axis: str,
                                      chunks: int) -> list[torch.Tensor]:
    """Backward of `cm_linear_reduce_scatter`: [grad x, grad weight]."""
    return linear_reduce_scatter_backward(grad, x, weight, dim, groups.peers(axis), chunks)


@cm_linear_reduce_scatter_backward.register_fake
def _(grad, x, weight, dim, axis, chunks):
    return [x.new_empty(x.shape), weight.new_empty(weight.shape)]


def _scatter_setup(ctx, inputs, output) -> None:
    x, weight, dim, axis, chunks = inputs
    ctx.args = (dim, axis, chunks)
    ctx.save_for_backward(x, weight)


def _scatter_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = cm_linear_reduce_scatter_backward(grad, x, weight, *ctx.args)
    return gx, gw, None, None, None


cm_linear_reduce_scatter.register_autograd(_scatter_backward, setup_context=_scatter_setup)

#: the graph ops passes/collective_matmul.py inserts
cm_gather_linear_op = torch.ops.autohybrid.cm_gather_linear.default
cm_linear_reduce_scatter_op = torch.ops.autohybrid.cm_linear_reduce_scatter.default
