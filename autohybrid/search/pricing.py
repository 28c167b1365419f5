"""Price one fully specified layout: stage split, step time and memory per rank.

A layout is (pp, dp, tp, sp, microbatch size, microbatches, schedule, virtual stages,
recompute, ZeRO). The model's layers (search/space.py) are costed once per microbatch
shape; stages are cut by search/stages.py on those costs; the step time follows the
schedule formulas of `shared/reference/hardware_and_formulas.md`:

    step = (m + bubble) · slowest stage  +  pipeline p2p  +  exposed dp gradient sync
           + optimizer update

with bubble p−1 (GPipe, 1F1B), (p−1)/v (interleaved) or (p−1)·t_f/t (zero-bubble, ZB-H1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..cost import comm
from ..cost.compute import MATMUL_EFFICIENCY, MEMORY_EFFICIENCY
from ..cost.memory import dtype_bytes, training_state, usable_bytes
from ..plan import MemoryBreakdown, Mesh, Prediction
from .space import LayerProfile, ModelProfile, split_ways
from .stages import partition

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
#: Korthikanti et al.) writes scores, softmax and dropout mask: per score element about
#: 8 forward memory accesses, and 2 bytes (scores) + 2 (softmax) + 1 (mask) kept for
#: backward (their 5·a·s²·b activation term).
ATTENTION_IMPLEMENTATIONS = ("flash", "materialized")
#: Share of tensor-parallel communication Megatron-Core hides behind compute (its TP
#: communication overlap). Fitted (grid of 0.05, `published_runs.fit_tp_overlap`) as the
#: value minimizing the squared log-error of predicted TFLOP/s on the nine Megatron-Core
#: rows (1.7B–462B) of `shared/reference/published_runs.md`: 0.60, giving predicted /
#: published 1.07, 0.98, 0.93, 0.91, 1.02, 1.06, 1.06, 1.02, 1.04 (0.0 gives 1.07 … 0.77).
TP_OVERLAP_MEGATRON_CORE = 0.60
MATERIALIZED_ACCESSES_FORWARD = 8
MATERIALIZED_SAVED_PER_SCORE = 2 + 2 + 1


class LinkCache:
    """`cluster` with `link_for` memoized: the search asks for the same groups many times."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.devices_per_node = cluster.devices_per_node
        self.device = cluster.device
        self._links: dict[tuple[int, ...], object] = {}

    def link_for(self, ranks):
        key = tuple(ranks)
        if key not in self._links:
            self._links[key] = self.cluster.link_for(key)
        return self._links[key]


@dataclass(frozen=True)
class Layout:
    mesh: Mesh
    microbatch_size: int
    num_microbatches: int
    schedule: str = "none"
    virtual_stages: int = 1
    recompute: str = "none"
    zero: int = 0
    bucket_mb: float = 25.0


@dataclass(frozen=True)
class Priced:
    prediction: Prediction
    stage_starts: tuple[int, ...]
    fits: bool


@dataclass(frozen=True)
class LayerTimes:
    forward: float
    backward: float
    recompute: float
    tp_comm: float
    saved: float          # bytes kept for backward per microbatch
    recompute_saved: float  # bytes kept with full recomputation (the layer's input)


