"""The planner: enumerate layouts, price each with the cost model, pick the best Plan.

Pure functions of (model profile, cluster, options): the same inputs give the same Plan
on every rank. The space is the mesh (tp inside a node, pp, dp), sequence parallelism,
microbatch size, pipeline schedule (and its virtual stages per rank: every schedule of
torch.distributed.pipelining that can run the layout), recomputation, ZeRO stage and,
with ZeRO 0, the dp gradient all-reduce algorithm ("flat", "hierarchical", "segmented":
the non-flat ones only where the dp group spans several nodes with several ranks on
each, where they price differently).
Pruning: for each ZeRO stage, more recomputation is only tried when less does not fit
(it only adds time); layer times and the stage split are cached per microbatch shape. Candidates the
runtime cannot execute are priced too (so `ah.plan` can show them) and marked;
`ah.compile` passes `executable_only=True` to search only the others.

Executable means executed: `Plan.executable` is True only for a plan whose passes ran on
this graph. The search is given a trial (runtime/dry_run.PassTrial: one rank rewritten on
fake process groups) and rewrites the best candidates, best first, until the passes
accept one; those they reject lose with the pass's reason (`plan.alternatives`). A
candidate needing a feature the runtime lacks (only without `executable_only`) is not
rewritten: it is chosen when it is the best, marked not executable with the missing
features. When the passes reject every candidate that fits, `executable_only` raises
NotExecutableError; without it the best candidate is returned, marked not executable
with the pass's reason. Without a trial nothing runs, and the plan says so. An
alternative's `executable` is False when it cannot run (a missing feature, a pass's
rejection) and None when its passes were not run (its reason says "not tried").
"""
from __future__ import annotations

import hashlib
import logging
import math
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Protocol

from .. import logs
from ..cost.comm import hierarchy_applies
from ..cost.memory import usable_bytes
from ..errors import NoPlanFitsError, NotExecutableError, PlanError
from ..plan import (Alternative, ChunkedLayer, Constraints, Mesh, NodeSharding, Plan,
                    RankPlacement, schedule_problem)
from .pricing import Layout, Priced, dp_ranks, gather_min_mb, memory_per_pp_rank, price
from .space import ModelProfile

#: Gradient bucket size of a plan built before pricing (the executability probe); a
#: priced plan has the pricing's choice (search/pricing.py: BUCKET_CHOICES_MB).
DEFAULT_BUCKET_MB = 25.0
#: Virtual stages per rank tried for each pipeline schedule when none is pinned: the
#: looped schedules gain bubble with depth but pay p2p per stage, so a few depths compete.
VIRTUAL_STAGES = {"gpipe": (1,), "1f1b": (1,), "interleaved": (2, 4), "looped-bfs": (1, 2),
                  "zero-bubble": (1, 2), "zbv": (2,), "dualpipev": (2,)}
_GiB = 2**30
log = logging.getLogger("autohybrid.search")


class SpatialProfiles(Protocol):
    """The profiles of the model under spatial tilings (autohybrid/spatial_costs.py)."""

    applies: bool

    def tilings(self, tp: int) -> list[tuple[int, ...]]: ...

    def __call__(self, tiles: tuple[int, ...]) -> ModelProfile | str: ...


@dataclass(frozen=True)
class PlanRequest:
    """Everything the search needs besides the model profile and the cluster."""

    model_hash: str
    global_batch: int
    seq: int | None
    dtype: str
    graph_dtype_bytes: int
    optimizer: str = "adam"
    constraints: Constraints = Constraints()
    model_ref: str | None = None
    has_batch_norm: bool = False
    #: why the graph cannot be cut into pipeline stages (passes/pipeline_split.py,
    #: `pipeline_blockers`): every pp > 1 layout is then not executable
    pp_blockers: tuple[str, ...] = ()
    calibration_hash: str | None = None
    #: MoE under ep: how much more than the mean routed rows the busiest rank's experts
    #: receive (0.2: 20 % more), priced as that much more expert compute
    moe_load_skew: float = 0.0
    #: the loss has a term over statistics of the whole batch (passes/global_loss.py):
    #: with microbatches the step runs one more forward first (runtime/whole_batch.py)
    whole_batch_sums: bool = False


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    priced: Priced
    unsupported: tuple[str, ...]
    #: why the passes rejected its plan (search's trial), None when not rejected
    rejected: str | None = None

    @property
    def executable(self) -> bool:
        return not self.unsupported

    @property
    def fits(self) -> bool:
        return self.priced.fits

    @property
    def step(self) -> float:
        return self.priced.prediction.step_time_s

    def summary(self) -> str:
        lay = self.layout
        sched = f" {lay.schedule}" + (f"×{lay.virtual_stages}" if lay.virtual_stages > 1 else "")
        algorithm = (f" {lay.collective_algorithm} all-reduce"
                     if lay.collective_algorithm != "flat" else "")
        return (f"{lay.mesh.describe()} microbatch {lay.microbatch_size}×{lay.num_microbatches}"
                f"{sched if lay.mesh.pp > 1 else ''} zero{lay.zero} recompute={lay.recompute}"
                f"{algorithm}")


