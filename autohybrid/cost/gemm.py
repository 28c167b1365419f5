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
without an SM count (a CPU, an unknown device) has no tile model; where `ah.calibrate`
timed GEMMs of several sizes (DeviceSpec.gemm_curves) a GEMM runs at the measured rate
of its size relative to the best (`curve_utilization`), else at utilization 1. Fused
attention (SDPA's flash kernels) is tiled by blocks of queries per head
(`attention_utilization`); on a device without SMs it keeps utilization 1.

>>> from autohybrid import hardware
>>> a100 = hardware.device("A100-80GB")
>>> wave_utilization(a100.sm_count, 1, 2048, 6912)   # 864 tiles of 128×128: 8 full waves
1.0
>>> round(wave_utilization(a100.sm_count, 1, 2048, 864), 2)   # the same GEMM split 8 ways
0.67
"""
from __future__ import annotations

from math import ceil, log

from ..hardware import ATTENTION_QUERY_BLOCK, GEMM_TILES


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


def curve_utilization(curve: tuple[tuple[float, float], ...], flops: float) -> float:
    """The measured rate of a GEMM call of `flops` relative to the best measured (`curve`:
    ascending (FLOPs, share) points), linear in log FLOPs between points, the end points'
    share beyond them."""
    if not curve:
        return 1.0
    if flops <= curve[0][0]:
        return curve[0][1]
    for (f0, u0), (f1, u1) in zip(curve, curve[1:]):
        if flops <= f1:
            return u0 + (u1 - u0) * (log(flops) - log(f0)) / (log(f1) - log(f0))
    return curve[-1][1]


def attention_utilization(sm_count: int, count: int, queries: int) -> float:
    """Share of the SM-time fused attention over `count` (batch × heads) of `queries`
    queries uses: one thread block per head and block of `ATTENTION_QUERY_BLOCK` queries
    (each over the whole head dimension and every key), in waves of `sm_count`."""
    if not sm_count or count <= 0 or queries <= 0:
        return 1.0
    tiles = count * ceil(queries / ATTENTION_QUERY_BLOCK)
    return count * queries / (ceil(tiles / sm_count) * sm_count * ATTENTION_QUERY_BLOCK)


def utilization(device, dtype: str, count: int, m: int, n: int, k: int,
                kind: str = "gemm") -> float:
    """The share of `device`'s large-GEMM rate a call of `count` (m × k)·(k × n) GEMMs
    gets (`kind` "attention": fused attention of `count` heads over m queries): the tile
    model where the device has SMs, its calibrated curve for `dtype` where it has one
    (GEMMs only: the curve times matmuls), else 1."""
    if device.sm_count:
        if kind == "attention":
            return attention_utilization(device.sm_count, count, m)
        return wave_utilization(device.sm_count, count, m, n)
    if kind == "attention":
        return 1.0
    curve = dict(device.gemm_curves).get(dtype)
    return curve_utilization(curve, 2.0 * count * m * n * k) if curve else 1.0
