"""Rank statistics the cost-model benchmarks print (cost_model_accuracy.py, plan_choice.py)."""
from __future__ import annotations


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's τ-a of two paired lists: (concordant − discordant) pairs over all pairs;
    a pair tied in either list counts as discordant (no plan order is claimed for it)."""
    pairs = concordant = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            pairs += 1
            concordant += 1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 else -1
    return concordant / pairs if pairs else 0.0
