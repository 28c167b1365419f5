"""Communication cost: α–β models of collectives over the ranks of a process group.

Formulas from `shared/reference/hardware_and_formulas.md` (p ranks, n bytes). Where the
ranks sit (one node or several, NICs shared) comes from `Cluster.link_for`, so the same
call prices a tp group inside a node and a dp group across nodes differently.
"""
from __future__ import annotations

from typing import Protocol, Sequence


class _Cluster(Protocol):
    devices_per_node: int

    def link_for(self, ranks: Sequence[int]) -> tuple[float, float, float]: ...


def _link(cluster: _Cluster, ranks: Sequence[int]) -> tuple[float, float]:
    bandwidth, latency, sharing = cluster.link_for(list(ranks))
    return latency, sharing / bandwidth  # α, β (seconds per byte, slowed by NIC sharing)


def all_reduce(cluster: _Cluster, ranks: Sequence[int], nbytes: float,
               algorithm: str = "ring") -> float:
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta = _link(cluster, ranks)
    if algorithm == "tree":
        import math
        return 2 * math.log2(p) * alpha + 2 * nbytes * beta
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def all_gather(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """`nbytes` is the size of the full (gathered) output."""
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta = _link(cluster, ranks)
    return (p - 1) * alpha + (p - 1) / p * nbytes * beta


reduce_scatter = all_gather  # same ring cost; `nbytes` is the full input
all_to_all = all_gather


def ring_latency(cluster: _Cluster, ranks: Sequence[int]) -> float:
    """The latency part of a ring all-gather or reduce-scatter: (p − 1) α."""
    return (len(ranks) - 1) * _link(cluster, ranks)[0] if len(ranks) > 1 else 0.0


def latency_bytes(cluster: _Cluster, ranks: Sequence[int]) -> float:
    """Bytes the group's link moves in one latency (α / β): a collective much smaller
    than this costs its latency whatever its size, so merging such ones saves time."""
    if len(ranks) <= 1:
        return 0.0
    alpha, beta = _link(cluster, ranks)
    return alpha / beta


def broadcast(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta = _link(cluster, ranks)
    import math
    return math.ceil(math.log2(p)) * (alpha + nbytes * beta)


def send_recv(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    alpha, beta = _link(cluster, ranks)
    return alpha + nbytes * beta


def hierarchical_all_reduce(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Intra-node reduce-scatter, g concurrent inter-node all-reduces of n/g, all-gather."""
    g = cluster.devices_per_node
    nodes = sorted({r // g for r in ranks})
    local = [r for r in ranks if r // g == nodes[0]]
    if len(nodes) <= 1 or len(local) <= 1:
        return all_reduce(cluster, ranks, nbytes)
    leaders = [n * g + local[0] % g for n in nodes]
    intra = 2 * reduce_scatter(cluster, local, nbytes)
    return intra + all_reduce(cluster, leaders, nbytes / len(local))
