"""Topology-aware all-reduce of the data-parallel gradient sync (Plan.collective_algorithm).

"flat" is `dist.all_reduce` over the dp group. "hierarchical" splits it by node, as the
cost model prices it (`cost.comm.hierarchical_all_reduce`):

1. reduce-scatter inside each node: the g dp ranks of a node each get the node's sum of
   one g-th of the tensor;
2. all-reduce across nodes, g groups at once: local rank i of every node forms one group
   (it holds chunk i everywhere), so the g inter-node all-reduces of n/g run in parallel,
   each over its own rail / NIC;
3. all-gather inside each node: every rank gets the whole sum.

"segmented" (`cost.comm.segmented_all_reduce`) cuts the tensor into S segments and
pipelines them: segment k's inter-node all-reduce runs while segment k+1 is
reduce-scattered and segment k−1 all-gathered inside the node (async works on the intra-
and inter-node groups). Sizes that do not divide into g × S chunks are padded with zeros;
any dtype gloo / NCCL reduce works (fp32, fp64, bf16). Where a dp group has one node, or
one rank per node, or nodes with different numbers of its ranks, the all-reduce is the
flat one (the same result).

The subgroups come from the Plan alone: its mesh (the dp groups, as runtime/groups.py
builds the DeviceMesh from the placement table) and the node of each rank in its
placement. Every rank creates every subgroup of every dp group in the same order
(`dist.new_group` must be called by all ranks), once per process and world group
(`build_hierarchy` caches them). The bucketed reducer (runtime/reducer.py) starts a
bucket's all-reduce with `AllReduce.start`, which returns a work with `.wait()`: the
hierarchical steps run on one helper thread per hierarchy, in the order the buckets were
started, so every rank issues the subgroups' collectives in the same order.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.distributed as dist

from ..cost.comm import PIPELINE_SEGMENTS
from ..ops.groups import all_gather_single, reduce_scatter_single
from ..plan import Plan
from .timeouts import new_group

__all__ = ["Hierarchy", "AllReduce", "dp_group_ranks", "split_by_node", "subgroup_ranks",
           "build_hierarchy", "hierarchical_all_reduce", "gradient_all_reduce"]


# ---------------------------------------------------------------------- pure layout
def dp_group_ranks(plan: Plan) -> list[list[int]]:
    """Every dp group of `plan`'s mesh (ranks in dp order), in (pp, tp) order: the groups
    `runtime/groups.build_mesh` binds to the "dp" axis."""
    ranks = [p.rank for p in plan.placement]
    m = plan.mesh
    return [[ranks[(i * m.dp + d) * m.tp + k] for d in range(m.dp)]
            for i in range(m.pp) for k in range(m.tp)]


def split_by_node(ranks: Sequence[int], node_of: Mapping[int, int]) -> list[list[int]] | None:
    """`ranks` grouped by node (nodes in ascending order, ranks sorted within each), or
    None where a hierarchy would not help or could not run: one node, one rank per node,
    or nodes holding different numbers of the ranks."""
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(node_of[r], []).append(r)
    groups = [sorted(nodes[n]) for n in sorted(nodes)]
    sizes = {len(g) for g in groups}
    if len(groups) <= 1 or len(sizes) != 1 or sizes == {1}:
        return None
    return groups


def subgroup_ranks(plan: Plan) -> list[tuple[int, str, list[int]]]:
    """(dp group index, "intra" | "inter", ranks) of every subgroup, in the order every
    rank creates them: per dp group, its intra-node groups by node, then its inter-node
    groups by local index (local index i of every node)."""
    node_of = {p.rank: p.node for p in plan.placement}
    out: list[tuple[int, str, list[int]]] = []
    for index, group in enumerate(dp_group_ranks(plan)):
        by_node = split_by_node(group, node_of)
        if by_node is None:
            continue
        out += [(index, "intra", ranks) for ranks in by_node]
        out += [(index, "inter", [node[i] for node in by_node])
                for i in range(len(by_node[0]))]
    return out


# ---------------------------------------------------------------------- process groups
@dataclass
class Hierarchy:
    """This rank's subgroups of its dp group: `intra` (the dp ranks of its node) and
    `inter` (the dp ranks with its local index on every node); both None when the
    all-reduce stays flat over `group`."""

    group: dist.ProcessGroup | None
    intra: dist.ProcessGroup | None = None
    inter: dist.ProcessGroup | None = None
    intra_ranks: tuple[int, ...] = ()
    inter_ranks: tuple[int, ...] = ()
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def flat(self) -> bool:
        return self.intra is None

    @property
    def local_size(self) -> int:
        """g: the dp ranks on this rank's node."""
        return len(self.intra_ranks) or 1

    @property
    def nodes(self) -> int:
        return len(self.inter_ranks) or 1

    def submit(self, fn, *args) -> Future:
        """Run `fn(*args)` on this hierarchy's helper thread (FIFO, one at a time)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ah-allreduce")
            return self._pool.submit(fn, *args)


#: (world group, subgroup rank lists) → {ranks: group}: every rank builds the same table
_CACHE: dict[tuple, dict[tuple[int, ...], dist.ProcessGroup | None]] = {}


def build_hierarchy(plan: Plan, group: dist.ProcessGroup | None) -> Hierarchy:
    """This rank's `Hierarchy` for its dp `group` under `plan`. Creates (once per world
    group and layout; every rank must call this at the same point) the subgroups of every
    dp group of the mesh, in `subgroup_ranks` order."""
    if group is None or not dist.is_initialized():
        return Hierarchy(group)
    layout = subgroup_ranks(plan)
    world = dist.group.WORLD
    key = (id(world), tuple((kind, tuple(r)) for _, kind, r in layout))
    table = _CACHE.get(key)
    if table is None or table.get(()) is not world:
        table = {(): world}
        for _, _, ranks in layout:
            table[tuple(ranks)] = new_group(ranks)  # with the collective bound
        _CACHE.clear()  # groups of an older world are gone with it
        _CACHE[key] = table
    rank = dist.get_rank()
    mine = sorted(dist.get_process_group_ranks(group))
    index = next((i for i, g in enumerate(dp_group_ranks(plan)) if sorted(g) == mine), None)
    h = Hierarchy(group)
    for i, kind, ranks in layout:
        if i == index and rank in ranks:
            setattr(h, kind, table[tuple(ranks)])
            setattr(h, f"{kind}_ranks", tuple(ranks))
    if h.intra is None or h.inter is None:
        h.intra = h.inter = None
        h.intra_ranks = h.inter_ranks = ()
    return h


# ---------------------------------------------------------------------- the algorithm
def hierarchical_all_reduce(tensor: torch.Tensor, h: Hierarchy, segments: int = 1
                            ) -> torch.Tensor:
    """Sum `tensor` in place over the dp group of `h`; `segments` > 1 pipelines that many
    segments (see the module docstring). Returns `tensor`."""
    if h.flat:
        if h.group is not None:
            dist.all_reduce(tensor, group=h.group)
        return tensor
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    n, g = flat.numel(), h.local_size
    s = max(1, min(int(segments), n // g))
    chunk = max(1, math.ceil(n / (g * s)))
    length = chunk * g * s
    buf = flat if length == n else torch.cat([flat, flat.new_zeros(length - n)])
    rows = buf.view(s, g * chunk)          # segment k: g chunks, chunk i for local rank i
    parts = buf.new_empty(s, chunk)        # this rank's chunk of each segment
    if s == 1:
        reduce_scatter_single(parts[0], rows[0], group=h.intra)
        dist.all_reduce(parts[0], group=h.inter)
        all_gather_single(rows[0], parts[0], group=h.intra)
    else:
        _pipelined(rows, parts, h)
    if buf.data_ptr() != flat.data_ptr():
        flat.copy_(buf[:n])
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        tensor.copy_(flat.view_as(tensor))
    return tensor


def _pipelined(rows: torch.Tensor, parts: torch.Tensor, h: Hierarchy) -> None:
    """Segment k's inter-node all-reduce overlaps segment k+1's reduce-scatter and
    segment k−1's all-gather; the same issue order on every rank."""
    s = rows.shape[0]
    scatter = [None] * s
    reduce = [None] * s
    gather = []
    scatter[0] = reduce_scatter_single(parts[0], rows[0], group=h.intra, async_op=True)
    for k in range(s):
        scatter[k].wait()
        reduce[k] = dist.all_reduce(parts[k], group=h.inter, async_op=True)
        if k + 1 < s:
            scatter[k + 1] = reduce_scatter_single(parts[k + 1], rows[k + 1], group=h.intra,
                                                   async_op=True)
        if k >= 1:
            reduce[k - 1].wait()
            gather.append(all_gather_single(rows[k - 1], parts[k - 1], group=h.intra,
                                            async_op=True))
    reduce[s - 1].wait()
    gather.append(all_gather_single(rows[s - 1], parts[s - 1], group=h.intra, async_op=True))
    for work in gather:
        work.wait()