def layer_times(layer: LayerProfile, cluster, layout: Layout, seq: int | None,
                dtype: str, graph_dtype_bytes: int, attention: str = "flash",
                tp_overlap: float = 0.0, kv_heads: int | None = None,
                vocab: int | None = None) -> LayerTimes:
    mesh, b = layout.mesh, layout.microbatch_size
    t, sp = mesh.tp, mesh.sp
    v = layer.values(b, seq)
    scale = dtype_bytes(dtype) / graph_dtype_bytes
    device = cluster.device
    peak = device.peak_flops.get(dtype) or max(device.peak_flops.values())
    replicated_share = 1.0 / t if sp else 1.0
    kv, vocab_ways = split_ways("kv", t, kv_heads), split_ways("vocab", t, vocab=vocab)
    matmul = (v["mm_sharded"] / t + v["mm_kv"] / kv + v["mm_vocab"] / vocab_ways
              + v["mm_replicated"]) \
        / (peak * MATMUL_EFFICIENCY)
    moved = (v["bytes_sharded"] / t + v["bytes_replicated"] * replicated_share) * scale
    other = (v["other_sharded"] / t + v["other_replicated"] * replicated_share) / peak
    bandwidth = device.memory_bandwidth * MEMORY_EFFICIENCY
    core = v["attention_flops"] / t / (peak * MATMUL_EFFICIENCY)  # the attention core
    scores_saved = 0.0
    if attention == "materialized":
        scores = v["attention_scores"] / t
        core += MATERIALIZED_ACCESSES_FORWARD * dtype_bytes(dtype) * scores / bandwidth
        moved += MATERIALIZED_ACCESSES_FORWARD * dtype_bytes(dtype) * scores
        scores_saved = MATERIALIZED_SAVED_PER_SCORE * scores
    forward = matmul + max(moved / bandwidth, other) + layer.num_ops * device.launch_overhead_s
    recompute = {"none": 0.0, "full": forward, "selective": core}[layout.recompute]
    tp_ranks = list(range(t))
    tp_comm = 0.0
    for c in layer.collectives if t > 1 else ():
        nbytes = c.nbytes(b, seq) * scale
        if c.kind == "all_reduce":
            time = comm.all_reduce(cluster, tp_ranks, nbytes)
        else:
            time = comm.all_gather(cluster, tp_ranks, nbytes)
        # full recomputation runs the forward, its collectives included, a second time
        repeats = 2 if c.direction == "forward" and layout.recompute == "full" else 1
        tp_comm += repeats * time * (1.0 - tp_overlap)
    saved = (v["saved_sharded"] / t + v["saved_replicated"] * replicated_share) * scale
    if layout.recompute == "selective":
        saved -= v["attention_saved"] / t * scale
    else:
        saved += scores_saved
    kept = v["input_bytes"] * replicated_share * scale
    return LayerTimes(forward, 2 * forward, recompute, tp_comm, saved, kept)


def in_flight(layout: Layout) -> float:
    """Microbatches whose activations stage 0 holds at once under the schedule."""
    p, m, v = layout.mesh.pp, layout.num_microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved":
        return min(float(m), p * (1 + (p - 1) / (p * v)))
    return float(min(m, p))


def bubble(layout: Layout, forward_share: float) -> float:
    """Idle time of the pipeline, in units of one microbatch's stage time."""
    p, v = layout.mesh.pp, layout.virtual_stages
    if p == 1:
        return 0.0
    if layout.schedule == "interleaved":
        return (p - 1) / v
    if layout.schedule == "zero-bubble":
        return (p - 1) * forward_share
    return float(p - 1)