def search(profile: ModelProfile, cluster, request: PlanRequest,
           unsupported: Callable[[Plan], list[str]], executable_only: bool,
           trial: Callable[[Plan], str | None] | None = None,
           spatial: SpatialProfiles | None = None) -> Plan:
    """The fastest fitting plan the passes accept (executable ones only when asked),
    with alternatives.

    `trial(plan)` (None, or why not) says whether the passes accept the graph under a
    plan (runtime/dry_run.PassTrial: one rank rewritten on fake process groups).
    Candidates are tried best first and the first one accepted is chosen; the faster
    ones it rejected stay in `plan.alternatives` with the pass's reason. When it rejects
    every candidate that fits, NotExecutableError lists the reasons (`executable_only`),
    or the best candidate comes back marked not executable with them. Without a trial
    the best candidate comes back marked not executable: its passes were not run.

    `spatial` prices spatial meshes (the tp axis tiling a CNN's activations) from the
    graph the spatial pass makes (spatial_costs.SpatialCosts); with it, such meshes
    compete with the others wherever the constraints leave tp and sp open."""
    start = time.perf_counter()
    checker = _Executability(cluster, request, unsupported)
    if executable_only:
        _refuse_pinned_features(request.constraints, unsupported)
    starts = _pinned_starts(profile, request.constraints)
    candidates: list[Candidate] = []
    skipped: list[str] = []
    refused: list[str] = []  # runtime features missing, per layout
    progress = _Progress(start)
    profiles = _Profiles(profile, spatial, request.seq)
    for base in _layouts(profile, cluster, request, skipped, spatial):
        costed = profiles.of(base)
        if isinstance(costed, str):
            skipped.append(f"spatial {base.mesh.spatial}: {costed}")
            continue
        cache = profiles.cache(base)
        for levels in _variants(base, request.constraints, cluster):
            for layout in levels:
                reasons = checker.reasons(layout, costed)
                if executable_only and reasons:
                    refused.append("; ".join(reasons))
                    continue
                priced = price(costed, cluster, layout, request.seq, request.dtype,
                               request.graph_dtype_bytes, request.optimizer,
                               request.global_batch, cache, stage_starts=starts,
                               grad_reduce_dtype=request.constraints.grad_reduce_dtype,
                               moe_load_skew=request.moe_load_skew,
                               sums_first=request.whole_batch_sums)
                candidates.append(Candidate(layout, priced, tuple(reasons)))
                progress.tick(len(candidates))
                if priced.fits:
                    break  # for this ZeRO stage, more recomputation only adds time
    progress.done()
    if not candidates:
        if refused:
            common = sorted(set.intersection(*(set(r.split("; ")) for r in refused)))
            raise NotExecutableError("the constraints ask for features the runtime cannot "
                                     "execute yet: " + "; ".join(common or sorted(set(refused))))
        why = "; ".join(dict.fromkeys(skipped)) or "the search space is empty"
        raise PlanError(f"no candidate plan: {why} (the constraints "
                        f"{request.constraints.pinned()}, on {cluster.describe()})")
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        raise NoPlanFitsError(_no_fit_message(candidates, cluster, skipped))
    best, plan, candidates = _choose(fitting, candidates, profiles, cluster, request,
                                     checker, trial, executable_only)
    plan = replace(plan, alternatives=_alternatives(best, candidates))
    log.info("priced %d candidates (%d fit) in %.3f s; chose %s", len(candidates),
             len(fitting), time.perf_counter() - start, best.summary())
    return plan


