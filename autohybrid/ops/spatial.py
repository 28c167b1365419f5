"""Spatial parallelism for CNNs: activations tiled along H (and W), halos exchanged.

Each rank of a mesh axis holds one tile of an activation (N, C, [D,] H, W) along one
dimension; tiles are balanced and in rank order and need not be equal (`tile_bounds`:
the first `size % parts` tiles are one row larger). Before a convolution or pooling whose
window reaches into a neighbour's rows, `halo_fetch` brings this rank the rows its output
tile needs (the halo, from any rank that holds them: adjacent or further, as small tiles
with a wide window need); the window op then runs on the slab with no padding along that
dimension. Two mesh axes tile H and W: fetch along H over one axis, then along W over
the other (the second exchange carries the first's halo rows, so corners arrive too).

    op                                          forward                   backward
    halo_fetch(x, dim, size, out_size, kernel,  the slab of input rows    halo_return:
               stride, padding, dilation,       this rank's output tile   each row's grad
               axis, pad_value)                 needs (pad_value outside  back to its owner,
                                                [0, size))                summed there
    halo_return(g, dim, size, out_size, kernel, the adjoint of the above  halo_fetch (pad 0)
                stride, padding, dilation, axis)
    spatial_split(x, dim, axis)                 this rank's tile of x     spatial_gather
    spatial_gather(x, dim, size, axis)          all-gather of the tiles   spatial_split
                                                (uneven: padded, trimmed)

`spatial_gather` is for a replicated consumer (a classifier computing the same on every
rank), whose gradient is the same everywhere: its backward keeps this rank's slice.
Batch statistics over tiles are those of the whole activation with
`ops.batch_norm.sync_batch_norm(x, w, b, eps, axis)` over the spatial axis (for two
tiled dimensions: an axis bound to the group of both); parameter gradients of layers on
tiles are per-rank partial sums, to be summed over the spatial axes like data-parallel
ones.

The exchange is one `all_to_all_single` with per-peer sizes (gloo and NCCL take uneven
splits): a rank sends a peer only the rows that peer needs, and when no rank needs
another's rows (kernel 1, stride 1) nothing is exchanged. Every rank derives every
rank's ranges from the same arguments, so the sizes agree without a handshake. A
None or one-rank group means no communication. Outputs are new contiguous tensors.

Partition arithmetic (pure functions): `tile_bounds`, `window_input_range`,
`conv_output_size`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from . import groups
from .partition import balanced_bounds

Range = tuple[int, int]


# ------------------------------------------------------------------ partition arithmetic

def tile_bounds(size: int, parts: int) -> list[Range]:
    """[lo, hi) of each of `parts` balanced tiles of `size` rows, in rank order; the first
    `size % parts` tiles are one row larger (tiles may be empty when size < parts)."""
    if parts < 1 or size < 0:
        raise RuntimeFailure(f"tile_bounds: cannot split {size} rows into {parts} tiles; "
                             "give size >= 0 and parts >= 1")
    return balanced_bounds(size, parts)


def window_input_range(out_lo: int, out_hi: int, kernel: int, stride: int = 1,
                       padding: int = 0, dilation: int = 1) -> Range:
    """The global input rows [in_lo, in_hi) that output rows [out_lo, out_hi) of a window
    op (conv, pooling) read; rows below 0 or past the input are its padding. An empty
    output range reads nothing: (in_lo, in_lo)."""
    in_lo = out_lo * stride - padding
    if out_hi <= out_lo:
        return in_lo, in_lo
    return in_lo, (out_hi - 1) * stride - padding + dilation * (kernel - 1) + 1


def conv_output_size(size: int, kernel: int, stride: int = 1, padding: int = 0,
                     dilation: int = 1) -> int:
    """Output rows of a conv/pool (floor mode) over `size` input rows."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _count(r: Range) -> int:
    return r[1] - r[0]


def _overlap(a: Range, b: Range) -> Range:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, max(lo, hi))


class _Routes:
    """Who sends which rows to whom, for one rank of an `n`-rank axis (every rank computes
    every rank's ranges, so all agree on the split sizes)."""

    def __init__(self, rank: int, n: int, size: int, out_size: int, kernel: int, stride: int,
                 padding: int, dilation: int):
        tiles = tile_bounds(size, n)
        need = [window_input_range(*o, kernel, stride, padding, dilation)
                for o in tile_bounds(out_size, n)]
        inside = [_overlap(r, (0, size)) for r in need]
        self.tile = tiles[rank]
        self.in_lo, self.in_hi = need[rank]
        self.send = [_overlap(self.tile, inside[q]) for q in range(n)]  # global rows
        self.recv = [_overlap(inside[rank], tiles[q]) for q in range(n)]
        total = self.in_hi - self.in_lo
        self.pad_lo = min(max(0, -self.in_lo), total)
        self.inside = inside[rank][1] - inside[rank][0]
        self.pad_hi = total - self.pad_lo - self.inside
        # any rows crossing ranks anywhere? (the same answer on every rank)
        self.crosses = any(_count(_overlap(tiles[p], inside[q]))
                           for p in range(n) for q in range(n) if p != q)


