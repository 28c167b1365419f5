"""Balanced splits of a row count: the one partition arithmetic the ops share.

`balanced_bounds(size, parts)` is [lo, hi) of each of `parts` contiguous pieces of
`size` rows, in order, the first `size % parts` one row larger, some empty when size <
parts. Spatial parallelism's tiles (ops/spatial.tile_bounds) and a MoE layer's token
chunks (ops/moe.chunk_bounds) are cut by it.

    >>> balanced_bounds(7, 3)
    [(0, 3), (3, 5), (5, 7)]
"""
from __future__ import annotations

from ..errors import RuntimeFailure


def balanced_bounds(size: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `parts` balanced pieces of `size` rows (module docstring)."""
    if parts < 1 or size < 0:
        raise RuntimeFailure(f"cannot split {size} rows into {parts} pieces; give size >= 0 "
                             "and parts >= 1")
    base, extra = divmod(size, parts)
    bounds, lo = [], 0
    for i in range(parts):
        hi = lo + base + (i < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds
