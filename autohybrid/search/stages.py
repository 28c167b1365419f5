"""Balanced pipeline stages: split a sequence of layer costs into p contiguous stages.

Minimizes the largest stage cost (the pipeline runs at the pace of its slowest stage) by
dynamic programming over prefix sums: best[k][j] = min over i of max(best[k-1][i],
sum(cost[i:j])). The inner minimum sits where a non-decreasing and a non-increasing
function of i cross, found by bisection, so the whole DP is O(p · L · log L).

Example::

    >>> partition([1, 1, 1, 1, 4], 2)
    ((0, 4), 4.0)
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Sequence


def partition(costs: Sequence[float], stages: int) -> tuple[tuple[int, ...], float]:
    """(start index of each stage, cost of the slowest stage); every stage non-empty."""
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