def _position(axis: str) -> tuple[dist.ProcessGroup | None, int, int]:
    """(group or None, this rank's index in it, its size)."""
    group = groups.get(axis)
    if group is None or dist.get_world_size(group) == 1:
        return None, 0, 1
    return group, group.rank(), group.size()   # (also a fake group, with no default one)


def _routes(x: torch.Tensor, dim: int, size: int, out_size: int, kernel: int, stride: int,
            padding: int, dilation: int, axis: str, op: str
            ) -> tuple[dist.ProcessGroup | None, _Routes]:
    """The group and routes of this rank; checks that `x` has the rows it should along
    `dim` (its input tile for halo_fetch, its slab for halo_return)."""
    group, rank, n = _position(axis)
    if min(kernel, stride, dilation) < 1 or padding < 0:
        raise RuntimeFailure(f"autohybrid::{op}: kernel {kernel}, stride {stride}, dilation "
                             f"{dilation}, padding {padding}: give kernel, stride and "
                             "dilation >= 1 and padding >= 0")
    if out_size < n:
        raise RuntimeFailure(f"autohybrid::{op}: the output has {out_size} rows along dim "
                             f"{dim}, fewer than the {n} ranks of mesh axis {axis!r}, so a "
                             "rank would hold an empty output tile; tile that dimension "
                             f"over at most {out_size} ranks")
    r = _Routes(rank, n, size, out_size, kernel, stride, padding, dilation)
    rows, what = ((r.tile[1] - r.tile[0], f"its tile of {size} rows over {n} ranks")
                  if op == "halo_fetch" else
                  (r.in_hi - r.in_lo, "its slab (halo_fetch's output)"))
    if x.shape[dim] != rows:
        raise RuntimeFailure(f"autohybrid::{op}: rank {rank} of mesh axis {axis!r} holds "
                             f"{x.shape[dim]} rows along dim {dim} (shape {tuple(x.shape)}); "
                             f"{what} has {rows}: give each rank its spatial_split "
                             "(tile_bounds) tile and the global size of the dimension")
    return group, r


def _exchange(parts: list[torch.Tensor], recv_sizes: list[int], group) -> list[torch.Tensor]:
    """Send parts[q] (rows along dim 0) to rank q of `group`; the rows from each rank."""
    src = torch.cat(parts, 0).contiguous()
    out = src.new_empty((sum(recv_sizes), *src.shape[1:]))
    dist.all_to_all_single(out, src, output_split_sizes=recv_sizes,
                           input_split_sizes=[p.shape[0] for p in parts], group=group)
    return list(out.split(recv_sizes, 0))


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(dim, 0)