class _Profiles:
    """The profile a layout is priced with (a spatial mesh's: its tiled graph's), and a
    pricing cache per profile (layer times and parameter counts differ between them).
    The model's own profile prices every layout's model FLOPs (the MFU)."""

    def __init__(self, profile: ModelProfile, spatial: SpatialProfiles | None,
                 seq: int | None):
        self.profile, self.spatial, self.seq = profile, spatial, seq
        self.caches: dict[tuple, dict] = {}

    def of(self, layout: Layout) -> ModelProfile | str:
        tiles = layout.mesh.spatial
        if not tiles:
            return self.profile
        if self.spatial is None:
            return "no spatial profiles given to the search"
        return self.spatial(tiles)

    def cache(self, layout: Layout) -> dict:
        key = layout.mesh.spatial
        if key not in self.caches:   # (pricing.price reads "model_flops" from its cache)
            self.caches[key] = {"model_flops": self.profile.step_flops(1, self.seq)} \
                if key else {}
        return self.caches[key]


def _choose(fitting: list[Candidate], candidates: list[Candidate], profiles: _Profiles,
            cluster, request: PlanRequest, checker: "_Executability",
            trial: Callable[[Plan], str | None] | None, executable_only: bool
            ) -> tuple[Candidate, Plan, list[Candidate]]:
    """The best fitting candidate the trial accepts, its plan (marked executable only
    then), and the candidates with the rejected ones marked. A candidate the runtime
    cannot execute is not tried (the best of them is chosen, marked); without a trial
    the best candidate is chosen, marked untried."""
    rejected: dict[int, str] = {}
    chosen = plan = None
    accepted = False
    for c in sorted(fitting, key=_rank_key):
        plan = _make_plan(c, profiles.of(c.layout), cluster, request,
                          checker.placement(c.layout.mesh),
                          checker.cluster_hash)
        if trial is None or not c.executable:
            chosen = c  # nothing is tried: marked below
            break
        problem = trial(plan)
        if problem is None:
            chosen, accepted = c, True
            break
        rejected[id(c)] = problem
    if chosen is None:
        reasons = list(dict.fromkeys(rejected.values()))
        why = (f"the passes reject every candidate plan that fits ({len(fitting)} "
               f"candidates): " + "; ".join(reasons[:3])
               + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else ""))
        if executable_only:
            raise NotExecutableError(why)
        chosen = min(fitting, key=_rank_key)
        plan = _make_plan(chosen, profiles.of(chosen.layout), cluster, request,
                          checker.placement(chosen.layout.mesh), checker.cluster_hash)
    because = chosen.unsupported
    if id(chosen) in rejected:
        because += (f"rejected by the passes: {rejected[id(chosen)]}",)
    elif not accepted and chosen.executable:
        because += (_UNTRIED,)
    plan = replace(plan, executable=accepted, not_executable_because=because)
    if not rejected:
        return chosen, plan, candidates
    marked = [replace(c, unsupported=c.unsupported + (f"rejected by the passes: "
                                                      f"{rejected[id(c)]}",),
                      rejected=rejected[id(c)]) if id(c) in rejected else c
              for c in candidates]
    chosen = next(m for m, c in zip(marked, candidates) if c is chosen)
    return chosen, plan, marked


#: why a plan the runtime could run is not marked executable when no trial ran
_UNTRIED = "its passes were not run on this graph (no trial)"


def _rank_key(c: Candidate) -> tuple:
    # Executable first on ties, then the fastest, then less memory, then a stable name.
    return (round(c.step, 12), not c.executable,
            c.priced.prediction.memory_per_rank_bytes, c.summary())


