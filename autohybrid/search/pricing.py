"""Price one fully specified layout: stage split, step time and memory per rank.

A layout is (pp, dp, tp, sp, microbatch size, microbatches, schedule, virtual stages,
recompute, ZeRO). The model's layers (search/space.py) are costed once per microbatch
shape; search/stages.py cuts them into pp × v stages, which the schedule places on the pp
ranks (`plan.stage_ranks`: looped s mod pp, or V-shaped). A rank's time per microbatch is
the sum of its stages; the slowest rank sets the pace. The step time follows
`shared/reference/hardware_and_formulas.md`:

    step = (m + bubble) · slowest rank  +  pipeline p2p  +  exposed dp gradient sync
           + optimizer update

with the bubble of `bubble` (p−1 for GPipe and 1F1B, (p−1)/v interleaved, less for the
zero-bubble schedules) and the activations in flight of `in_flight`. Where ranks share
a host's cores (a calibrated CPU cluster), the first term shrinks by `shared_speedup`:
idle ranks leave their cores to the busy ones.
"""
from __future__ import annotations

import math
from functools import lru_cache
from operator import attrgetter
from statistics import NormalDist
from itertools import accumulate
from dataclasses import dataclass, fields
from typing import Sequence

from ..cost import comm
from ..cost.compute import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from ..cost.gemm import utilization
from ..cost.memory import dtype_bytes, training_state, usable_bytes
from ..plan import (MemoryBreakdown, Mesh, Prediction, expert_groups, spatial_groups,
                    spatial_stats_axis, stage_ranks)
from .layers import gather_groups, is_block
from .space import LayerProfile, ModelProfile, split_ways
from .stages import partition

#: dp gradient bucket sizes the pricing chooses from when none is pinned: more buckets
#: start the sync earlier in backward, each pays the collective's latency again
BUCKET_CHOICES_MB = (1.0, 4.0, 16.0, 25.0, 64.0, 256.0, 1024.0)
#: Update of the optimizer: bytes touched per parameter (read/write weights, grads, states).
OPTIMIZER_BYTES_PER_PARAM = 16.0
#: Ops torch's single-tensor optimizers run per parameter tensor and step (counted with a
#: dispatch-mode counter on torch 2.13: AdamW 10, SGD with momentum 3, plain SGD 1); each
#: pays the device's launch overhead, which dominates the update of small models. That is
#: torch's default on CPU; on accelerators the default multi-tensor (foreach) path runs
#: these ops once over all tensors, so they are charged once per step there.
OPTIMIZER_OPS_PER_TENSOR = {"adam": 10, "sgd": 3, "none": 1}
#: Attention kernels. "flash" (SDPA's fused kernels, what autohybrid runs) never stores
#: the score matrix. "materialized" (Megatron-LM before flash attention, the setting of
#: Korthikanti et al.) writes scores, softmax and dropout mask: per score element 6.5
#: forward memory accesses of 2 bytes, counted on Megatron-LM's attention (the first
#: batched GEMM writes the scores: 1; the fused scale-mask-softmax reads and writes: 2;
#: dropout reads, writes and writes a 1-byte mask: 2.5; the second batched GEMM reads: 1;
#: it was 8, a round guess, until the held-out Narayanan et al. rows were added), and
#: 2 bytes (scores) + 2 (softmax) + 1 (mask) kept for backward (their 5·a·s²·b term).
ATTENTION_IMPLEMENTATIONS = ("flash", "materialized")
#: Share of tensor-parallel communication Megatron-Core hides behind compute (its TP
#: communication overlap). Fitted (grid of 0.05, `published_runs.fit_tp_overlap`) as the
#: value minimizing the squared log-error of predicted TFLOP/s on the nine Megatron-Core
#: rows (1.7B–462B) of `shared/reference/published_runs.md`: 0.70, giving predicted /
#: published 1.03, 0.95, 0.91, 0.90, 1.02, 1.06, 1.06, 1.01, 1.04 (0.0 gives 1.03 … 0.74).
#: Refitted (was 0.60) when the dp sync started paying each gradient bucket's latency,
#: and again (was 0.65) when GEMMs and attention started paying tile and wave quantization
#: (cost/gemm.py).
TP_OVERLAP_MEGATRON_CORE = 0.70
MATERIALIZED_ACCESSES_FORWARD = 6.5
MATERIALIZED_SAVED_PER_SCORE = 2 + 2 + 1