class _Done:
    def wait(self) -> bool:
        return True


class _ThreadWork:
    """`.wait()` of an all-reduce running on a hierarchy's helper thread (re-raises)."""

    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> bool:
        self.future.result()
        return True


@dataclass
class AllReduce:
    """Starts a sum all-reduce of `algorithm` over the dp group; `start(t)` returns a work
    with `.wait()` after which `t` holds the sum (what the reducer's buckets use)."""

    hierarchy: Hierarchy
    algorithm: str = "flat"
    segments: int = PIPELINE_SEGMENTS

    def __post_init__(self) -> None:
        if self.algorithm not in ("flat", "hierarchical", "segmented"):
            raise ValueError(f"unknown all-reduce algorithm {self.algorithm!r}")

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """The all-reduce, synchronously."""
        self.start(tensor).wait()
        return tensor

    def start(self, tensor: torch.Tensor):
        h = self.hierarchy
        if h.group is None:
            return _Done()
        if self.algorithm == "flat" or h.flat:
            return dist.all_reduce(tensor, group=h.group, async_op=True)
        segments = self.segments if self.algorithm == "segmented" else 1
        return _ThreadWork(h.submit(hierarchical_all_reduce, tensor, h, segments))


def gradient_all_reduce(plan: Plan, group: dist.ProcessGroup | None) -> AllReduce | None:
    """The dp gradient all-reduce of `plan` (None: the reducer's own flat one). Builds the
    subgroups on every rank (call it at the same point on all ranks)."""
    if plan.collective_algorithm == "flat" or plan.zero or group is None:
        return None
    if not subgroup_ranks(plan):  # no dp group spans several nodes × several ranks
        return None
    return AllReduce(build_hierarchy(plan, group), plan.collective_algorithm)
