"""Balanced pipeline stages: split a sequence of layer costs into p contiguous stages.

Minimizes the largest stage cost (the pipeline runs at the pace of its slowest stage) by
dynamic programming over prefix sums: best[k][j] = min over i of max(best[k-1][i],
sum(cost[i:j])). The inner minimum sits where a non-decreasing and a non-increasing
function of i cross, found by bisection, so the whole DP is O(p · L · log L). Each
stage count's row is computed for every j at once with numpy (the planner partitions
hundreds of layer-cost lists of GPT-3's ~100 layers into up to 96 stages); the float
operations and the tie rule are those of the scalar loop (`_partition_loop`, kept as
the reference the tests compare with), so the split is the same.

Example::

    >>> partition([1, 1, 1, 1, 4], 2)
    ((0, 4), 4.0)
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Sequence

import numpy as np


def partition(costs: Sequence[float], stages: int) -> tuple[tuple[int, ...], float]:
    """(start index of each stage, cost of the slowest stage); every stage non-empty."""
    n = len(costs)
    if stages < 1 or stages > n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    prefix_list = [0.0, *accumulate(float(c) for c in costs)]
    if any(c < 0 for c in prefix_list) or any(
            b < a for a, b in zip(prefix_list, prefix_list[1:])):
        return _partition_loop(costs, stages)  # negative costs: bisection's premise fails
    prefix = np.array(prefix_list, dtype=np.float64)
    best = prefix.copy()                              # one stage: layers [0, j)
    choice: list[np.ndarray] = [np.zeros(n + 1, dtype=np.int64)]
    for k in range(2, stages + 1):
        # for j in [k, n]: the first i in [k-1, j-1] with best[i] + prefix[i] >= prefix[j]
        # (rising from k-1 on: best is non-decreasing there), as bisect_left finds it
        rising = best[k - 1:] + prefix[k - 1:]
        j = np.arange(k, n + 1)
        target = prefix[k:]
        lo = np.minimum(np.searchsorted(rising, target, side="left") + (k - 1), j - 1)
        value_lo = np.maximum(best[lo], target - prefix[lo])
        before = lo - 1
        valid = before >= k - 1
        safe = np.where(valid, before, lo)
        value_before = np.maximum(best[safe], target - prefix[safe])
        # the loop tries lo - 1 first, then lo, which wins ties (the later cut)
        take_before = valid & (value_before < value_lo)
        new = np.full(n + 1, np.inf)
        cut = np.zeros(n + 1, dtype=np.int64)
        new[k:] = np.where(take_before, value_before, value_lo)
        cut[k:] = np.where(take_before, before, lo)
        best = new
        choice.append(cut)
    starts = []
    j = n
    for k in range(stages, 1, -1):
        i = int(choice[k - 1][j])
        starts.append(i)
        j = i
    starts.append(0)
    return tuple(reversed(starts)), float(best[n])


def _partition_loop(costs: Sequence[float], stages: int) -> tuple[tuple[int, ...], float]:
    """`partition` one j at a time (the reference; also for negative costs)."""
    n = len(costs)
    if stages < 1 or stages > n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    inf = float("inf")
    best = [prefix[j] for j in range(n + 1)]          # one stage: layers [0, j)
    choice: list[list[int]] = [[0] * (n + 1)]
    for k in range(2, stages + 1):
        new = [inf] * (n + 1)
        cut = [0] * (n + 1)
        # i ranges over [k-1, j-1]; f(i) = best[i] rises, g(i) = prefix[j] - prefix[i] falls:
        # they cross at the first i with best[i] + prefix[i] >= prefix[j] (a rising list)
        rising = [b + p for b, p in zip(best, prefix)]
        for j in range(k, n + 1):
            lo = bisect_left(rising, prefix[j], k - 1, j - 1)
            for i in (lo - 1, lo):
                if k - 1 <= i <= j - 1:
                    value = max(best[i], prefix[j] - prefix[i])
                    if value < new[j] or (value == new[j] and i > cut[j]):
                        new[j], cut[j] = value, i
        best = new
        choice.append(cut)
    starts = []
    j = n
    for k in range(stages, 1, -1):
        i = choice[k - 1][j]
        starts.append(i)
        j = i
    starts.append(0)
    return tuple(reversed(starts)), best[n]


def stage_costs(costs: Sequence[float], starts: Sequence[int]) -> list[float]:
    bounds = [*starts, len(costs)]
    return [sum(costs[bounds[k]:bounds[k + 1]]) for k in range(len(starts))]
