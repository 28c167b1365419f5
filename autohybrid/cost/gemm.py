"""Shape-aware GEMM time: the share of a GPU a GEMM of a given shape keeps busy.

A GEMM's output is cut into tiles, one thread block per tile, and the blocks run on the
device's SMs in waves. A GEMM whose tiles do not fill the last wave — a thin tensor-
parallel shard, a small hidden size, a short sequence — leaves SMs idle for that wave,
and a dimension that is not a multiple of the tile computes padding (tile and wave
quantization; NVIDIA's "Matrix Multiplication Background" guide, figures in
hardware.GEMM_TILES and DeviceSpec.sm_count). The library picks the tile that wastes
least, so the utilization is the best over the tiles.

Utilization multiplies the large-GEMM efficiency of cost/compute.py (MATMUL_EFFICIENCY):
a GEMM that fills its waves exactly runs at that efficiency, the rest below it. A device
without an SM count (a CPU, a calibrated unknown device) has no tile model: utilization 1.

>>> from autohybrid import hardware
>>> a100 = hardware.device("A100-80GB")
>>> wave_utilization(a100.sm_count, 1, 2048, 6912)   # 864 tiles of 128×128: 8 full waves
1.0
>>> round(wave_utilization(a100.sm_count, 1, 2048, 864), 2)   # the same GEMM split 8 ways
0.67
"""
from __future__ import annotations

from math import ceil

from ..hardware import GEMM_TILES


def wave_utilization(sm_count: int, count: int, m: int, n: int) -> float:
    """Share of the SM-time a batch of `count` (m × n)-output GEMMs uses for its own
    outputs: useful tile area over the waves' area, the best over `GEMM_TILES`."""
    if not sm_count or count <= 0 or m <= 0 or n <= 0:
        return 1.0
    best = 0.0
    for rows, cols in GEMM_TILES:
        tiles = count * ceil(m / rows) * ceil(n / cols)
        waves = ceil(tiles / sm_count)
        best = max(best, count * m * n / (waves * sm_count * rows * cols))
    return best