class LinkCache:
    """`cluster` with `link_for` and the (α, β) of cost/comm.py memoized: the search asks
    for the same groups many times. The dp groups hold up to thousands of ranks, so a
    group asked for again as the same tuple object (`dp_ranks` returns one per shape) is
    found by identity before it is hashed."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.devices_per_node = cluster.devices_per_node
        self.device = cluster.device
        self._links: dict[tuple[int, ...], object] = {}
        self._alpha_beta: dict[tuple, tuple[float, float]] = {}
        self._by_id: dict[tuple, tuple[object, tuple[float, float]]] = {}

    def link_for(self, ranks, kind: str | None = None):
        key = (ranks if isinstance(ranks, tuple) else tuple(ranks), kind)
        if key not in self._links:
            self._links[key] = self.cluster.link_for(*key)
        return self._links[key]

    def hidden_share(self, ranks, kind: str) -> float:
        key = ("hidden", tuple(ranks), kind)
        if key not in self._links:
            self._links[key] = self.cluster.hidden_share(key[1], kind)
        return self._links[key]

    def alpha_beta(self, ranks, kind: str | None = None) -> tuple[float, float]:
        """(latency, seconds per byte slowed by NIC sharing) of collective `kind` on
        `ranks`."""
        hit = self._by_id.get((id(ranks), kind))
        if hit is not None and hit[0] is ranks:
            return hit[1]
        key = (ranks if isinstance(ranks, tuple) else tuple(ranks), kind)
        value = self._alpha_beta.get(key)
        if value is None:
            bandwidth, latency, sharing = self.link_for(*key)
            value = self._alpha_beta[key] = (latency, sharing / bandwidth)
        if isinstance(ranks, tuple):  # immutable: safe to know by identity (kept alive)
            self._by_id[(id(ranks), kind)] = (ranks, value)
        return value


@dataclass(frozen=True)
class Layout:
    mesh: Mesh
    microbatch_size: int
    num_microbatches: int
    schedule: str = "none"
    virtual_stages: int = 1
    recompute: str = "none"
    zero: int = 0
    bucket_mb: float | None = 25.0        # None: the cheapest of BUCKET_CHOICES_MB
    collective_algorithm: str = "flat"   # the dp gradient all-reduce (ZeRO 0)
    #: chunked sequence-parallel collectives: None = per layer where it pays, True = every
    #: layer with sharded matmuls, False = none
    collective_matmul: bool | None = None
    #: chunks of each MoE layer's tokens under ep (None: the cheapest of MOE_CHUNKS)
    moe_chunks: int | None = None


@dataclass(frozen=True)
class Priced:
    prediction: Prediction
    stage_starts: tuple[int, ...]
    fits: bool
    chunked: tuple[tuple[str, int], ...] = ()   # (layer, chunks) run as collective matmuls
    bucket_mb: float = 25.0                      # the dp gradient buckets priced
    moe_chunks: int = 1                          # each MoE layer's tokens in this many chunks


@dataclass(frozen=True)
class LayerTimes:
    forward: float
    backward: float
    recompute: float
    tp_comm: float
    saved: float          # bytes kept for backward per microbatch
    recompute_saved: float  # bytes kept with full recomputation (a block: its input)
    input: float = 0.0      # bytes of the layer's input (what a stage boundary sends)
    chunks: int = 0         # collective matmul: its sp collectives in this many chunks
    moe_chunks: int = 0     # a MoE layer under ep: its tokens in this many chunks

    @property
    def total(self) -> float:
        """Time of one microbatch through the layer, forward and backward."""
        return self.forward + self.backward + self.recompute + self.tp_comm


def layer_times(layer: LayerProfile, cluster, layout: Layout, seq: int | None,
                dtype: str, graph_dtype_bytes: int, attention: str = "flash",
                tp_overlap: float = 0.0, kv_heads: int | None = None,
                vocab: int | None = None, moe_load_skew: float = 0.0,
                expert_tp: bool = False) -> LayerTimes:
    mesh, b = layout.mesh, layout.microbatch_size
    t, sp = mesh.tp, mesh.sp
    v = layer.values(b, seq)
    scale = dtype_bytes(dtype) / graph_dtype_bytes
    device = cluster.device
    peak = device.peak_flops.get(dtype) or max(device.peak_flops.values())
    replicated_share = 1.0 / t if sp and layer.sp_region else 1.0
    kv, vocab_ways = split_ways("kv", t, kv_heads), split_ways("vocab", t, vocab=vocab)
    matmul = (v["mm_sharded"] / t + v["mm_kv"] / kv + v["mm_vocab"] / vocab_ways
              + v["mm_replicated"]) \
        / (peak * MATMUL_EFFICIENCY)
    if layer.gemms and (device.sm_count or device.gemm_curves):  # rates by GEMM shape
        ways = {"mm_sharded": t, "mm_kv": kv, "mm_vocab": vocab_ways, "mm_replicated": 1}
        matmul += shape_lost_flops(layer, b, seq, ways, device, dtype) \
            / (peak * MATMUL_EFFICIENCY)
    # expert tensor parallelism (`expert_tp`, ModelProfile.expert_tp): each tp rank runs
    # its slice of every expert, a tp-th of the MoE op's work and of the bytes it moves
    # (counted as replicated; its weights and intermediate rows dominate those)
    split_off = (1 - 1 / t) if expert_tp else 0.0
    moved = (v["bytes_sharded"] / t + v["bytes_replicated"] * replicated_share
             - v["moe_bytes"] * split_off) * scale
    other = (v["other_sharded"] / t + v["other_replicated"] * replicated_share
             - v["moe_flops"] * split_off) / peak
    bandwidth = device.memory_bandwidth * MEMORY_EFFICIENCY
    core = v["attention_flops"] / t / (peak * MATMUL_EFFICIENCY)  # the attention core
    scores_saved = 0.0
    if attention == "materialized":
        scores = v["attention_scores"] / t
        core += MATERIALIZED_ACCESSES_FORWARD * dtype_bytes(dtype) * scores / bandwidth
        moved += MATERIALIZED_ACCESSES_FORWARD * dtype_bytes(dtype) * scores
        scores_saved = MATERIALIZED_SAVED_PER_SCORE * scores
    forward = matmul + max(moved / bandwidth, other) + layer.num_ops * device.launch_overhead_s
    # full recomputation checkpoints the blocks (passes/recompute.py); other layers
    # (embeddings, head, loss) keep their activations
    full = layout.recompute == "full" and is_block(layer.name)
    recompute = {"none": 0.0, "full": forward if full else 0.0,
                 "selective": core}[layout.recompute]
    tp_comm = 0.0
    for c in layer.collectives if t > 1 else ():
        nbytes = c.nbytes(b, seq) * scale
        ranks = axis_ranks(mesh, c.axis)
        if c.kind == "all_reduce" and sp and layer.sp_region:
            # sequence parallelism runs it as a reduce-scatter and an all-gather (one in
            # forward, the other in backward): the same ring bytes, each its own call
            time = comm.reduce_scatter(cluster, ranks, nbytes) \
                + comm.all_gather(cluster, ranks, nbytes)
        elif c.kind == "all_reduce":
            time = comm.all_reduce(cluster, ranks, nbytes)
        elif c.kind == "halo":
            time = comm.halo_exchange(cluster, ranks, nbytes)
        else:
            time = comm.all_gather(cluster, ranks, nbytes)
        # full recomputation runs the forward, its collectives included, a second time
        repeats = 2 if c.direction == "forward" and full else 1
        tp_comm += repeats * time * (1.0 - tp_overlap)
    if expert_tp and v["moe_flops"]:
        # the op's output summed over tp (again under full recomputation), in backward
        # the gradients of its tokens and of the router weights (ops/moe.py)
        ranks = axis_ranks(mesh, "tp")
        tokens = comm.all_reduce(cluster, ranks, v["moe_tokens"] * scale)
        weights = comm.all_reduce(cluster, ranks, v["moe_routes"] * graph_dtype_bytes * scale)
        tp_comm += ((2 if full else 1) * tokens + tokens + weights) * (1.0 - tp_overlap)
    chunks = 0
    if t > 1 and sp and layer.collectives and layout.collective_matmul is not False \
            and not tp_overlap:  # (a fitted overlap share already prices the hiding)
        # the matmuls next to the collectives: the sharded linears, forward and backward
        linears = 3 * (v["mm_sharded"] / t + v["mm_vocab"] / vocab_ways) \
            / (peak * MATMUL_EFFICIENCY)
        chunks, chunked = comm.best_chunks(tp_comm, linears, len(layer.collectives),
                                           comm.ring_latency(cluster, list(range(t))))
        if linears and (chunked < tp_comm or layout.collective_matmul):
            tp_comm = chunked
        else:
            chunks = 0
    moe_chunks = 0
    if mesh.ep > 1 and v["moe_routed"]:
        # each MoE layer's dispatch and combine, forward and backward, of its routed rows
        # over the ep ranks (tokens on sequence slices under sp), chunk by chunk beside
        # the experts' compute (full recomputation runs the forward's again)
        experts = v["moe_flops"] * replicated_share / (t if expert_tp else 1) \
            / (peak * MATMUL_EFFICIENCY)
        moe_chunks, forward_s, backward_s = moe_exchange(
            cluster, axis_ranks(mesh, "ep"), v["moe_routed"] * replicated_share * scale,
            experts, layout.moe_chunks,
            per_chunk_s=MOE_OPS_PER_CHUNK * device.launch_overhead_s)
        tp_comm += (2 if full else 1) * forward_s + backward_s
        # the busiest rank's extra rows: everyone waits for them, forward and backward
        skew = moe_load_skew + routing_skew(v["moe_routes"] * replicated_share, mesh.ep)
        tp_comm += skew * experts * ((2 if full else 1) + 2)
    saved = (v["saved_sharded"] / t + v["saved_replicated"] * replicated_share) * scale
    if layout.recompute == "selective":
        saved -= v["attention_saved"] / t * scale
    else:
        saved += scores_saved
    kept = v["input_bytes"] * replicated_share * scale
    return LayerTimes(forward, 2 * forward, recompute, tp_comm, saved,
                      kept if full or layout.recompute != "full" else saved, kept, chunks,
                      moe_chunks)


#: chunk counts of a MoE layer's tokens the pricing chooses between (ops/moe.py)
MOE_CHUNKS = (1, 2, 4, 8)
#: ops one chunk of a MoE layer adds, forward and backward: its routing, exchanges and
#: the per-expert loop over its rows (ops/moe.py: about 6 ops per expert forward, 12
#: backward, over a few local experts)
MOE_OPS_PER_CHUNK = 80


def routing_skew(routes: float, ep: int) -> float:
    """The expected excess of the busiest of `ep` ranks' routed rows over the mean when a
    balanced router's routes fall on the experts at random: each rank sends `routes`
    (its tokens × top-k) and the ranks receive a multinomial split of all ep · routes,
    about `routes + sqrt(routes) · (Z_i − Z̄)` for independent standard normals Z_i (the
    counts sum to the total). The busiest exceeds the mean by sqrt(routes) · z, z the
    expected maximum of ep standard normals (Blom's Φ⁻¹((ep − 0.375) / (ep + 0.25)):
    0.59 for 2, 1.43 for 8, 2.4 for 64); relative to the mean z / sqrt(routes) — 1.6 %
    for Mixtral's 4096 tokens × 2 per rank at ep 8, 18 % for 64 routes, 7.4 % at ep 2
    (a simulation of the multinomial: 1.6 %, 18 %, 7.1 %). A router that favours
    experts adds `moe_load_skew` on top."""
    if ep <= 1 or routes <= 0:
        return 0.0
    return NormalDist().inv_cdf((ep - 0.375) / (ep + 0.25)) / math.sqrt(routes)


def moe_exchange(cluster, ranks: tuple[int, ...], nbytes: float, experts_s: float,
                 pinned: int | None = None, per_chunk_s: float = 0.0
                 ) -> tuple[int, float, float]:
    """(chunks, exposed forward seconds, exposed backward seconds) of a MoE layer's
    all-to-alls under ep: `nbytes` of routed rows dispatched and combined around
    `experts_s` of expert compute (backward: the gradients, around twice that), in C
    chunks (the pinned count, else the cheapest of MOE_CHUNKS). Chunk i computes while
    the link carries chunk i+1's dispatch and chunk i−1's combine, hidden as far as the
    link hides a collective started before compute (`comm.hidden_share`); the first
    dispatch and the last combine are exposed; each chunk's all-to-all pays its latency,
    and each chunk beyond the first its ops' overhead (`per_chunk_s`, counted with the
    exchange)."""
    share = comm.hidden_share(cluster, ranks, "all_to_all")

    def exposed(c: int, compute: float) -> float:
        d, x = comm.all_to_all(cluster, ranks, nbytes / c), compute / c
        total = 2 * d
        for i in range(c):
            link = d * ((i + 1 < c) + (i > 0))
            total += x + link - share * min(link, x)
        return total - compute + (c - 1) * per_chunk_s / 2

    best = None
    for c in ([pinned] if pinned else MOE_CHUNKS):
        forward, backward = exposed(c, experts_s), exposed(c, 2 * experts_s)
        if best is None or forward + backward < (best[1] + best[2]) * (1 - 1e-9):
            best = (c, forward, backward)
    return best


def shape_lost_flops(layer: LayerProfile, b: int, seq: int | None, ways: dict, device,
                     dtype: str) -> float:
    """FLOPs the layer's GEMMs lose to their shapes (cost/gemm.py: tile and wave
    quantization on a GPU, the calibrated rate by size elsewhere), each GEMM split as
    tensor parallelism splits it (`ways` per FLOP field): its FLOPs over its utilization
    minus its FLOPs. Times 1 / (peak · efficiency) that is the extra time."""
    lost = 0.0
    for gemm, (count, m, n, k) in zip(layer.gemms, layer.gemm_shapes(b, seq)):
        split = ways[gemm.field] if gemm.split != "none" else 1
        if split > 1:
            if gemm.split == "n":
                n = math.ceil(n / split)
            elif gemm.split == "k":
                k = math.ceil(k / split)
            else:
                count = math.ceil(count / split)
        use = utilization(device, dtype, round(count), round(m), round(n), round(k),
                          gemm.kind)
        lost += 2 * count * m * n * k * (1 / use - 1)
    return lost


def _tiling(mesh: Mesh) -> tuple:
    """What layer times depend on besides the tp degree: under spatial tiles, the tiles
    and dp (BatchNorm's statistics are reduced over dp × tp)."""
    return (mesh.spatial, mesh.dp) if mesh.spatial else ()


@lru_cache(maxsize=256)
def axis_ranks(mesh: Mesh, axis: str) -> tuple[int, ...]:
    """The mesh ranks of rank 0's group on `axis`: "tp" (ranks 0 … tp − 1), or one of
    the axes spatial tiles add (plan.spatial_groups: tile rows and columns, dp × tp),
    "ep" / "edp" (plan.expert_groups), or "stats": whichever of "tp" and "dp_tp"
    BatchNorm's statistics span."""
    if axis == "tp":
        return tuple(range(mesh.tp))
    if axis in ("ep", "edp"):
        return tuple(next(g for g in expert_groups(mesh)[axis] if 0 in g))
    if axis == "stats":   # BatchNorm's statistics under spatial tiles: tiles and dp
        axis = spatial_stats_axis(mesh)
        if axis == "tp":
            return tuple(range(mesh.tp))
    return tuple(next(g for g in spatial_groups(mesh)[axis] if 0 in g))


@dataclass(frozen=True)
class Split:
    """The pp × v stages of a layout and, per pp rank, the stages and layers it runs."""

    starts: tuple[int, ...]                          # first layer of each stage
    placement: tuple[int, ...]                       # pp rank of each stage (stage_ranks)
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # per rank: [first, end) of its stages
    sums: tuple[LayerTimes, ...]   # per rank: its layers' times and bytes, summed
    working: tuple[float, ...]     # per rank: the most bytes one of its layers saves

    @classmethod
    def of(cls, times: Sequence[LayerTimes], starts: Sequence[int],
           placement: Sequence[int]) -> "Split":
        bounds = [*starts, len(times)]
        ranges = tuple(tuple((bounds[s], bounds[s + 1]) for s, r in enumerate(placement)
                             if r == rank) for rank in range(max(placement) + 1))
        per_rank = [[x for first, end in spans for x in times[first:end]] for spans in ranges]
        # each field summed in layer order from 0, as sum(getattr(x, f) ...) would
        row = attrgetter(*(f.name for f in fields(LayerTimes)))
        sums = tuple(LayerTimes(*(sum(column) for column in zip(*map(row, layers))))
                     for layers in per_rank)
        working = tuple(max(x.saved for x in layers) for layers in per_rank)
        return cls(tuple(starts), tuple(placement), ranges, sums, working)

    @property
    def loads(self) -> list[float]:
        """Each rank's time per microbatch."""
        return [rank.total for rank in self.sums]


def stage_split(times: Sequence[LayerTimes], placement: tuple[int, ...],
                starts: tuple[int, ...] | None, cache: dict, shape: tuple) -> Split:
    """The pinned `starts`, else stages balanced by `partition` (cached per stage count and
    shape: several placements share it) and, where a rank runs several, rank-balanced."""
    key = ("split", placement, starts, *shape)
    if key not in cache:
        costs = [x.total for x in times]
        if starts is None:
            balanced = ("partition", len(placement), *shape)
            if balanced not in cache:
                cache[balanced] = partition(costs, len(placement))[0]
            starts = cache[balanced]
            if len(placement) > max(placement) + 1:
                starts = balance_ranks(costs, starts, placement)
        elif len(starts) != len(placement):
            raise ValueError(f"{len(starts)} stage starts for {len(placement)} stages")
        cache[key] = Split.of(times, starts, placement)
    return cache[key]


def balance_ranks(costs: Sequence[float], starts: Sequence[int],
                  placement: Sequence[int]) -> tuple[int, ...]:
    """`starts` with boundaries moved one layer at a time while that lowers the ranks'
    loads (compared largest first). `partition` balances the stages, but a rank running
    several stages (looped, V-shaped) is paced by their sum: in a V the first and the last
    stage share rank 0. A local search: each move strictly lowers the sorted loads, so it
    ends; it need not reach the best split."""
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    bounds = [*starts, len(costs)]
    stage = [prefix[bounds[s + 1]] - prefix[bounds[s]] for s in range(len(starts))]
    loads = [0.0] * (max(placement) + 1)
    for s, rank in enumerate(placement):
        loads[rank] += stage[s]
    best = sorted(loads, reverse=True)
    moved = True
    while moved:
        moved = False
        for k in range(1, len(starts)):
            for step in (-1, 1):
                cut = bounds[k] + step
                if not bounds[k - 1] < cut < bounds[k + 1]:
                    continue  # every stage keeps a layer
                shift = prefix[cut] - prefix[bounds[k]]  # cost moving from stage k to k-1
                trial = loads.copy()
                trial[placement[k - 1]] += shift
                trial[placement[k]] -= shift
                if sorted(trial, reverse=True) < best:
                    bounds[k], loads, best, moved = cut, trial, sorted(trial, reverse=True), True
    return tuple(bounds[:-1])


def in_flight(layout: Layout, rank: int = 0) -> float:
    """Microbatches whose activations pp rank `rank` holds at once, counted in units of one
    microbatch through all of the rank's stages.

    GPipe and looped BFS (Lamy-Poirier 2023) run every microbatch forward before the first
    backward: m. 1F1B: p − rank. Interleaved (v ≥ 2; also the interleaved zero-bubble
    schedule, whose deferred weight gradients keep 1F1B's peak): Megatron-LM's warm-up of
    2(p − rank − 1) + (v − 1)p + 1 stage-microbatches, i.e. p + (p − 1 − 2·rank)/v per rank
    (p + (p−1)/v on rank 0, Korthikanti et al.). V-shaped, balanced over the ranks: ZB-V
    holds 1F1B's p (Qi et al. 2024); DualPipeV PP + 1 = 2p + 1 stage-microbatches, p + ½
    (DeepSeek-V3 report, table 2, DualPipe README).
    """
    p, m, v, schedule = layout.mesh.pp, layout.num_microbatches, layout.virtual_stages, \
        layout.schedule
    if p == 1:
        return 1.0
    if schedule in ("gpipe", "looped-bfs"):
        return float(m)
    if schedule == "zbv":
        flight = float(p)
    elif schedule == "dualpipev":
        flight = p + 0.5
    elif schedule in ("interleaved", "zero-bubble") and v > 1:
        flight = p + (p - 1 - 2 * rank) / v
    else:
        flight = float(p - rank)
    return max(1.0, min(float(m), flight))


def bubble(layout: Layout, slowest: LayerTimes) -> float:
    """Idle time of the pipeline, in units of one microbatch's time on the slowest rank.

    `slowest` sums that rank's layers: per microbatch forward t_f, backward t_b (with the
    recomputation it needs) and weight-gradient share t_w = backward / 2 (the backward
    splits evenly into input and weight gradients); t = t_f + t_b + tp communication.
    With p ranks and v stages per rank (a stage takes t / v):

    - GPipe, 1F1B: p − 1 (Narayanan et al. 2021).
    - interleaved 1F1B, looped BFS: (p − 1) / v (Narayanan et al.; Lamy-Poirier 2023).
    - interleaved zero bubble (ZB-H1 per stage): (p − 1)(t_f + t_b − 2t_w) / (v·t)
      (Qi et al., ICLR 2024; ZB1P of the DeepSeek-V3 report, table 2).
    - ZB-V: (p − 1)·max(0, t_f + t_b − 3t_w) / (v·t), i.e. ZB-H2's (p−1)(T_F + T_B − 2T_W)
      per stage with T_B = t_b − t_w the input gradient (Qi et al.): zero without
      recomputation when t_b = 2t_f.
    - DualPipeV: (PP/2 − 1)(F&B + B − 3W) per stage with PP = 2p stages (DeepSeek-V3
      report, table 2; DualPipe README); with F&B = F + B (no compute/communication
      overlap is modelled): (p − 1)(t_f + 2t_b − 3t_w) / (v·t).

    These assume enough microbatches to fill the pipeline. With fewer, one microbatch's
    trip bounds the step: forward and backward through all p ranks (p·t), of which the
    zero-bubble schedules defer all weight gradients but the last stage's
    ((p·(t − t_w) + t_w/v) / t); the bubble is at least that trip less m.
    """
    p, v, m, schedule = layout.mesh.pp, layout.virtual_stages, layout.num_microbatches, \
        layout.schedule
    t = slowest.total
    if p == 1 or not t:
        return 0.0
    t_f, t_b, t_w = slowest.forward, slowest.backward + slowest.recompute, slowest.backward / 2
    per_stage = (p - 1) / v
    trip = float(p)
    if schedule in ("interleaved", "looped-bfs"):
        idle = per_stage
    elif schedule == "zero-bubble":
        idle = per_stage * (t_f + t_b - 2 * t_w) / t
    elif schedule == "zbv":
        idle = per_stage * max(0.0, t_f + t_b - 3 * t_w) / t
    elif schedule == "dualpipev":
        idle = per_stage * (t_f + 2 * t_b - 3 * t_w) / t
    else:
        idle = float(p - 1)
    if schedule in ("zero-bubble", "zbv", "dualpipev"):
        trip = (p * (t - t_w) + t_w / v) / t
    return max(idle, trip - m)


def price(profile: ModelProfile, cluster, layout: Layout, seq: int | None, dtype: str,
          graph_dtype_bytes: int, optimizer: str, global_batch: int,
          cache: dict | None = None, attention: str = "flash",
          tp_overlap: float = 0.0, stage_starts: tuple[int, ...] | None = None,
          pipeline_grad_overlap: bool = False, grad_reduce_dtype: str | None = None,
          grad_sync_overlap: bool = True, moe_load_skew: float = 0.0,
          sums_first: bool = False) -> Priced:
    """Predict `layout`; `cache` (any dict, kept across calls) reuses layer times and splits.

    `tp_overlap` is the share of tensor-parallel communication hidden behind compute (0 for
    autohybrid's runtime today; `TP_OVERLAP_MEGATRON_CORE` for runs that overlap it).
    `pipeline_grad_overlap`: Megatron-Core's overlap of the ZeRO-1/2 parameter all-gather
    with compute (--overlap-param-gather); autohybrid gathers the parameters after the
    optimizer step, so for its plans that gather is exposed. The dp gradient sync
    overlaps the backward in buckets in both (with pp > 1, the last microbatch's backward
    on each rank: runtime/reducer.py launches a bucket once its gradients are final).
    `stage_starts` pins the first layer of each of the pp × v stages (None: balanced).
    `grad_reduce_dtype`: what the dp sync sends (None: the gradients' dtype, which is the
    fp32 master weights' when `dtype` is 16-bit: memory.state_bytes_per_param's accounting).
    `grad_sync_overlap=False` prices the dp gradient sync after the backward, whole (the
    Megatron-LM of 2021, which all-reduced its gradients once backward was done).
    `moe_load_skew`: under ep, the busiest rank's experts get that much more than the mean
    routed rows (every rank waits for it in the all-to-all).
    `sums_first`: the loss has a term over whole-batch statistics, which under
    microbatches the runtime adds up in one more forward of every microbatch, without
    autograd, before the step (runtime/whole_batch.py): through the stages in turn, each
    rank's microbatches one after another.
    """
    cache = {} if cache is None else cache
    if "links" not in cache:
        cache["links"] = LinkCache(cluster)
    cluster = cache["links"]
    mesh = layout.mesh
    shape = (layout.microbatch_size, mesh.tp, mesh.sp, layout.recompute, mesh.ep,
             *_tiling(mesh))
    every = ("times", *shape, layout.collective_matmul, layout.moe_chunks)
    if every not in cache:
        times = []
        for layer in profile.layers:
            key = (layer.signature, *shape, layout.collective_matmul, layout.moe_chunks)
            if key not in cache:
                cache[key] = layer_times(layer, cluster, layout, seq, dtype,
                                         graph_dtype_bytes, attention, tp_overlap,
                                         profile.kv_heads, profile.vocab, moe_load_skew,
                                         profile.expert_tp(mesh.tp, mesh.sp))
            times.append(cache[key])
        chunked = tuple((layer.name, t.chunks) for layer, t in zip(profile.layers, times)
                        if t.chunks)
        cache[every] = (times, chunked)
    times, chunked = cache[every]
    ranks_key = ("stage ranks", layout.schedule, mesh.pp, layout.virtual_stages)
    placement = cache.get(ranks_key)
    if placement is None:
        placement = cache[ranks_key] = stage_ranks(layout.schedule, mesh.pp,
                                                   layout.virtual_stages)
    stages = stage_split(times, placement, stage_starts, cache, shape)
    loads = stages.loads
    slowest = max(loads)
    m = layout.num_microbatches
    idle = bubble(layout, stages.sums[loads.index(slowest)])
    scheduled = (m + idle) * slowest
    compute = scheduled / shared_speedup(cluster.device.alone_speedup, m, idle)
    if sums_first and m > 1:
        forwards = [rank.forward for rank in stages.sums]
        fill = (mesh.pp - 1) * max(forwards) / layout.virtual_stages
        compute += m * max(forwards) + fill
    p2p = _p2p(cluster, layout, stages, times, m, cache, every)
    limit = gather_min_mb(cluster, layout) * 2**20 if layout.recompute != "full" else 0.0
    held = _held(profile, stages, shape, cache, limit, graph_dtype_bytes)
    params_local, tensors = max(held.params), held.tensors
    # buckets launched during backward (pipelines: the last microbatch's)
    overlap = grad_sync_overlap
    worst, grad_sync, exposed, bucket_mb = _ranks_memory_and_sync(
        cluster, layout, stages, held, dtype, optimizer, overlap, cache, grad_reduce_dtype,
        pipeline_grad_overlap)
    update = params_local / (mesh.dp if layout.zero else 1) * OPTIMIZER_BYTES_PER_PARAM \
        / (cluster.device.memory_bandwidth * MEMORY_EFFICIENCY)
    if cluster.cluster.device_type != "cpu":
        tensors = 1  # foreach: one launch per op over every tensor
    update += tensors * OPTIMIZER_OPS_PER_TENSOR[optimizer] * cluster.device.launch_overhead_s
    step = compute + p2p + exposed + update
    tp_total = m * max(rank.tp_comm for rank in stages.sums)
    peak = cluster.device.peak_flops.get(dtype) or max(cluster.device.peak_flops.values())
    if "model_flops" not in cache:
        cache["model_flops"] = profile.step_flops(1, seq)
    model_flops = cache["model_flops"] * global_batch
    prediction = Prediction(
        step_time_s=step, compute_s=compute - tp_total,
        comm_s=tp_total + p2p + grad_sync, exposed_comm_s=tp_total + p2p + exposed,
        bubble_fraction=(idle * slowest / scheduled) if scheduled else 0.0,
        mfu=model_flops / (step * mesh.world_size * peak) if step else 0.0,
        memory_per_rank_bytes=worst.total, device_memory_bytes=cluster.device.memory_bytes,
        memory=worst)
    fits = worst.total <= usable_bytes(cluster.device.memory_bytes)
    moe_chunks = next((t.moe_chunks for t in times if t.moe_chunks), 1)
    return Priced(prediction, stages.starts, fits, chunked, bucket_mb, moe_chunks)


def shared_speedup(alone: float, m: int, idle: float) -> float:
    """How much faster than priced a schedule of `m` microbatches whose ranks each idle
    for `idle` microbatch slots (the bubble) computes on a host whose ranks share its
    cores: a rank alone computes `alone` times faster than beside all the others
    (DeviceSpec.alone_speedup: the cores oversubscribed by that factor), so while some
    ranks idle the busy ones take their share of the cores. The cores' work is conserved
    down to the busy time, (m + idle)/m, and no rank computes faster than alone. 1 where
    ranks do not share compute (each its own device) or nothing idles."""
    if alone <= 1.0 or idle <= 0 or m <= 0:
        return 1.0
    return min(alone, (m + idle) / m)


def memory_per_pp_rank(profile: ModelProfile, cluster, layout: Layout, seq: int | None,
                       dtype: str, graph_dtype_bytes: int, optimizer: str,
                       stage_starts: tuple[int, ...]) -> tuple[MemoryBreakdown, ...]:
    """Predicted bytes on each pp coordinate (every dp and tp rank of one holds the same)
    for `layout` with its stages starting at `stage_starts`: what `price` computes for
    the most loaded rank, for every rank (the report's memory per rank)."""
    cache: dict = {}
    links = LinkCache(cluster)
    mesh = layout.mesh
    shape = (layout.microbatch_size, mesh.tp, mesh.sp, layout.recompute, mesh.ep,
             *_tiling(mesh))
    by_signature: dict = {}  # identical layers (a model's repeated blocks) priced once
    for layer in profile.layers:
        if layer.signature not in by_signature:
            by_signature[layer.signature] = layer_times(
                layer, links, layout, seq, dtype, graph_dtype_bytes, "flash", 0.0,
                profile.kv_heads, profile.vocab,
                expert_tp=profile.expert_tp(mesh.tp, mesh.sp))
    times = [by_signature[layer.signature] for layer in profile.layers]
    placement = stage_ranks(layout.schedule, mesh.pp, layout.virtual_stages)
    stages = stage_split(times, placement, stage_starts, cache, shape)
    limit = gather_min_mb(links, layout) * 2**20 if layout.recompute != "full" else 0.0
    held = _held(profile, stages, shape, cache, limit, graph_dtype_bytes)
    out = []
    for rank in range(mesh.pp):
        state = _training_state({}, held.params[rank], dtype, optimizer, layout.zero,
                                mesh.dp, held.experts[rank], mesh.ep)
        out.append(_rank_memory(state, stages.sums[rank], stages.working[rank], layout, rank))
    return tuple(out)


@dataclass(frozen=True)
class Held:
    """What the pp ranks of a split hold: parameters per rank (one tp rank's share), the
    most parameter tensors on one rank, and the first rank of each group of ranks running
    the same work: it stands for the group, whose microbatches in flight never grow with
    the rank (`in_flight`)."""

    params: tuple[float, ...]
    tensors: int
    distinct: tuple[int, ...]
    gathers: tuple[int, ...] = ()    # per rank: its ZeRO-3 gathers (layers.gather_groups)
    #: per rank: the part of `params` that is expert slices (ZeRO shards them over "edp")
    experts: tuple[float, ...] = ()


def _held(profile: ModelProfile, stages: Split, shape: tuple, cache: dict,
          gather_limit: float = 0.0, width: int = 4) -> Held:
    key = ("held", stages.starts, stages.placement, *shape, gather_limit, width)
    if key not in cache:
        tp, ep = shape[1], shape[4]
        etp = profile.expert_tp(tp, shape[2])
        per_rank = [_rank_params(profile, spans, tp, cache, gather_limit, width, ep, etp)
                    for spans in stages.ranges]
        params = tuple(local for local, _, _ in per_rank)
        first: dict[tuple, int] = {}
        for rank, work in enumerate(zip(params, stages.sums, stages.working)):
            first.setdefault(work, rank)
        experts = tuple(profile.expert_params([layer for first, end in spans
                                               for layer in profile.layers[first:end]], ep,
                                              etp, tp)
                        if ep > 1 else 0.0 for spans in stages.ranges)
        cache[key] = Held(params, max(count for _, count, _ in per_rank),
                          tuple(first.values()), tuple(n for _, _, n in per_rank), experts)
    return cache[key]


def _rank_params(profile: ModelProfile, ranges: tuple[tuple[int, int], ...], tp: int,
                 cache: dict, gather_limit: float = 0.0,
                 width: int = 4, ep: int = 1, etp: bool = False) -> tuple[float, int, int]:
    """(parameters one tp rank of a pp rank holds, its parameter tensors, its ZeRO-3
    gathers) for the stages in `ranges`: a parameter tied between two stages of the rank
    is held once; the gathers are `layers.gather_groups` of its layers that read
    parameters (`width` bytes each), as passes/zero.py places them; `etp`: tp splits the
    experts (ModelProfile.expert_tp)."""
    key = ("params", ranges, tp, gather_limit, width, ep, etp)
    if key not in cache:
        # the parameter count depends on neither the gather limit nor the width: shared
        held = ("held params", ranges, tp, ep, etp)
        if held not in cache:
            layers = [layer for first, end in ranges for layer in profile.layers[first:end]]
            names = {name for layer in layers for name, _, _ in layer.params}
            cache[held] = (profile.local_params(layers, tp, ep, etp), len(names))
        gathers = 0
        if gather_limit:
            sizes, starts = [], []
            for first, end in ranges:
                reading = [i for i in range(first, end) if profile.layers[i].params]
                sizes += [_layer_params(profile, i, tp, cache, ep, etp) * width
                          for i in reading]
                starts += [i == 0 for i in range(len(reading))]
            gathers = len(gather_groups(sizes, starts, gather_limit))
        else:  # no limit: one gather per layer that reads parameters
            gathers = sum(1 for first, end in ranges for layer in profile.layers[first:end]
                          if layer.params)
        cache[key] = (*cache[held], gathers)
    return cache[key]


def _layer_params(profile: ModelProfile, index: int, tp: int, cache: dict,
                  ep: int = 1, etp: bool = False) -> float:
    """Parameters one tp (and ep) rank holds of layer `index` (memoized per tp, ep)."""
    key = ("layer params", index, tp, ep, etp)
    if key not in cache:
        cache[key] = profile.local_params([profile.layers[index]], tp, ep, etp)
    return cache[key]


def _p2p(cluster, layout: Layout, stages: Split, times: list[LayerTimes], m: int,
         cache: dict | None = None, times_key: tuple = ()) -> float:
    """Pipeline sends on the critical path: every microbatch's activation forward and its
    gradient backward, (m + p − 1) times as many as the busiest rank sends per microbatch
    (a V-shaped schedule's turn stays on its rank). `cache` keeps the busiest rank's
    sends and the activation per split and `times_key` (what `times` were priced for)."""
    mesh = layout.mesh
    if mesh.pp == 1:
        return 0.0
    key = ("p2p", stages.starts, stages.placement, times_key)
    found = cache.get(key) if cache is not None and times_key else None
    if found is None:
        placement = stages.placement
        crossing = [s for s in range(1, len(placement)) if placement[s] != placement[s - 1]]
        sends = [0] * mesh.pp
        for s in crossing:
            sends[placement[s - 1]] += 1
        activation = max((times[stages.starts[s]].input for s in crossing), default=0.0)
        found = (max(sends), activation)
        if cache is not None and times_key:
            cache[key] = found
    busiest, activation = found
    pair = [0, mesh.dp * mesh.tp]  # neighbouring stages' ranks (placement order)
    hops = (m + mesh.pp - 1) * busiest
    return 2 * hops * comm.send_recv(cluster, pair, activation)


def _ranks_memory_and_sync(cluster, layout: Layout, stages: Split, held: Held, dtype: str,
                           optimizer: str, overlap: bool, cache: dict,
                           grad_reduce_dtype: str | None = None, gather_overlap: bool = False
                           ) -> tuple[MemoryBreakdown, float, float, float]:
    """(memory of the most loaded rank, slowest dp gradient sync, most exposed part of it,
    the bucket size that exposes least: the pinned one, else the cheapest of
    BUCKET_CHOICES_MB, the larger on a tie).

    With `overlap`, the sync of a rank's gradients overlaps its backward in buckets: all
    but the last bucket hide behind the backward of the layers after them, as far as the
    link hides a collective started before compute (`comm.hidden_share`: all of it on
    an accelerator's link uncalibrated, a third on the local gloo placeholder, what
    `ah.calibrate` measured on a calibrated one); without, all of it is exposed. Each
    bucket is its own collective and pays its latency."""
    worst, syncs = None, []
    width = dtype_bytes(grad_reduce_dtype) if grad_reduce_dtype else max(4, dtype_bytes(dtype))
    for rank in held.distinct:
        local, sums = held.params[rank], stages.sums[rank]
        state = _training_state(cache, local, dtype, optimizer, layout.zero, layout.mesh.dp,
                                held.experts[rank], layout.mesh.ep)
        memory = _rank_memory(state, sums, stages.working[rank], layout, rank)
        if worst is None or memory.total > worst.total:
            worst = memory
        syncs.append((local * width, sums.backward, held.gathers[rank], sums.forward,
                      sums.recompute))
    key = ("sync", layout.mesh.dp, layout.mesh.tp, layout.zero, layout.collective_algorithm,
           layout.num_microbatches, layout.bucket_mb, tuple(syncs), overlap, gather_overlap)
    if key not in cache:
        cache[key] = _bucketed_sync(cluster, layout, tuple(syncs), overlap, gather_overlap)
    return (worst, *cache[key])


def _training_state(cache: dict, local: float, dtype: str, optimizer: str, zero: int,
                    dp: int, experts: float = 0.0, ep: int = 1) -> MemoryBreakdown:
    """`training_state`, memoized in the search's `cache` (most candidates share it);
    `experts` of the `local` parameters are expert slices, ZeRO-sharded over the dp/ep
    ranks holding the same experts (runtime/zero.py)."""
    key = ("state", local, dtype, optimizer, zero, dp, experts, ep)
    state = cache.get(key)
    if state is None:
        rest = training_state(local - experts, dtype, optimizer, zero, dp)
        if experts:
            mine = training_state(experts, dtype, optimizer, zero, dp // ep)
            rest = MemoryBreakdown(params=rest.params + mine.params,
                                   grads=rest.grads + mine.grads,
                                   optimizer=rest.optimizer + mine.optimizer)
        state = cache[key] = rest
    return state


def _bucketed_sync(cluster, layout: Layout, syncs: tuple[tuple, ...], overlap: bool,
                   gather_overlap: bool) -> tuple[float, float, float]:
    """(slowest dp sync, most exposed part of it, bucket size) of ranks whose (gradient
    bytes, backward time, ZeRO-3 gathers, forward time, recomputation time) per
    microbatch are `syncs`; see `_ranks_memory_and_sync`."""
    sizes = [layout.bucket_mb] if layout.bucket_mb is not None else BUCKET_CHOICES_MB
    if layout.mesh.dp == 1 or layout.zero == 3:
        sizes = sizes[-1:]  # no bucketed sync: every size ties, so the largest
    whole = [_dp_sync(cluster, layout, grad_bytes, gathers, forward, backward + recompute)
             for grad_bytes, backward, gathers, forward, recompute in syncs]
    # what the backward hides of a bucket's collective (on CPU, far from all of it)
    share = comm.hidden_share(cluster, dp_ranks(layout),
                              "all_reduce" if layout.zero == 0 else "reduce_scatter")
    best = None
    for size in sizes:
        grad_sync, exposed = 0.0, 0.0
        for (grad_bytes, backward, gathers, *_), (_, times, fixed, prefetched) in zip(
                syncs, whole):
            buckets = max(1, math.ceil(grad_bytes / (size * 2**20)))
            one = _dp_sync(cluster, layout, grad_bytes / buckets, gathers)[0]
            sync = one * buckets
            if gather_overlap and layout.zero in (1, 2):  # Megatron's param gather is hidden
                fixed = 0.0
            hidden = backward * (buckets - 1) / buckets if overlap else 0.0
            grad_sync = max(grad_sync, times * sync + fixed)
            floor = one if overlap else sync
            covered = max(0.0, min(sync - floor, hidden))  # in flight beside the backward
            exposed = max(exposed, times * (sync - share * covered if sync else 0.0)
                          + fixed - prefetched)
        if best is None or exposed <= best[1] * (1 + 1e-9):  # a tie: fewer, larger buckets
            best = (grad_sync, exposed, size)
    return best


def dp_ranks(layout: Layout) -> tuple[int, ...]:
    """One dp group: the ranks with the same pp and tp coordinate as rank 0."""
    return _strided(layout.mesh.tp, layout.mesh.dp)


@lru_cache(maxsize=1024)
def _strided(stride: int, count: int) -> tuple[int, ...]:
    return tuple(stride * i for i in range(count))


def gather_min_mb(cluster, layout: Layout) -> float:
    """`Plan.gather_min_mb`: ZeRO-3 layers with fewer parameter bytes than the dp link
    moves in one latency share a neighbour's gather (passes/zero.py)."""
    if layout.zero < 3 or layout.mesh.dp == 1:
        return 0.0
    return comm.latency_bytes(cluster, dp_ranks(layout)) / 2**20


def _dp_sync(cluster, layout: Layout, nbytes: float, gathers: int = 1, forward: float = 0.0,
             backward: float = 0.0) -> tuple[float, int, float, float]:
    """The dp synchronization of one rank's `nbytes` of gradients, as the runtime runs it:
    (a reduction that overlaps a backward in buckets, how many times per step, time that
    runs outside the buckets, the part of that hidden behind compute).

    ZeRO 0: one all-reduce in the last backward, flat, hierarchical or segmented as the
    layout says (cost/comm.py: `dp_all_reduce`). ZeRO-1: a reduce-scatter there, and the
    updated parameters all-gathered after the optimizer step (2Ψ like an all-reduce; the
    ZeRO paper). ZeRO-2: the reduce-scatter in every microbatch's backward. ZeRO-3: each
    microbatch gathers the parameters before each layer's forward and again in backward
    and reduce-scatters their gradients (runtime/zero.py: 3Ψ per microbatch), in three
    collectives for each of the rank's `gathers`: each collective's latency counts. The
    gathers are prefetched one layer ahead (passes/overlap.py in forward, passes/zero.py's
    backward gathers): each but the first hides behind the layer before it, `forward` /
    `backward` (a microbatch's compute on the rank, recomputation included) shared evenly
    by the gathers (`_prefetched`). Without a pipeline the reduce-scatters are issued
    asynchronously (ops/zero.py `deferred_reductions`): each but the last hides behind
    the next layer's backward, which it shares with that layer's gather; in a pipeline
    they are synchronous: exposed."""
    mesh = layout.mesh
    if mesh.dp == 1:
        return 0.0, 1, 0.0, 0.0
    ranks = dp_ranks(layout)
    if layout.zero == 0:
        return comm.dp_all_reduce(cluster, ranks, nbytes, layout.collective_algorithm), 1, \
            0.0, 0.0
    scatter = comm.reduce_scatter(cluster, ranks, nbytes)
    gather = comm.all_gather(cluster, ranks, nbytes)
    m = layout.num_microbatches
    if layout.zero == 1:
        return scatter, 1, gather, 0.0
    if layout.zero == 2:
        return scatter, m, gather, 0.0
    k = max(gathers, 1)
    latency = comm.ring_latency(cluster, ranks)
    one = (gather + (k - 1) * latency) / k   # one layer's gather
    hidden = 2 * k * one - _prefetched(one, k, forward) - _prefetched(one, k, backward)
    hidden *= comm.hidden_share(cluster, ranks, "all_gather")
    if mesh.pp == 1:
        summed = (scatter + (k - 1) * latency) / k   # one layer's reduce-scatter
        # of the backward's window per layer, what the prefetched gather leaves
        window = max(0.0, backward / k - one)
        hidden += (k - 1) * min(summed, window) \
            * comm.hidden_share(cluster, ranks, "reduce_scatter")
    return 0.0, 1, m * (scatter + 2 * gather + 3 * (k - 1) * latency), m * hidden


def _prefetched(one: float, k: int, compute: float) -> float:
    """Exposed time of `k` gathers of `one` seconds each, each issued when the layer
    before it starts (k layers computing `compute` in all): the first waits whole, each
    later one as far as it outlasts its predecessor's layer."""
    return one + (k - 1) * max(0.0, one - compute / k)


def _rank_memory(state: MemoryBreakdown, sums: LayerTimes, working: float, layout: Layout,
                 rank: int) -> MemoryBreakdown:
    """Bytes on pp rank `rank`: its training `state` and the activations of its layers
    (`sums`) for the microbatches in flight; with full recomputation only the layers'
    inputs are kept, and one layer's activations (`working`) are rebuilt at a time."""
    if layout.recompute == "full":
        per_microbatch = sums.recompute_saved
    else:
        per_microbatch, working = sums.saved, 0.0
    activations = per_microbatch * in_flight(layout, rank) + working
    # (not dataclasses.replace: this runs for every rank of every candidate)
    return MemoryBreakdown(params=state.params, grads=state.grads, optimizer=state.optimizer,
                           activations=int(activations))
