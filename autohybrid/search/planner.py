"""The planner: enumerate plan candidates, price each with the cost model, pick the best.

Pure functions of (graph cost, cluster, options): the same inputs give the same Plan on
every rank. Candidates whose features the runtime cannot execute are priced too (so
`ah.plan` can show them) and marked; `ah.compile` passes `executable_only=True`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import Callable

from ..cost import comm
from ..cost.compute import GraphCost, model_flops_per_step, step_compute_time
from ..cost.memory import activation_bytes, training_state, usable_bytes
from ..errors import NoPlanFitsError, NotExecutableError, PlanError
from ..plan import Alternative, Constraints, MemoryBreakdown, Mesh, Plan, Prediction, RankPlacement

#: Gradient bucket size when nothing pins it (PyTorch DDP's default).
DEFAULT_BUCKET_MB = 25.0
_GiB = 2**30


@dataclass(frozen=True)
class PlanRequest:
    """Everything the search needs besides the graph cost and the cluster."""

    model_hash: str
    global_batch: int
    seq: int | None
    dtype: str
    graph_dtype_bytes: int
    optimizer: str = "adam"
    constraints: Constraints = Constraints()
    model_ref: str | None = None
    has_batch_norm: bool = False


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    fits: bool
    unsupported: tuple[str, ...]

    @property
    def executable(self) -> bool:
        return not self.unsupported


def search(cost: GraphCost, cluster, request: PlanRequest,
           unsupported: Callable[[Plan], list[str]], executable_only: bool) -> Plan:
    """The fastest fitting plan (executable ones only when asked), with alternatives."""
    try:
        candidates = [_price(plan, cost, cluster, request, unsupported)
                      for plan in _enumerate(cluster, request)]
    except _Indivisible as exc:
        raise _indivisible_error(exc.dp, cost, cluster, request, unsupported) from None
    if not candidates:
        raise PlanError("no candidate plan satisfies the constraints "
                        f"{request.constraints.pinned()} on {cluster.describe()}")
    if executable_only:
        runnable = [c for c in candidates if c.executable]
        if not runnable:
            reasons = sorted({r for c in candidates for r in c.unsupported})
            raise NotExecutableError("the constraints ask for features the runtime cannot "
                                     "execute yet: " + "; ".join(reasons))
        candidates = runnable
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise NoPlanFitsError(_no_fit_message(candidates, cluster))
    best = min(fitting, key=_rank_key)
    alternatives = _alternatives(best, candidates)
    plan = replace(best.plan, alternatives=alternatives, executable=best.executable,
                   not_executable_because=best.unsupported)
    return plan


def _rank_key(c: Candidate) -> tuple:
    # Prefer executable plans on ties, then the fastest, then the one using less memory.
    return (not c.executable, round(c.plan.predicted.step_time_s, 12),
            c.plan.predicted.memory_per_rank_bytes, c.plan.summary())


def _enumerate(cluster, request: PlanRequest):
    pinned = request.constraints
    world = cluster.world_size
    tp, pp = pinned.tp or 1, pinned.pp or 1
    if tp != 1 or pp != 1 or pinned.sp:
        raise NotExecutableError(
            f"Constraints(tp={pinned.tp}, pp={pinned.pp}, sp={pinned.sp}): the planner does not "
            "plan tensor, sequence or pipeline parallelism yet (data parallelism only); "
            "leave tp, pp and sp unset")
    dp = world // (tp * pp)
    if pinned.dp is not None and pinned.dp != dp:
        raise PlanError(f"Constraints(dp={pinned.dp}) × tp {tp} × pp {pp} != world size {world} "
                        f"of {cluster.describe()}; use dp={dp}")
    if request.global_batch % dp:
        raise _Indivisible(dp)
    local = request.global_batch // dp
    mesh = Mesh(pp=pp, dp=dp, tp=tp)
    placement = tuple(RankPlacement(r, *cluster.rank_location(r)) for r in range(world))
    cluster_hash = hashlib.sha256(cluster.to_json().encode()).hexdigest()[:16]
    zeros = [pinned.zero] if pinned.zero is not None else [0, 1, 2, 3]
    recomputes = [pinned.recompute] if pinned.recompute is not None else ["none"]
    for count in _microbatch_counts(local, pinned):
        for zero in zeros:
            for recompute in recomputes:
                yield Plan(
                    model_hash=request.model_hash, cluster=cluster.describe(),
                    cluster_hash=cluster_hash, mesh=mesh, placement=placement,
                    global_batch=request.global_batch, microbatch_size=local // count,
                    num_microbatches=count, dtype=request.dtype, optimizer=request.optimizer,
                    schedule=pinned.schedule or "none", virtual_stages=pinned.virtual_stages or 1,
                    stage_boundaries=tuple(pinned.stage_boundaries or ()), recompute=recompute,
                    zero=zero, bucket_mb=pinned.bucket_mb or DEFAULT_BUCKET_MB,
                    collective_algorithm=pinned.collective_algorithm or "flat",
                    collective_matmul=bool(pinned.collective_matmul),
                    model_ref=request.model_ref)


class _Indivisible(PlanError):
    """The global batch does not split over the data-parallel ranks (search reports it)."""

    def __init__(self, dp: int):
        super().__init__(dp)
        self.dp = dp


def _microbatch_counts(local: int, pinned: Constraints) -> list[int]:
    if pinned.microbatch_size is not None:
        if local % pinned.microbatch_size:
            raise PlanError(f"Constraints(microbatch_size={pinned.microbatch_size}) does not "
                            f"divide the per-rank batch {local}")
        counts = [local // pinned.microbatch_size]
        if pinned.num_microbatches not in (None, counts[0]):
            raise PlanError(f"Constraints(microbatch_size={pinned.microbatch_size}, "
                            f"num_microbatches={pinned.num_microbatches}) give "
                            f"{pinned.microbatch_size * pinned.num_microbatches} samples per "
                            f"rank, but the per-rank batch is {local}")
        return counts
    if pinned.num_microbatches is not None:
        if local % pinned.num_microbatches:
            raise PlanError(f"Constraints(num_microbatches={pinned.num_microbatches}) does not "
                            f"divide the per-rank batch {local}")
        return [pinned.num_microbatches]
    return [k for k in range(1, local + 1) if local % k == 0]


def _price(plan: Plan, cost: GraphCost, cluster, request: PlanRequest,
           unsupported: Callable[[Plan], list[str]]) -> Candidate:
    mesh, device = plan.mesh, cluster.device
    state = training_state(cost.param_count, plan.dtype, plan.optimizer, plan.zero, mesh.dp,
                           mesh.tp, mesh.pp)
    saved = cost.activation_bytes(plan.microbatch_size, request.seq)
    memory = replace(state, activations=activation_bytes(saved, 1, request.graph_dtype_bytes,
                                                         plan.dtype))
    peak = device.peak_flops.get(plan.dtype) or max(device.peak_flops.values())
    micro_s = step_compute_time(cost, plan.microbatch_size, request.seq, peak,
                                device.memory_bandwidth)
    compute_s = micro_s * plan.num_microbatches
    comm_s, exposed_s = _gradient_sync(plan, cost, cluster, micro_s)
    step_s = compute_s + exposed_s
    flops = model_flops_per_step(cost, plan.global_batch, request.seq)
    mfu = flops / (step_s * cluster.world_size * peak) if step_s > 0 else 0.0
    predicted = Prediction(step_time_s=step_s, compute_s=compute_s, comm_s=comm_s,
                           exposed_comm_s=exposed_s, bubble_fraction=0.0, mfu=mfu,
                           memory_per_rank_bytes=memory.total,
                           device_memory_bytes=device.memory_bytes, memory=memory)
    plan = replace(plan, predicted=predicted)
    reasons = list(unsupported(plan))
    if request.has_batch_norm and plan.num_microbatches > 1:
        reasons.append("microbatching a model with BatchNorm changes its batch statistics")
    fits = memory.total <= usable_bytes(device.memory_bytes)
    return Candidate(plan=plan, fits=fits, unsupported=tuple(reasons))


def _gradient_sync(plan: Plan, cost: GraphCost, cluster, micro_s: float) -> tuple[float, float]:
    """Time of the gradient all-reduce and the part of it backward does not hide."""
    dp_ranks = [plan.mesh.coords(r) for r in range(plan.world_size)]
    ranks = [r for r, (p, _, t) in enumerate(dp_ranks) if p == 0 and t == 0]
    grad_bytes = cost.param_count / (plan.mesh.tp * plan.mesh.pp) * _width(plan.dtype)
    if plan.zero >= 2:
        comm_s = comm.reduce_scatter(cluster, ranks, grad_bytes)
        comm_s += comm.all_gather(cluster, ranks, grad_bytes) if plan.zero == 3 else 0.0
    else:
        comm_s = comm.all_reduce(cluster, ranks, grad_bytes)
    buckets = max(1, math.ceil(grad_bytes / (plan.bucket_mb * 2**20)))
    backward_s = micro_s * 2 / 3
    exposed = max(comm_s - backward_s * (buckets - 1) / buckets, comm_s / buckets)
    return comm_s, exposed


def _width(dtype: str) -> int:
    return {"float64": 8, "float32": 4}.get(dtype, 2)


def _alternatives(best: Candidate, candidates: list[Candidate]) -> tuple[Alternative, ...]:
    out, seen = [], {best.plan.summary()}
    base = best.plan.predicted.step_time_s
    for c in sorted(candidates, key=_rank_key):
        summary = c.plan.summary()
        if summary in seen:
            continue
        seen.add(summary)
        p = c.plan.predicted
        if not c.fits:
            reason = (f"does not fit: {p.memory_per_rank_bytes / _GiB:.1f} GiB > "
                      f"{usable_bytes(p.device_memory_bytes) / _GiB:.1f} GiB usable per rank")
        elif not c.executable:
            reason = "not executable yet: " + "; ".join(c.unsupported)
        else:
            delta = (p.step_time_s / base - 1) * 100 if base else 0.0
            reason = f"{delta:+.1f} % step time"
        out.append(Alternative(summary=summary, step_time_s=p.step_time_s,
                               memory_per_rank_bytes=p.memory_per_rank_bytes, fits=c.fits,
                               executable=c.executable, reason=reason))
        if len(out) == 8:
            break
    return tuple(out)


def _indivisible_error(dp: int, cost: GraphCost, cluster, request: PlanRequest,
                       unsupported: Callable[[Plan], list[str]]) -> PlanError:
    """Say the batch does not split and, priced at one sample per rank, what memory needs."""
    head = (f"global batch {request.global_batch} does not split over dp={dp} ranks (tensor "
            "and pipeline parallelism are not planned yet, so every rank is data-parallel)")
    probe_request = replace(request, global_batch=dp)
    probes = [_price(p, cost, cluster, probe_request, unsupported)
              for p in _enumerate(cluster, probe_request)]
    if any(c.fits for c in probes):
        return PlanError(f"{head}; use a global batch that is a multiple of {dp}")
    return NoPlanFitsError(f"{head}, and even at one sample per rank: "
                           + _no_fit_message(probes, cluster))


def _no_fit_message(candidates: list[Candidate], cluster) -> str:
    smallest = min(candidates, key=lambda c: c.plan.predicted.memory_per_rank_bytes)
    m: MemoryBreakdown = smallest.plan.predicted.memory
    usable = usable_bytes(cluster.device.memory_bytes)
    return (f"no plan fits in device memory on {cluster.describe()}: the smallest candidate "
            f"({smallest.plan.summary().split(' |')[0]}) needs "
            f"{m.total / _GiB:.1f} GiB per rank (parameters {m.params / _GiB:.1f}, gradients "
            f"{m.grads / _GiB:.1f}, optimizer state {m.optimizer / _GiB:.1f}, activations "
            f"{m.activations / _GiB:.1f} GiB) > {usable / _GiB:.1f} GiB usable of "
            f"{cluster.device.memory_bytes / _GiB:.1f} GiB per {cluster.device.name}. "
            "Use more devices, a smaller global batch, or constraints with tensor/pipeline "
            "parallelism once the planner supports them.")
