"""Communication cost: α–β models of collectives over the ranks of a process group.

Formulas from `shared/reference/hardware_and_formulas.md` (p ranks, n bytes). Where the
ranks sit (one node or several, NICs shared) comes from `Cluster.link_for`, so the same
call prices a tp group inside a node and a dp group across nodes differently.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Protocol, Sequence


class _Cluster(Protocol):
    devices_per_node: int

    def link_for(self, ranks: Sequence[int], kind: str | None = None
                 ) -> tuple[float, float, float]: ...


def _link(cluster: _Cluster, ranks: Sequence[int], kind: str | None = None
          ) -> tuple[float, float]:
    """(α, β) of collective `kind` on `ranks`: the link's figures for that kind where a
    calibration measured it apart (hardware.LinkSpec.collectives), else the link's."""
    cached = getattr(cluster, "alpha_beta", None)  # the search's LinkCache: memoized
    if cached is not None:
        return cached(ranks, kind)
    bandwidth, latency, sharing = cluster.link_for(list(ranks), kind)
    return latency, sharing / bandwidth  # α, β (seconds per byte, slowed by NIC sharing)


def hidden_share(cluster: _Cluster, ranks: Sequence[int], kind: str) -> float:
    """The share of collective `kind`'s time on `ranks` that compute started after it
    hides (a calibrated CPU link's measurement; 1 where none was made)."""
    share = getattr(cluster, "hidden_share", None)
    return share(ranks, kind) if share is not None else 1.0


#: T(n) = a·α + b·n·β of each collective kind on p ranks, as (a, b): rings (an
#: all-reduce is a reduce-scatter then an all-gather), a send one message. The pricing
#: below and the calibration's fits of α, β per kind (calibrate.py) both read it.
COEFFICIENTS = {"all_reduce": lambda p: (2 * (p - 1), 2 * (p - 1) / p),
                "all_gather": lambda p: (p - 1, (p - 1) / p),
                "reduce_scatter": lambda p: (p - 1, (p - 1) / p),
                "all_to_all": lambda p: (p - 1, (p - 1) / p),
                "send_recv": lambda p: (1, 1)}


def all_reduce(cluster: _Cluster, ranks: Sequence[int], nbytes: float,
               algorithm: str = "ring") -> float:
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "tree":
        import math
        alpha, beta = _link(cluster, ranks, "all_reduce")
        return 2 * math.log2(p) * alpha + 2 * nbytes * beta
    return _ring(cluster, ranks, nbytes, "all_reduce")


def _ring(cluster: _Cluster, ranks: Sequence[int], nbytes: float, kind: str) -> float:
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta = _link(cluster, ranks, kind)
    a, b = COEFFICIENTS[kind](p)
    return a * alpha + b * nbytes * beta