def price(profile: ModelProfile, cluster, layout: Layout, seq: int | None, dtype: str,
          graph_dtype_bytes: int, optimizer: str, global_batch: int,
          cache: dict | None = None, attention: str = "flash",
          tp_overlap: float = 0.0) -> Priced:
    """Predict `layout`; `cache` (any dict, kept across calls) reuses layer times and splits.

    `tp_overlap` is the share of tensor-parallel communication hidden behind compute (0 for
    autohybrid's runtime today; `TP_OVERLAP_MEGATRON_CORE` for runs that overlap it).
    """
    cache = {} if cache is None else cache
    if "links" not in cache:
        cache["links"] = LinkCache(cluster)
    cluster = cache["links"]
    mesh = layout.mesh
    shape = (layout.microbatch_size, mesh.tp, mesh.sp, layout.recompute)
    times = []
    for layer in profile.layers:
        key = (layer.signature, *shape)
        if key not in cache:
            cache[key] = layer_times(layer, cluster, layout, seq, dtype, graph_dtype_bytes,
                                     attention, tp_overlap, profile.kv_heads, profile.vocab)
        times.append(cache[key])
    per_layer = [x.forward + x.backward + x.recompute + x.tp_comm for x in times]
    split_key = ("split", mesh.pp, *shape)
    if split_key not in cache:
        cache[split_key] = partition(per_layer, mesh.pp)
    starts, slowest = cache[split_key]
    bounds = [*starts, len(times)]
    stages = [times[bounds[k]:bounds[k + 1]] for k in range(mesh.pp)]
    layers = [profile.layers[bounds[k]:bounds[k + 1]] for k in range(mesh.pp)]
    forward_share = max(sum(x.forward for x in s) for s in stages) / slowest if slowest else 0.0
    m = layout.num_microbatches
    idle = bubble(layout, forward_share)
    compute = (m + idle) * slowest
    activation = _boundary_bytes(times, bounds, layout)
    p2p = 0.0
    if mesh.pp > 1:
        pair = [0, mesh.dp * mesh.tp]  # neighbouring stages' ranks (placement order)
        hops = (m + mesh.pp - 1) * layout.virtual_stages
        p2p = 2 * hops * comm.send_recv(cluster, pair, activation)
    params, tensors = [], 0
    for k in range(mesh.pp):
        key = ("params", bounds[k], bounds[k + 1], mesh.tp)
        if key not in cache:
            names = {name for layer in layers[k] for name, _, _ in layer.params}
            cache[key] = (profile.local_params(layers[k], mesh.tp), len(names))
        params.append(cache[key][0])
        tensors = max(tensors, cache[key][1])  # parameter tensors of the largest stage
    memories, grad_sync, exposed = [], 0.0, 0.0
    for k in range(mesh.pp):
        memory = _stage_memory(params[k], stages[k], layout, dtype, optimizer, k)
        memories.append(memory)
        grad_bytes = params[k] * dtype_bytes(dtype)
        sync = _dp_sync(cluster, layout, grad_bytes)
        backward = sum(x.backward for x in stages[k])
        buckets = max(1, math.ceil(grad_bytes / (layout.bucket_mb * 2**20)))
        hidden = backward * (buckets - 1) / buckets
        grad_sync = max(grad_sync, sync)
        exposed = max(exposed, max(sync - hidden, sync / buckets) if sync else 0.0)
    worst = max(memories, key=lambda mem: mem.total)
    params_local = max(params)
    update = params_local / (mesh.dp if layout.zero else 1) * OPTIMIZER_BYTES_PER_PARAM \
        / (cluster.device.memory_bandwidth * MEMORY_EFFICIENCY)
    if cluster.cluster.device_type != "cpu":
        tensors = 1  # foreach: one launch per op over every tensor
    update += tensors * OPTIMIZER_OPS_PER_TENSOR[optimizer] * cluster.device.launch_overhead_s
    step = compute + p2p + exposed + update
    tp_total = m * max(sum(x.tp_comm for x in s) for s in stages)  # on the slowest stage
    peak = cluster.device.peak_flops.get(dtype) or max(cluster.device.peak_flops.values())
    if "model_flops" not in cache:
        cache["model_flops"] = profile.step_flops(1, seq)
    model_flops = cache["model_flops"] * global_batch
    prediction = Prediction(
        step_time_s=step, compute_s=compute - tp_total,
        comm_s=tp_total + p2p + grad_sync, exposed_comm_s=tp_total + p2p + exposed,
        bubble_fraction=(idle * slowest / compute) if compute else 0.0,
        mfu=model_flops / (step * mesh.world_size * peak) if step else 0.0,
        memory_per_rank_bytes=worst.total, device_memory_bytes=cluster.device.memory_bytes,
        memory=worst)
    fits = worst.total <= usable_bytes(cluster.device.memory_bytes)
    return Priced(prediction, tuple(starts), fits)


def _boundary_bytes(times: list[LayerTimes], bounds: list[int], layout: Layout) -> float:
    """Bytes one microbatch sends across a stage boundary (the next layer's input)."""
    sizes = [times[b].recompute_saved for b in bounds[1:-1]]
    return max(sizes) if sizes else 0.0


def _dp_sync(cluster, layout: Layout, nbytes: float) -> float:
    """Gradient synchronization of one stage's `nbytes` of gradients over its dp group."""
    mesh = layout.mesh
    if mesh.dp == 1:
        return 0.0
    ranks = [mesh.tp * i for i in range(mesh.dp)]  # one dp group: same pp and tp coordinate
    if layout.zero >= 2:
        # ZeRO paper: gradients reduce-scattered, then updated parameters all-gathered (2Ψ,
        # as an all-reduce); ZeRO-3 gathers parameters for forward and again for backward (3Ψ)
        time = comm.reduce_scatter(cluster, ranks, nbytes)
        return time + comm.all_gather(cluster, ranks, nbytes) * (2 if layout.zero == 3 else 1)
    return comm.all_reduce(cluster, ranks, nbytes)


def _stage_memory(local: float, times: list[LayerTimes], layout: Layout, dtype: str,
                  optimizer: str, stage: int) -> MemoryBreakdown:
    """Bytes on a rank of `stage` that holds `local` parameters (after tp)."""
    mesh = layout.mesh
    state = training_state(local, dtype, optimizer, layout.zero, mesh.dp)
    if layout.recompute == "full":
        per_microbatch = sum(x.recompute_saved for x in times)
        working = max((x.saved for x in times), default=0.0)
    else:
        per_microbatch = sum(x.saved for x in times)
        working = 0.0
    flight = in_flight(layout) if stage == 0 else max(1.0, in_flight(layout) - stage)
    activations = per_microbatch * flight + working
    return replace(state, activations=int(activations))