# ---------------------------------------------------------------------- enumeration
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(profile: ModelProfile, cluster, request: PlanRequest,
             skipped: list[str], spatial: SpatialProfiles | None = None) -> Iterator[Layout]:
    pinned = request.constraints
    world = cluster.world_size
    blocks = len(profile.layers)
    sequence = any(layer.sp_region for layer in profile.layers)
    bucket = pinned.bucket_mb   # None: the pricing chooses it per layout
    axes = [(tp, ()) for tp in _tp_degrees(profile, cluster, pinned, skipped)]
    if pinned.spatial:
        axes = [(axes[0][0], pinned.spatial)]
    axes += _spatial_axes(cluster, pinned, spatial)
    for tp, tiles in axes:
        if world % tp:
            skipped.append(f"tp={tp} does not divide the world size {world}")
            continue
        for pp in ([pinned.pp] if pinned.pp else divisors(world // tp)):
            if tiles and pp > 1:
                if pinned.spatial:
                    skipped.append(f"pp={pp}: spatial tiles do not cross pipeline stages")
                continue
            if (world // tp) % pp or pp > blocks:
                skipped.append(f"pp={pp} does not fit {world // tp} ranks / {blocks} layers")
                continue
            dp = world // (tp * pp)
            if pinned.dp is not None and pinned.dp != dp:
                skipped.append(f"dp={pinned.dp} × tp {tp} × pp {pp} != world size {world}")
                continue
            if request.global_batch % dp:
                skipped.append(f"global batch {request.global_batch} does not split over "
                               f"dp={dp} ranks (use a multiple of {dp})")
                continue
            local = request.global_batch // dp
            for sp in ([False] if tiles else _sp_choices(tp, pinned, sequence)):
                if pinned.collective_matmul and not (sp and tp > 1):
                    skipped.append(f"collective_matmul=True needs tp > 1 with sp (tp={tp}, "
                                   f"sp={sp})")
                    continue
                for ep in _ep_degrees(profile, dp, tiles, pinned, skipped):
                    mesh = Mesh(pp=pp, dp=dp, tp=tp, sp=sp, spatial=tiles, ep=ep)
                    for micro in _microbatch_sizes(local, pinned, skipped):
                        count = local // micro
                        for schedule, virtual in _schedules(pp, count, blocks, pinned,
                                                            skipped):
                            yield Layout(mesh, micro, count, schedule, virtual, "none", 0,
                                         bucket, collective_matmul=pinned.collective_matmul,
                                         moe_chunks=pinned.moe_chunks)


def _ep_degrees(profile: ModelProfile, dp: int, tiles: tuple[int, ...], pinned: Constraints,
                skipped: list[str]) -> list[int]:
    """Expert-parallel degrees for a mesh with `dp` data-parallel ranks: the pinned one when
    it fits, else 1 and every divisor of dp dividing every MoE layer's experts (their
    all-to-alls, expert slices and gradient sums are priced: search/pricing.py)."""
    experts = profile.experts
    if pinned.ep is not None:
        problem = (None if pinned.ep == 1 else
                   "the model has no MoE layer (autohybrid::moe_experts)" if not experts else
                   f"dp={dp} is not a multiple of it" if dp % pinned.ep else
                   "spatial tiles use the mesh" if tiles else
                   f"MoE layers have {sorted(set(experts))} experts" if any(
                       e % pinned.ep for e in experts) else None)
        if problem:
            skipped.append(f"ep={pinned.ep}: {problem}")
            return []
        return [pinned.ep]
    if not experts or tiles:
        return [1]
    return [ep for ep in divisors(dp) if all(e % ep == 0 for e in experts)]


def _spatial_axes(cluster, pinned: Constraints,
                  spatial: SpatialProfiles | None) -> list[tuple[int, tuple[int, ...]]]:
    """(tp, tiles) of the spatial meshes to price besides the tp ones: for a graph with
    convolutions or pooling, every tiling of every tp degree inside a node, unless the
    constraints pin the tp axis (tp, sp, spatial), pp > 1 or a recompute level (which a
    spatial plan cannot have: plan._check_spatial_plan)."""
    if spatial is None or not spatial.applies or pinned.spatial is not None \
            or pinned.tp is not None or pinned.sp or pinned.collective_matmul \
            or (pinned.pp or 1) > 1 or pinned.recompute not in (None, "none"):
        return []
    return [(tp, tiles) for tp in divisors(cluster.world_size)
            if tp > 1 and cluster.devices_per_node % tp == 0 for tiles in spatial.tilings(tp)]


def _tp_degrees(profile: ModelProfile, cluster, pinned: Constraints,
                skipped: list[str]) -> list[int]:
    if pinned.spatial:   # the tp axis holds the tiles: no weight is split over it
        return [math.prod(pinned.spatial)]
    # unpinned, tp groups stay inside a node (pin tp to see other degrees priced)
    candidates = [pinned.tp] if pinned.tp else [
        tp for tp in divisors(cluster.world_size) if cluster.devices_per_node % tp == 0]
    out = []
    for tp in candidates:
        problem = profile.tp_problem(tp)
        if problem:
            skipped.append(problem)
            continue
        out.append(tp)
    return out


def _sp_choices(tp: int, pinned: Constraints, sequence: bool) -> list[bool]:
    """Sequence parallelism moves the same bytes as tp's all-reduces and splits the
    replicated regions' compute and activations, so with tp > 1 it dominates (pin sp=False
    to see the alternative priced); a graph with no sequence region (a CNN: no sequence
    dim) has nothing for it to split, so it is not offered."""
    if pinned.sp is not None:
        return [pinned.sp]
    return [True] if tp > 1 and not pinned.spatial and sequence else [False]


def _microbatch_sizes(local: int, pinned: Constraints, skipped: list[str]) -> list[int]:
    if pinned.microbatch_size is not None:
        if local % pinned.microbatch_size or (
                pinned.num_microbatches and pinned.num_microbatches * pinned.microbatch_size != local):
            skipped.append(f"microbatch_size={pinned.microbatch_size} × num_microbatches="
                           f"{pinned.num_microbatches} does not make the per-rank batch {local}")
            return []
        return [pinned.microbatch_size]
    if pinned.num_microbatches is not None:
        if local % pinned.num_microbatches:
            skipped.append(f"num_microbatches={pinned.num_microbatches} does not divide the "
                           f"per-rank batch {local}")
            return []
        return [local // pinned.num_microbatches]
    return sorted(divisors(local), reverse=True)


def _schedules(pp: int, count: int, blocks: int, pinned: Constraints,
               skipped: list[str]) -> Iterator[tuple[str, int]]:
    """(schedule, virtual stages) pairs torch can run for pp ranks and `count` microbatches
    over `blocks` layers; a pinned choice that cannot run says why in `skipped`."""
    if pp == 1:
        choices = [(pinned.schedule or "none", pinned.virtual_stages or 1)]
    else:
        names = [pinned.schedule] if pinned.schedule else list(VIRTUAL_STAGES)
        choices = [(name, v) for name in names
                   for v in ([pinned.virtual_stages] if pinned.virtual_stages
                             else VIRTUAL_STAGES.get(name, (1,)))]
    for name, v in choices:
        problem = _schedule_problem(name, pp, v, count, blocks, pinned)
        if problem is None:
            yield name, v
        elif pinned.schedule or pinned.virtual_stages or pinned.stage_boundaries is not None:
            skipped.append(problem)


def _schedule_problem(schedule: str, pp: int, v: int, count: int, blocks: int,
                      pinned: Constraints) -> str | None:
    """Why (schedule, v) cannot run here: torch's limits, too few layers for its stages, or
    a pinned stage split of another length (None: it can)."""
    problem = schedule_problem(schedule, pp, v, count)
    if problem is None and pp * v > blocks:
        problem = f"pp={pp} × virtual_stages={v} stages do not fit {blocks} layers"
    cuts = pinned.stage_boundaries
    if problem is None and cuts is not None and len(cuts) != pp * v - 1:
        problem = (f"Constraints.stage_boundaries names {len(cuts)} boundaries, but pp={pp} × "
                   f"virtual_stages={v} = {pp * v} stages need {pp * v - 1}")
    return problem


def _pinned_starts(profile: ModelProfile, pinned: Constraints) -> tuple[int, ...] | None:
    """First layer of every stage of `Constraints.stage_boundaries` (None: not pinned);
    PlanError when a name is not a layer of the model or not after the one before it."""
    if pinned.stage_boundaries is None:
        return None
    names = [layer.name for layer in profile.layers]
    starts = [0]
    for name in pinned.stage_boundaries:
        if name not in names:
            shown = ", ".join(names if len(names) <= 8 else [*names[:4], "…", *names[-3:]])
            raise PlanError(f"Constraints.stage_boundaries: {name!r} is not a layer of the "
                            f"model (its layers: {shown})")
        if name not in names[starts[-1] + 1:]:
            raise PlanError(f"Constraints.stage_boundaries must name layers in model order, "
                            f"each after the one before it (the first stage starts at "
                            f"{names[0]!r}); {name!r} is not after {names[starts[-1]]!r}")
        starts.append(names.index(name, starts[-1] + 1))
    return tuple(starts)


def _variants(base: Layout, pinned: Constraints, cluster) -> Iterator[Iterator[Layout]]:
    """`base` per ZeRO stage (and, for ZeRO 0, per dp all-reduce algorithm), each as its
    recompute levels none→selective→full.

    For a fixed ZeRO stage more recomputation only adds time, so a level is tried only
    when the ones before it do not fit. ZeRO stages are all priced: a sharded optimizer
    update can be faster, and a higher stage can fit without recomputation. ZeRO 1–3
    reduce-scatter their gradients ("flat"); a pinned non-flat algorithm keeps ZeRO 0.
    """
    recomputes = [pinned.recompute] if pinned.recompute else (
        ["none"] if base.mesh.spatial else ["none", "selective", "full"])
    zeros = [pinned.zero] if pinned.zero is not None else [0, 1, 2, 3]
    if base.mesh.dp == 1 and pinned.zero is None:
        zeros = [0]  # nothing to shard the state over
    if pinned.collective_algorithm not in (None, "flat"):
        zeros = [0]  # (Constraints refuses it with a pinned zero > 0)
    if base.mesh.ep > 1 and pinned.zero is None:
        zeros = [0, 1, 2]  # no ZeRO-3 of expert slices (passes/expert_parallel.py)
    for zero in zeros:
        for algorithm in _algorithms(base, pinned, cluster, zero):
            yield _levels(base, recomputes, zero, algorithm)


def _levels(base: Layout, recomputes: list[str], zero: int,
            algorithm: str) -> Iterator[Layout]:
    """`base` at each recompute level, built only when asked for: the search stops at
    the first level that fits, and most candidates fit without recomputation."""
    for recompute in recomputes:
        yield replace(base, recompute=recompute, zero=zero, collective_algorithm=algorithm)


def _algorithms(base: Layout, pinned: Constraints, cluster, zero: int) -> list[str]:
    """The dp all-reduce algorithms to price: the pinned one; else "flat", and with ZeRO
    0 the hierarchical ones where they differ from it (the cheapest then wins)."""
    if pinned.collective_algorithm is not None:
        return [pinned.collective_algorithm]
    if zero == 0 and base.mesh.dp > 1 and hierarchy_applies(cluster, dp_ranks(base)):
        return ["flat", "hierarchical", "segmented"]
    return ["flat"]


def _refuse_pinned_features(pinned: Constraints,
                            unsupported: Callable[[Plan], list[str]]) -> None:
    """NotExecutableError when a constraint itself pins what the runtime cannot run."""
    mesh = Mesh(pp=pinned.pp or 1, tp=pinned.tp or 1, sp=bool(pinned.sp))
    probe = Plan(model_hash="", cluster="", cluster_hash="", mesh=mesh,
                 placement=tuple(RankPlacement(r, 0, r) for r in range(mesh.world_size)),
                 global_batch=1, microbatch_size=1, num_microbatches=1,
                 schedule=pinned.schedule or "none", virtual_stages=pinned.virtual_stages or 1,
                 stage_boundaries=tuple(pinned.stage_boundaries or ()),
                 recompute=pinned.recompute or "none", zero=pinned.zero or 0,
                 collective_algorithm=pinned.collective_algorithm or "flat")
    reasons = unsupported(probe)
    if reasons:
        raise NotExecutableError("the constraints ask for features the runtime cannot "
                                 "execute yet: " + "; ".join(reasons))


# ---------------------------------------------------------------------- plans
class _Executability:
    """`unsupported(plan)` per feature combination, with one placement table per mesh."""

    def __init__(self, cluster, request: PlanRequest, unsupported: Callable[[Plan], list[str]]):
        self.cluster, self.request, self.unsupported = cluster, request, unsupported
        self._reasons: dict[tuple, list[str]] = {}
        self._placements: dict[Mesh, tuple[RankPlacement, ...]] = {}
        self.cluster_hash = hashlib.sha256(cluster.to_json().encode()).hexdigest()[:16]

    def placement(self, mesh: Mesh) -> tuple[RankPlacement, ...]:
        if mesh not in self._placements:
            self._placements[mesh] = tuple(RankPlacement(r, *self.cluster.rank_location(r))
                                           for r in range(mesh.world_size))
        return self._placements[mesh]

    def reasons(self, layout: Layout, profile: ModelProfile) -> list[str]:
        key = (layout.mesh, layout.schedule, layout.virtual_stages, layout.recompute,
               layout.zero, layout.num_microbatches > 1, layout.collective_algorithm)
        if key not in self._reasons:
            plan = _plan_for(layout, self.request, self.cluster, self.cluster_hash,
                             self.placement(layout.mesh), ())
            reasons = list(self.unsupported(plan))
            if self.request.has_batch_norm and layout.num_microbatches > 1:
                reasons.append("microbatching a model with BatchNorm changes its statistics")
            if self.request.has_batch_norm and layout.mesh.pp > 1:
                reasons.append("pipeline parallelism of a model with BatchNorm in training "
                               "mode (its running statistics are buffers the stages would "
                               "mutate)")
            if self.request.pp_blockers and layout.mesh.pp > 1:
                reasons.extend(self.request.pp_blockers)
            self._reasons[key] = reasons
        return self._reasons[key]


def _plan_for(layout: Layout, request: PlanRequest, cluster, cluster_hash: str,
              placement, boundaries: tuple[str, ...]) -> Plan:
    pinned = request.constraints
    return Plan(
        model_hash=request.model_hash, cluster=cluster.describe(), cluster_hash=cluster_hash,
        mesh=layout.mesh, placement=placement, global_batch=request.global_batch,
        microbatch_size=layout.microbatch_size, num_microbatches=layout.num_microbatches,
        dtype=request.dtype, optimizer=request.optimizer, schedule=layout.schedule,
        virtual_stages=layout.virtual_stages, stage_boundaries=boundaries,
        recompute=layout.recompute, zero=layout.zero,
        bucket_mb=layout.bucket_mb or DEFAULT_BUCKET_MB,
        collective_algorithm=layout.collective_algorithm, model_ref=request.model_ref,
        grad_reduce_dtype=pinned.grad_reduce_dtype,
        gather_min_mb=gather_min_mb(cluster, layout),
        calibration_hash=request.calibration_hash)


def _make_plan(best: Candidate, profile: ModelProfile, cluster, request: PlanRequest,
               placement, cluster_hash: str) -> Plan:
    # the pp × v − 1 first layers of stages 1.. (the pinned ones when pinned: priced so)
    boundaries = tuple(profile.layers[s].name for s in best.priced.stage_starts[1:])
    plan = _plan_for(best.layout, request, cluster, cluster_hash, placement, boundaries)
    chunked = tuple(ChunkedLayer(name, k) for name, k in best.priced.chunked)
    per_rank = memory_per_pp_rank(profile, cluster, best.layout, request.seq, request.dtype,
                                  request.graph_dtype_bytes, request.optimizer,
                                  best.priced.stage_starts)
    predicted = replace(best.priced.prediction, memory_per_pp_rank=per_rank)
    return replace(plan, collective_matmul=bool(chunked), collective_matmul_layers=chunked,
                   bucket_mb=best.priced.bucket_mb, predicted=predicted,
                   moe_chunks=best.priced.moe_chunks if best.layout.mesh.ep > 1 else 1,
                   experts_stacked=profile.experts_stacked,
                   executable=False,   # _choose marks it once the passes ran
                   not_executable_because=best.unsupported,
                   shardings=(_shardings(profile) if best.layout.mesh.tp > 1
                              and not best.layout.mesh.spatial else ()))


def _shardings(profile: ModelProfile) -> tuple[NodeSharding, ...]:
    """Every node and parameter the tp axis splits (all others are replicated)."""
    layout = profile.layout
    placed = {**layout.placements, **layout.param_placements}
    for name, role in layout.linear_roles.items():
        if role == "row":
            placed[name] = "partial"  # before its all-reduce
    return tuple(NodeSharding(node, p) for node, p in sorted(placed.items()) if p != "replicate")


def _alternatives(best: Candidate, candidates: list[Candidate]) -> tuple[Alternative, ...]:
    """The best candidate of every other mesh shape / schedule, with why it lost."""
    by_shape: dict[tuple, Candidate] = {}
    for c in sorted(candidates, key=lambda c: (not c.fits, _rank_key(c))):
        if c.rejected is not None:
            continue
        key = (c.layout.mesh, c.layout.schedule if c.layout.mesh.pp > 1 else "none")
        by_shape.setdefault(key, c)
    out = []
    base = best.step
    others = [c for c in by_shape.values() if c is not best]
    # the faster layouts that did not fit come first: they say why the plan is not faster
    faster = [c for c in candidates if not c.fits and c.step < base]
    # the candidates the passes rejected come first: why the plan is not the fastest
    refused = sorted((c for c in candidates if c.rejected is not None and c is not best),
                     key=_rank_key)
    # (a faster candidate that does not fit is often also the best of its shape: once)
    # a MoE model: the best fitting plan with the other choice of expert parallelism
    # (why the experts are split, or not: report/text.experts_text)
    split = best.layout.mesh.ep > 1
    contrast = [c for c in sorted(others, key=_rank_key)
                if c.fits and (c.layout.mesh.ep > 1) != split][:1]
    chosen: list[Candidate] = []
    for c in (refused[:4] + sorted(faster, key=_rank_key)[:2]
              + sorted(others, key=lambda c: (not c.fits, _rank_key(c)))):
        if len(chosen) < 8 - len(contrast) and all(c is not d for d in chosen):
            chosen.append(c)
    chosen += [c for c in contrast if all(c is not d for d in chosen)]
    for c in chosen:
        p = c.priced.prediction
        if not c.fits:
            reason = (f"does not fit: {_gib(p.memory_per_rank_bytes)} GiB > "
                      f"{_gib(usable_bytes(p.device_memory_bytes))} GiB usable per rank")
        else:
            delta = (c.step / base - 1) * 100 if base else 0.0
            reason = f"{delta:+.1f} % step time"
            if c.rejected is not None:
                reason += f"; rejected by the passes: {c.rejected}"
            elif not c.executable:
                reason += "; not executable yet: " + _short(c.unsupported)
            else:
                reason += "; " + NOT_TRIED
        # False: cannot run (a missing feature, a pass's rejection); None: not tried
        executable = False if (c.rejected is not None or not c.executable) else None
        out.append(Alternative(summary=c.summary(), step_time_s=c.step,
                               memory_per_rank_bytes=p.memory_per_rank_bytes, fits=c.fits,
                               executable=executable, reason=reason,
                               constraints=layout_constraints(c)))
    return tuple(out)


def layout_constraints(c: Candidate) -> Constraints:
    """Constraints that pin every choice of `c`'s layout (its priced bucket size too):
    searching under them prices this layout alone, so `ah.plan` makes this plan again."""
    lay, mesh = c.layout, c.layout.mesh
    return Constraints(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, sp=mesh.sp, spatial=mesh.spatial,
                       ep=mesh.ep, microbatch_size=lay.microbatch_size,
                       num_microbatches=lay.num_microbatches,
                       schedule=lay.schedule if mesh.pp > 1 else None,
                       virtual_stages=lay.virtual_stages, recompute=lay.recompute,
                       zero=lay.zero, bucket_mb=c.priced.bucket_mb,
                       collective_algorithm=lay.collective_algorithm,
                       collective_matmul=lay.collective_matmul,
                       moe_chunks=c.priced.moe_chunks if mesh.ep > 1 else None)


#: an alternative the runtime could run whose passes were not run (only the chosen plan
#: and the faster candidates before it are tried)
NOT_TRIED = "not tried by the passes"


def _short(reasons: tuple[str, ...]) -> str:
    """'tensor parallelism (tp=8); ZeRO stage 2' from the runtime's full sentences."""
    return "; ".join(dict.fromkeys(r.split(" is not executable")[0].split(" needs ")[0]
                                   for r in reasons))


def _gib(nbytes: float) -> str:
    """Bytes in GiB with three significant digits (small devices and models stay readable)."""
    return f"{nbytes / _GiB:.3g}"


def _no_fit_message(candidates: list[Candidate], cluster, skipped: list[str]) -> str:
    smallest = min(candidates, key=lambda c: c.priced.prediction.memory_per_rank_bytes)
    m = smallest.priced.prediction.memory
    usable = usable_bytes(cluster.device.memory_bytes)
    also = ""
    if skipped:
        also = " (also excluded: " + "; ".join(list(dict.fromkeys(skipped))[:3]) + ")"
    return (f"no plan fits in device memory on {cluster.describe()}: the smallest candidate "
            f"({smallest.summary()}) needs {_gib(m.total)} GiB per rank (parameters "
            f"{_gib(m.params)}, gradients {_gib(m.grads)}, optimizer state "
            f"{_gib(m.optimizer)}, activations {_gib(m.activations)} GiB) > {_gib(usable)} GiB "
            f"usable of {_gib(cluster.device.memory_bytes)} GiB per {cluster.device.name}"
            f"{also}. Use more devices, a smaller global batch or microbatch, or pin "
            "constraints (tp, pp, zero, recompute).")


class _Progress:
    """The search's progress: the installed bar (logs.progress: the CLI's rich bar), else
    a one-line report on stderr for searches longer than two seconds."""

    def __init__(self, start: float):
        self.start, self.shown = start, False
        self.bar = logs.progress(None, "searching plans") if logs.has_progress() else None
        if self.bar is not None:
            self.bar.__enter__()

    def tick(self, count: int) -> None:
        if self.bar is not None:
            self.bar.advance()
            return
        elapsed = time.perf_counter() - self.start
        if elapsed > 2.0 and count % 200 == 0 and sys.stderr.isatty():
            sys.stderr.write(f"\rautohybrid: searching plans… {count} priced, {elapsed:.1f} s")
            sys.stderr.flush()
            self.shown = True

    def done(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
        if self.shown:
            sys.stderr.write("\n")