def _back(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.movedim(0, dim).contiguous()


def _rows(x: torch.Tensor, r: Range, lo: int) -> torch.Tensor:
    """Global rows `r` of a front-dim tensor whose first row is global row `lo` (an empty
    range may lie outside it)."""
    return x.narrow(0, r[0] - lo, r[1] - r[0]) if r[1] > r[0] else x.narrow(0, 0, 0)


# ------------------------------------------------------------------ halo exchange

@torch.library.custom_op("autohybrid::halo_fetch", mutates_args=())
def halo_fetch(x: torch.Tensor, dim: int, size: int, out_size: int, kernel: int, stride: int,
               padding: int, dilation: int, axis: str, pad_value: float) -> torch.Tensor:
    """The input rows [in_lo, in_hi) (`window_input_range` of this rank's output tile) of
    a tensor tiled along `dim`; rows outside [0, size) are `pad_value`."""
    dim %= x.dim()
    group, r = _routes(x, dim, size, out_size, kernel, stride, padding, dilation, axis,
                       "halo_fetch")
    src = _front(x, dim)
    if group is None or not r.crosses:
        pieces = [_rows(src, _overlap(r.tile, (r.in_lo, r.in_hi)), r.tile[0])]
    else:
        pieces = _exchange([_rows(src, s, r.tile[0]) for s in r.send],
                           [hi - lo for lo, hi in r.recv], group)
    shape = src.shape[1:]
    pad = [src.new_full((r.pad_lo, *shape), pad_value), *pieces,
           src.new_full((r.pad_hi, *shape), pad_value)]
    return _back(torch.cat(pad, 0), dim)


@torch.library.custom_op("autohybrid::halo_return", mutates_args=())
def halo_return(grad: torch.Tensor, dim: int, size: int, out_size: int, kernel: int,
                stride: int, padding: int, dilation: int, axis: str) -> torch.Tensor:
    """halo_fetch's adjoint: each slab row's gradient summed on the rank whose tile holds
    that row (padding rows dropped); the gradient of this rank's tile."""
    dim %= grad.dim()
    group, r = _routes(grad, dim, size, out_size, kernel, stride, padding, dilation, axis,
                       "halo_return")
    g = _front(grad, dim).narrow(0, r.pad_lo, r.inside)
    lo = max(r.in_lo, 0)
    out = g.new_zeros((r.tile[1] - r.tile[0], *g.shape[1:]))
    if group is None or not r.crosses:
        own = _overlap(r.tile, (r.in_lo, r.in_hi))
        _rows(out, own, r.tile[0]).add_(_rows(g, own, lo))
    else:
        got = _exchange([_rows(g, rows, lo) for rows in r.recv],
                        [b - a for a, b in r.send], group)
        for rows, piece in zip(r.send, got):
            _rows(out, rows, r.tile[0]).add_(piece)
    return _back(out, dim)


def _slab_shape(x, dim, size, out_size, kernel, stride, padding, dilation, axis, op):
    dim %= x.dim()
    _, r = _routes(x, dim, size, out_size, kernel, stride, padding, dilation, axis, op)
    shape = list(x.shape)
    shape[dim] = r.in_hi - r.in_lo if op == "halo_fetch" else r.tile[1] - r.tile[0]
    return shape


@halo_fetch.register_fake
def _(x, dim, size, out_size, kernel, stride, padding, dilation, axis, pad_value):
    return x.new_empty(_slab_shape(x, dim, size, out_size, kernel, stride, padding,
                                   dilation, axis, "halo_fetch"))


@halo_return.register_fake
def _(grad, dim, size, out_size, kernel, stride, padding, dilation, axis):
    return grad.new_empty(_slab_shape(grad, dim, size, out_size, kernel, stride, padding,
                                      dilation, axis, "halo_return"))


def _fetch_setup(ctx, inputs, output) -> None:
    ctx.args = inputs[1:-1]   # all but x and pad_value


def _fetch_backward(ctx, grad):
    return (halo_return(grad, *ctx.args), *[None] * (len(ctx.args) + 1))


def _return_setup(ctx, inputs, output) -> None:
    ctx.args = inputs[1:]


def _return_backward(ctx, grad):
    return (halo_fetch(grad, *ctx.args, 0.0), *[None] * len(ctx.args))


halo_fetch.register_autograd(_fetch_backward, setup_context=_fetch_setup)
halo_return.register_autograd(_return_backward, setup_context=_return_setup)


# ------------------------------------------------------------------ split / gather

@torch.library.custom_op("autohybrid::spatial_split", mutates_args=())
def spatial_split(x: torch.Tensor, dim: int, axis: str) -> torch.Tensor:
    """This rank's tile (`tile_bounds`) of `x` along `dim`; backward all-gathers."""
    dim %= x.dim()
    _, rank, n = _position(axis)
    lo, hi = tile_bounds(x.shape[dim], n)[rank]
    return x.narrow(dim, lo, hi - lo).clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("autohybrid::spatial_gather", mutates_args=())
def spatial_gather(x: torch.Tensor, dim: int, size: int, axis: str) -> torch.Tensor:
    """The whole tensor (`size` rows along `dim`) from every rank's tile; backward keeps
    this rank's slice of the (replicated) gradient."""
    dim %= x.dim()
    group, rank, n = _position(axis)
    tiles = tile_bounds(size, n)
    if x.shape[dim] != tiles[rank][1] - tiles[rank][0]:
        raise RuntimeFailure(f"autohybrid::spatial_gather: rank {rank} of mesh axis {axis!r} "
                             f"holds {x.shape[dim]} rows along dim {dim}; its tile of {size} "
                             f"rows over {n} ranks has {tiles[rank][1] - tiles[rank][0]}: "
                             "pass the global size of the tiled dimension")
    if group is None:
        return x.clone(memory_format=torch.contiguous_format)
    src = _front(x, dim)
    widest = max(hi - lo for lo, hi in tiles)
    if src.shape[0] < widest:   # all-gather takes equal parts: pad, then trim
        src = torch.cat([src, src.new_zeros((widest - src.shape[0], *src.shape[1:]))], 0)
    src = src.contiguous()
    out = src.new_empty((n * widest, *src.shape[1:]))
    groups.all_gather_single(out, src, group=group)
    parts = [out.narrow(0, q * widest, hi - lo) for q, (lo, hi) in enumerate(tiles)]
    return _back(torch.cat(parts, 0), dim)


@spatial_split.register_fake
def _(x, dim, axis):
    dim %= x.dim()
    _, rank, n = _position(axis)
    lo, hi = tile_bounds(x.shape[dim], n)[rank]
    shape = list(x.shape)
    shape[dim] = hi - lo
    return x.new_empty(shape)


@spatial_gather.register_fake
def _(x, dim, size, axis):
    shape = list(x.shape)
    shape[dim % x.dim()] = size
    return x.new_empty(shape)


def _split_setup(ctx, inputs, output) -> None:
    x, dim, axis = inputs
    ctx.args = (dim, x.shape[dim % x.dim()], axis)


def _split_backward(ctx, grad):
    return spatial_gather(grad, *ctx.args), None, None


def _gather_setup(ctx, inputs, output) -> None:
    ctx.args = (inputs[1], inputs[3])


def _gather_backward(ctx, grad):
    return spatial_split(grad, *ctx.args), None, None, None


spatial_split.register_autograd(_split_backward, setup_context=_split_setup)
spatial_gather.register_autograd(_gather_backward, setup_context=_gather_setup)
