"""Which boxes of a whole tensor one rank holds, and where in its local tensor.

A checkpoint stores every tensor in its whole shape, written as boxes (offsets and sizes in
the whole tensor) by the ranks that hold them; on load, DCP (torch.distributed.checkpoint)
reads into each box a rank needs the overlap of every saved box. That is what lets any
plan load any other plan's checkpoint without gathering a tensor anywhere. This module
owns the arithmetic only (no I/O, no processes): for one tensor of this rank, the boxes of
the whole tensor it holds and the view of the local tensor that holds each.

A rank's local tensor is one of:
- the whole tensor (a replicated parameter, buffer or optimizer state);
- its tensor-parallel shard (`ShardSpec`, autohybrid/program.py): along `spec.dim`, a
  piece of every block, each followed by zero padding the whole tensor does not have
  (and along `spec.inner.dim` the same again: expert tensor parallelism under ep);
- its ZeRO flat shard (runtime/zero.py): elements [r·c, (r+1)·c) of the row-major
  flattening of the whole or tp-local tensor, zero-padded at the end.

A flat range of a row-major tensor is a few boxes that are each contiguous (a partial
row, whole rows, a partial row, recursively), so even a ZeRO shard of a tp shard is a
list of boxes; the padding is in no box.

    >>> [b.offsets for b in boxes((4, 6), (4, 6), flat=(9, 15))]
    [(1, 3), (2, 0)]
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from ..ops.zero import chunk
from ..program import ShardSpec

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A box of the whole tensor (`offsets`, `sizes`) and where the local tensor holds it:
    the contiguous span of `span` shape at flat element `flat_start` of the local tensor,
    narrowed to each (dim, start, length) of `narrow`."""

    offsets: Shape
    sizes: Shape
    flat_start: int
    span: Shape
    narrow: tuple[tuple[int, int, int], ...] = ()

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The view of `local` that holds this box (writes through to `local`)."""
        if self.flat_start == 0 and self.span == tuple(local.shape):
            v = local
        else:
            if not local.is_contiguous():
                raise ValueError("a sharded local tensor must be contiguous")
            v = local.view(-1)[self.flat_start: self.flat_start + math.prod(self.span)]
            v = v.view(self.span)
        for dim, start, length in self.narrow:
            v = v.narrow(dim, start, length)
        return v

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_spans(shape: Shape, lo: int, hi: int) -> list[tuple[Shape, Shape]]:
    """Contiguous boxes (start index, sizes) covering elements [lo, hi) of a row-major
    tensor of `shape`, in order."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    row, rest = divmod(lo, inner)
    out: list[tuple[Shape, Shape]] = []
    if rest:  # the end of a partial first row
        end = min(hi, (row + 1) * inner)
        out += [((row, *s), (1, *z)) for s, z in flat_spans(shape[1:], rest, end - row * inner)]
        row, lo = row + 1, end
    rows = (hi - lo) // inner
    if rows:
        out.append(((row, *(0,) * (len(shape) - 1)), (rows, *shape[1:])))
        row, lo = row + rows, lo + rows * inner
    if lo < hi:  # the start of a partial last row
        out += [((row, *s), (1, *z)) for s, z in flat_spans(shape[1:], 0, hi - lo)]
    return out


def tp_pieces(spec: ShardSpec) -> list[tuple[int, int, int]]:
    """(local start, whole start, length) along `spec.dim` of each piece of the whole
    tensor a tp shard holds (ShardSpec.local_from's layout; padding is in no piece)."""
    pieces, local, whole = [], 0, 0
    for block, padded in spec.block_sizes():
        width = padded // spec.ways
        lo = spec.index * width
        start, stop = min(lo, block), min(lo + width, block)
        if stop > start:
            pieces.append((local, whole + start, stop - start))
        local += width
        whole += block
    return pieces


def zero_range(numel: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The flat elements [lo, hi) of a tensor of `numel` elements that ZeRO rank
    `dp_rank` of `dp` holds (its shard's padding excluded)."""
    c = chunk(numel, dp)
    return min(dp_rank * c, numel), min((dp_rank + 1) * c, numel)


def boxes(whole: Shape, local: Shape, spec: ShardSpec | None = None,
          flat: tuple[int, int] | None = None) -> list[Box]:
    """The boxes of a tensor of `whole` shape that this rank holds.

    `local` is the shape of the whole or tp-local tensor (`spec`: this rank's tp shard of
    the whole one; None: it is the whole one). `flat`: the local tensor is a flat shard
    holding elements [lo, hi) of that tensor's flattening (ZeRO), else it is that tensor."""
    whole, local = tuple(whole), tuple(local)
    if spec is None and local != whole:
        raise ValueError(f"local shape {local} is not the whole shape {whole}")
    if flat is None:
        spans, lo = [((0,) * len(local), local)], 0
        flat_lo = 0
    else:
        lo, hi = flat
        spans, flat_lo = flat_spans(local, lo, hi), lo
    out: list[Box] = []
    offset = flat_lo
    cuts = []   # (dim, its pieces) of the spec and of its inner one (other dims)
    while spec is not None:
        cuts.append([(spec.dim, piece) for piece in tp_pieces(spec)])
        spec = spec.inner
    for start, sizes in spans:
        where = offset - flat_lo
        offset += math.prod(sizes)
        for combo in itertools.product(*cuts):   # one piece along each cut dim
            offsets, cut, narrow = list(start), list(sizes), []
            for d, (local_start, whole_start, length) in combo:
                a = max(start[d], local_start)
                b = min(start[d] + sizes[d], local_start + length)
                if a >= b:
                    break
                offsets[d] = whole_start + (a - local_start)
                cut[d] = b - a
                if (a, b) != (start[d], start[d] + sizes[d]):
                    narrow.append((d, a - start[d], b - a))
            else:
                out.append(Box(tuple(offsets), tuple(cut), where, sizes, tuple(narrow)))
    return [b for b in out if b.numel > 0 or not b.sizes]