def all_gather(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """`nbytes` is the size of the full (gathered) output."""
    return _ring(cluster, ranks, nbytes, "all_gather")


def reduce_scatter(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """The ring cost of an all-gather; `nbytes` is the full input."""
    return _ring(cluster, ranks, nbytes, "reduce_scatter")


def all_to_all(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """One rank's all-to-all of `nbytes` (what it holds before the exchange, an equal part
    per rank of `ranks`): p − 1 pairwise messages, (p − 1)/p of the bytes leaving. Where
    the ranks span nodes, the parts for ranks on other nodes cross the network (each
    rank's NIC, shared as `link_for` says) while the parts for its own node's ranks move
    over the in-node link at the same time: the slower of the two. (Expert parallelism's
    dispatch and combine: ops/moe.py.)"""
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    nodes = _by_node(cluster, ranks)
    if nodes is None:
        alpha, beta = _link(cluster, ranks, "all_to_all")
        return (p - 1) * alpha + (p - 1) / p * nbytes * beta
    local = len(nodes[0])
    alpha_in, beta_in = _link(cluster, nodes[0], "all_to_all")
    alpha_out, beta_out = _link(cluster, ranks, "all_to_all")
    inside = (local - 1) * alpha_in + (local - 1) / p * nbytes * beta_in
    across = (p - local) * alpha_out + (p - local) / p * nbytes * beta_out
    return max(inside, across)


def ring_latency(cluster: _Cluster, ranks: Sequence[int], kind: str = "all_gather") -> float:
    """The latency part of a ring all-gather (or reduce-scatter): (p − 1) α."""
    return (len(ranks) - 1) * _link(cluster, ranks, kind)[0] if len(ranks) > 1 else 0.0


#: chunk counts a collective matmul is priced with (ops/collective_matmul.py)
COLLECTIVE_MATMUL_CHUNKS = (2, 4, 8)


def collective_matmul(comm_s: float, matmul_s: float, collectives: int, latency_s: float,
                      chunks: int) -> float:
    """Exposed time of tensor-parallel transfers taking `comm_s` in all when each of the
    `collectives` is cut into `chunks` pipelined with matmuls taking `matmul_s` in all:
    one chunk in `chunks` waits (the first gathered, the last reduce-scattered); the rest
    hides behind the other chunks' matmuls as far as those last; each extra chunk pays the
    link's latency once more per collective."""
    if chunks < 2:
        return comm_s
    hidden = min(comm_s, matmul_s) * (chunks - 1) / chunks
    return comm_s - hidden + collectives * (chunks - 1) * latency_s


def best_chunks(comm_s: float, matmul_s: float, collectives: int,
                latency_s: float) -> tuple[int, float]:
    """(chunks, exposed time) of the cheapest chunk count in COLLECTIVE_MATMUL_CHUNKS."""
    return min(((k, collective_matmul(comm_s, matmul_s, collectives, latency_s, k))
                for k in COLLECTIVE_MATMUL_CHUNKS), key=lambda kt: (kt[1], kt[0]))


def latency_bytes(cluster: _Cluster, ranks: Sequence[int]) -> float:
    """Bytes the group's link moves in one latency (α / β): a collective much smaller
    than this costs its latency whatever its size, so merging such ones saves time."""
    if len(ranks) <= 1:
        return 0.0
    alpha, beta = _link(cluster, ranks, "all_gather")
    return alpha / beta


def broadcast(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta = _link(cluster, ranks, "broadcast")
    import math
    return math.ceil(math.log2(p)) * (alpha + nbytes * beta)


def halo_exchange(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """One rank receiving `nbytes` of halo rows from its neighbours in one
    `all_to_all_single` over `ranks` (ops/spatial.py): a message per peer, the rows at
    the link's bandwidth."""
    p = len(ranks)
    if p <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta = _link(cluster, ranks, "all_to_all")
    return (p - 1) * alpha + nbytes * beta


def send_recv(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    alpha, beta = _link(cluster, ranks, "send_recv")
    a, b = COEFFICIENTS["send_recv"](len(ranks))
    return a * alpha + b * nbytes * beta


#: Segments of the "segmented" (pipelined) hierarchical all-reduce: the runtime cuts each
#: gradient bucket into this many (runtime/collectives.py), the cost model prices it so.
PIPELINE_SEGMENTS = 4


def _by_node(cluster: _Cluster, ranks: Sequence[int]) -> tuple[tuple[int, ...], ...] | None:
    """`ranks` per node (torchrun placement), or None when a hierarchy does not apply:
    one node, one rank per node, or nodes holding different numbers of the ranks (the
    runtime then runs the flat all-reduce: runtime/collectives.split_by_node)."""
    return _groups_by_node(cluster.devices_per_node, tuple(ranks))


@lru_cache(maxsize=4096)  # the planner asks for the same few dp groups many times
def _groups_by_node(g: int, ranks: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r // g, []).append(r)
    groups = tuple(tuple(nodes[n]) for n in sorted(nodes))
    sizes = {len(group) for group in groups}
    if len(groups) <= 1 or len(sizes) != 1 or sizes == {1}:
        return None
    return groups


def _hierarchy_steps(cluster: _Cluster, groups: Sequence[Sequence[int]],
                     ranks: Sequence[int], nbytes: float) -> tuple[float, float]:
    """(intra-node reduce-scatter (= all-gather) of `nbytes`, the g concurrent inter-node
    all-reduces of nbytes / g). The inter-node step runs on the network link with the NIC
    sharing of the whole group (`link_for(ranks)`: the g ranks of a node that share a
    NIC share its bandwidth), the reference's g/r slow-down with r NICs per node."""
    local, nodes = groups[0], len(groups)
    g = len(local)
    intra = reduce_scatter(cluster, local, nbytes)
    alpha, beta = _link(cluster, ranks, "all_reduce")
    inter = 2 * (nodes - 1) * alpha + 2 * (nodes - 1) / nodes * (nbytes / g) * beta
    return intra, inter


def hierarchical_all_reduce(cluster: _Cluster, ranks: Sequence[int], nbytes: float) -> float:
    """Intra-node reduce-scatter, g concurrent inter-node all-reduces of n/g, all-gather:

        T = 2(g−1)α_i + 2(g−1)/g · nβ_i + 2(N−1)α_e + 2(N−1)/N · (n/g)β_e

    (`shared/reference/hardware_and_formulas.md`, "Hierarchical all-reduce"; β_e slowed
    by the NIC sharing). The flat ring all-reduce where no hierarchy applies."""
    groups = _by_node(cluster, ranks)
    if groups is None or nbytes <= 0:
        return all_reduce(cluster, ranks, nbytes)
    intra, inter = _hierarchy_steps(cluster, groups, ranks, nbytes)
    return 2 * intra + inter


def segmented_all_reduce(cluster: _Cluster, ranks: Sequence[int], nbytes: float,
                         segments: int = PIPELINE_SEGMENTS) -> float:
    """The hierarchical all-reduce cut into S segments and pipelined: segment k's
    inter-node all-reduce runs while segment k+1 is reduce-scattered (and k−1 all-gathered)
    inside the node. With the per-segment steps t_rs = t_ag (intra-node, n/S bytes) and
    t_ar (inter-node, n/(gS)) of `hierarchical_all_reduce`:

        T = t_rs + t_ar + t_ag + (S−1) · max(t_rs + t_ag, t_ar)

    the usual pipeline bound (fill and drain once, then the slowest resource per
    segment: the node's link carries both reduce-scatter and all-gather). Not in the
    reference sheet: derived here from its hierarchical formula; pipelining the phases of
    a decomposed all-reduce over chunks is BlueConnect's (Cho et al., SysML 2019). Each
    segment pays every latency again, so it wins over `hierarchical_all_reduce` for large
    n when the intra- and inter-node steps take comparable time."""
    groups = _by_node(cluster, ranks)
    if groups is None or nbytes <= 0:
        return all_reduce(cluster, ranks, nbytes)
    s = max(1, int(segments))
    rs, ar = _hierarchy_steps(cluster, groups, ranks, nbytes / s)
    return 2 * rs + ar + (s - 1) * max(2 * rs, ar)


def dp_all_reduce(cluster: _Cluster, ranks: Sequence[int], nbytes: float,
                  algorithm: str = "flat") -> float:
    """The all-reduce of `nbytes` over `ranks` with a Plan.collective_algorithm."""
    if algorithm == "hierarchical":
        return hierarchical_all_reduce(cluster, ranks, nbytes)
    if algorithm == "segmented":
        return segmented_all_reduce(cluster, ranks, nbytes)
    return all_reduce(cluster, ranks, nbytes)


def hierarchy_applies(cluster: _Cluster, ranks: Sequence[int]) -> bool:
    """Whether the hierarchical algorithms differ from the flat one on `ranks`: several
    nodes, several ranks on each, as many on every node."""
    return _by_node(cluster, ranks) is not None
