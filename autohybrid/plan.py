"""The Plan: every decision the search takes, as frozen data with a JSON form.

The Plan is the only thing that crosses from search to passes and runtime. It is
rank-independent, records the model (graph hash) and the cluster it was made for and the
rank placement of the mesh, and round-trips through JSON byte for byte. `Constraints`
pins any subset of the choices. This module imports nothing from the rest of autohybrid
but the errors.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import PlanError

FORMAT_VERSION = 1
#: Pipeline schedules (torch.distributed.pipelining): the ones with one stage per rank,
#: the looped ones (stage s on pp rank s mod pp, v ≥ 1 stages per rank) and the V-shaped
#: ones (two stages per rank: s and 2·pp−1−s). "zero-bubble" is torch's
#: ScheduleInterleavedZeroBubble (ZB-H1 per stage, v ≥ 1); "zbv" its ZB-V schedule.
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved", "looped-bfs", "zero-bubble", "zbv",
             "dualpipev")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
LOOPED_SCHEDULES = ("interleaved", "looped-bfs", "zero-bubble")
V_SCHEDULES = ("zbv", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
#: The dp gradient all-reduce (ZeRO 0; ZeRO 1–3 reduce-scatter, "flat"): one ring over the
#: dp group, "hierarchical" (intra-node reduce-scatter, concurrent inter-node all-reduces
#: per local rank, intra-node all-gather) or "segmented" (the same, pipelined over
#: segments): runtime/collectives.py, priced by cost/comm.py.
COLLECTIVE_ALGORITHMS = ("flat", "hierarchical", "segmented")
OPTIMIZERS = ("adam", "sgd", "none")
REDUCE_DTYPES = ("float32", "bfloat16", "float16", "float64")


#: The mesh axes in rank order: a rank's coordinates are (pp, dp, tp), tp fastest.
AXES = ("pp", "dp", "tp")


#: At most this many activation dims are tiled by spatial parallelism (H, or H × W).
MAX_SPATIAL_DIMS = 2


@dataclass(frozen=True)
class Mesh:
    """Degrees of the mesh axes ("pp", "dp", "tp"); sp runs on the tp axis.

    `spatial` (non-empty) makes the tp axis tile activations instead of splitting
    weights: (n,) tiles dim 2 (H of N,C,H,W; D of N,C,D,H,W) into n tiles, (a, b) tiles
    dims 2 and 3 into a × b (tp rank = i·b + j holds tile (i, j)); its product is tp
    (passes/spatial_parallel.py)."""

    pp: int = 1
    dp: int = 1
    tp: int = 1
    sp: bool = False
    spatial: tuple[int, ...] = ()
    #: expert parallelism: a MoE layer's experts split over groups of `ep` consecutive dp
    #: ranks (ep divides dp), each holding its tokens (`expert_groups`)
    ep: int = 1

    def __post_init__(self) -> None:
        for axis in ("pp", "dp", "tp", "ep"):
            value = getattr(self, axis)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"mesh.{axis} must be a positive integer, got {value!r}")
        check_spatial("mesh.spatial", self.spatial, self.tp, self.sp)
        if self.dp % self.ep:
            raise PlanError(f"mesh.ep={self.ep} must divide mesh.dp={self.dp}: expert "
                            "parallelism splits the experts over groups of dp ranks")
        if self.ep > 1 and self.spatial:
            raise PlanError("mesh.ep > 1 splits a MoE model's experts; mesh.spatial tiles a "
                            "CNN's activations: a plan has one or the other")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp, dp, tp) coordinates of `rank` in row-major ("pp", "dp", "tp") order."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def describe(self) -> str:
        if self.spatial:
            tiles = "×".join(map(str, self.spatial))
            return f"pp{self.pp}×dp{self.dp}×spatial{tiles}"
        sp = "+sp" if self.sp else ""
        ep = f"(ep{self.ep})" if self.ep > 1 else ""
        return f"pp{self.pp}×dp{self.dp}{ep}×tp{self.tp}{sp}"


def spatial_tile_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axis of each tiled dim: "tp" for one; "tile_h" and "tile_w" (the rows and
    the columns of the a × b tiles of the tp axis) for two."""
    return ("tp",) if len(mesh.spatial) == 1 else ("tile_h", "tile_w")


def spatial_stats_axis(mesh: Mesh) -> str:
    """The axis BatchNorm on tiles reduces its statistics over: the tiles ("tp"), or the
    tiles of every dp rank ("dp_tp") — the whole batch, the whole image."""
    return "tp" if mesh.dp == 1 else "dp_tp"


def spatial_groups(mesh: Mesh) -> dict[str, list[list[int]]]:
    """The extra axes spatial parallelism uses (`spatial_tile_axes` beyond "tp", and
    `spatial_stats_axis`): per axis, its groups as lists of mesh ranks, each group in
    the axis's rank order (tile (i, j) is tp rank i·b + j)."""
    if not mesh.spatial:
        return {}
    out: dict[str, list[list[int]]] = {}
    base = [(p * mesh.dp + d) * mesh.tp for p in range(mesh.pp) for d in range(mesh.dp)]
    if len(mesh.spatial) == 2:
        a, b = mesh.spatial
        out["tile_h"] = [[r + i * b + j for i in range(a)] for r in base for j in range(b)]
        out["tile_w"] = [[r + i * b + j for j in range(b)] for r in base for i in range(a)]
    if mesh.dp > 1:
        out["dp_tp"] = [[(p * mesh.dp + d) * mesh.tp + t for d in range(mesh.dp)
                         for t in range(mesh.tp)] for p in range(mesh.pp)]
    return out


def expert_groups(mesh: Mesh) -> dict[str, list[list[int]]]:
    """The axes expert parallelism uses, as lists of mesh ranks: "ep", the ranks that split
    the experts between them (dp coordinates d with the same d // ep, the same pp and tp
    coordinates; ep rank d mod ep holds experts [r·E/ep, (r+1)·E/ep)), and "edp", the
    ranks holding the same experts, over which their gradients are summed (the same
    d mod ep). Empty when mesh.ep is 1."""
    if mesh.ep == 1:
        return {}
    def rank(p: int, d: int, t: int) -> int:
        return (p * mesh.dp + d) * mesh.tp + t
    blocks = mesh.dp // mesh.ep
    cells = [(p, t) for p in range(mesh.pp) for t in range(mesh.tp)]
    return {"ep": [[rank(p, b * mesh.ep + e, t) for e in range(mesh.ep)]
                   for p, t in cells for b in range(blocks)],
            "edp": [[rank(p, b * mesh.ep + e, t) for b in range(blocks)]
                    for p, t in cells for e in range(mesh.ep)]}


def check_spatial(where: str, spatial: Any, tp: int | None, sp: bool | None) -> None:
    """Refuse a spatial tiling that is not 1 or 2 tile counts ≥ 2 whose product is tp,
    or one combined with sequence parallelism (both would use the tp axis)."""
    if spatial is None or spatial == ():
        return
    if (not isinstance(spatial, tuple) or not 1 <= len(spatial) <= MAX_SPATIAL_DIMS
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 2
                       for n in spatial)):
        raise PlanError(f"{where} must be a tuple of 1 or {MAX_SPATIAL_DIMS} tile counts, "
                        f"each an integer >= 2 (tiles of H, or of H and W), got {spatial!r}")
    if tp is not None and math.prod(spatial) != tp:
        raise PlanError(f"{where}={spatial!r} tiles activations over {math.prod(spatial)} "
                        f"ranks of the tp axis, but tp is {tp}: give tp = "
                        f"{' × '.join(map(str, spatial))} (or leave tp unpinned)")
    if sp:
        raise PlanError(f"{where}={spatial!r} uses the tp axis for tiles of the image; "
                        "sequence parallelism (sp=True) uses it for slices of a sequence: "
                        "choose one")


@dataclass(frozen=True)
class RankPlacement:
    """Where mesh rank `rank` runs: machine `node`, device `device` on it."""

    rank: int
    node: int
    device: int


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes per rank (the most loaded rank)."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class Prediction:
    step_time_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    bubble_fraction: float = 0.0
    mfu: float = 0.0
    memory_per_rank_bytes: int = 0
    device_memory_bytes: int = 0
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    #: bytes on each pp coordinate (its dp and tp ranks hold the same); `memory` is the
    #: most loaded of them
    memory_per_pp_rank: tuple[MemoryBreakdown, ...] = ()

    def memory_of_rank(self, plan: "Plan", rank: int) -> MemoryBreakdown:
        """Predicted bytes on mesh rank `rank` of `plan`."""
        if not self.memory_per_pp_rank:
            return self.memory
        return self.memory_per_pp_rank[plan.mesh.coords(rank)[0]]


@dataclass(frozen=True)
class ChunkedLayer:
    """A layer (search/layers.py name) whose sequence-parallel linears run as collective
    matmuls in `chunks` pipelined pieces (ops/collective_matmul.py)."""

    layer: str
    chunks: int


@dataclass(frozen=True)
class NodeSharding:
    """Placement of one graph node's output on the tp axis (DTensor vocabulary)."""

    node: str
    placement: str  # "replicate" | "shard(d)" | "partial"


@dataclass(frozen=True)
class Alternative:
    """A runner-up plan: its shape, its prediction, and why it lost to the chosen one.

    `executable` is False when it cannot run (a feature the runtime lacks, or its passes
    rejected it: the reason says which) and None when its passes were not run ("not
    tried"); only the chosen plan is known to run (`Plan.executable`)."""

    summary: str
    step_time_s: float
    memory_per_rank_bytes: int
    fits: bool
    executable: bool | None
    reason: str
    #: the choices that make this plan again: `ah.plan(..., constraints=alt.constraints)`
    #: prices this layout alone (the stage split, found again, is the same)
    constraints: "Constraints | None" = None


@dataclass(frozen=True)
class Plan:
    model_hash: str
    cluster: str
    cluster_hash: str
    mesh: Mesh
    placement: tuple[RankPlacement, ...]
    global_batch: int
    microbatch_size: int
    num_microbatches: int
    dtype: str = "float32"
    optimizer: str = "adam"
    schedule: str = "none"
    virtual_stages: int = 1
    stage_boundaries: tuple[str, ...] = ()
    recompute: str = "none"
    zero: int = 0
    bucket_mb: float = 25.0
    collective_algorithm: str = "flat"
    collective_matmul: bool = False
    #: the layers whose all-gather → linear and linear → reduce-scatter run chunked, and in
    #: how many chunks (chosen per layer by the cost model; every such layer when
    #: `Constraints(collective_matmul=True)`); empty unless `collective_matmul`
    collective_matmul_layers: tuple[ChunkedLayer, ...] = ()
    #: dtype the dp gradient reduction runs in (None: the gradients' own, i.e. the fp32
    #: master weights' under mixed precision; "bfloat16" halves the bytes sent)
    grad_reduce_dtype: str | None = None
    #: expert parallelism: each MoE layer's tokens in this many chunks, one chunk's
    #: all-to-all overlapping the expert compute of the one before (ops/moe.py)
    moe_chunks: int = 1
    #: the MoE layers' experts are separate parameters every rank holds (a hand-written
    #: loop folded at capture: capture_moe_loop.py): ep splits their compute, not their
    #: weights, and tp leaves them whole
    experts_stacked: bool = False
    #: ZeRO-3: a layer whose parameters are smaller than this shares its neighbour's
    #: gather (passes/zero.py); the planner sets the dp link's latency × bandwidth, below
    #: which a collective costs its latency whatever its size
    gather_min_mb: float = 0.0
    shardings: tuple[NodeSharding, ...] = ()
    calibration_hash: str | None = None
    model_ref: str | None = None
    #: hash of the model's parameter names and shapes (`params_hash(model)`): compared
    #: with a model before it is captured or any process starts (None: not recorded)
    params_hash: str | None = None
    #: the passes ran on the graph this plan names (one rank, fake process groups) and
    #: accepted it, and the runtime has every feature it uses; else why not
    executable: bool = True
    not_executable_because: tuple[str, ...] = ()
    predicted: Prediction = field(default_factory=Prediction)
    alternatives: tuple[Alternative, ...] = ()
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        _validate(self)

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def local_batch(self) -> int:
        """Samples per data-parallel rank per step."""
        return self.microbatch_size * self.num_microbatches

    @property
    def num_stages(self) -> int:
        """Pipeline stages of the model: pp × virtual stages."""
        return self.mesh.pp * self.virtual_stages

    def stage_ranks(self) -> tuple[int, ...]:
        """The pp coordinate that runs each pipeline stage."""
        return stage_ranks(self.schedule, self.mesh.pp, self.virtual_stages)

    def hash(self) -> str:
        """Hash of the plan's decisions (not of its predictions or alternatives)."""
        decisions = dataclasses.replace(self, predicted=Prediction(), alternatives=())
        return hashlib.sha256(decisions.to_json().encode()).hexdigest()[:16]

    def summary(self) -> str:
        p = self.predicted
        return (f"{self.mesh.describe()} microbatch {self.microbatch_size}×{self.num_microbatches}"
                f" zero{self.zero} recompute={self.recompute} | step {p.step_time_s * 1e3:.1f} ms,"
                f" {p.memory_per_rank_bytes / 2**30:.2f} GiB/rank")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return _to_jsonable(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        version = data.get("version")
        if version != FORMAT_VERSION:
            raise PlanError(f"plan format version {version!r} is not supported (this autohybrid "
                            f"reads version {FORMAT_VERSION}); make the plan again with ah.plan")
        return _from_jsonable(cls, data, "plan")

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> "Plan":
        text = str(path_or_text)
        if not text.lstrip().startswith("{"):
            try:
                text = Path(path_or_text).read_text()
            except OSError as exc:
                raise PlanError(f"cannot read plan file {path_or_text!r}: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan file is not valid JSON: {exc}") from exc
        return cls.from_dict(data)


@dataclass(frozen=True)
class Constraints:
    """Pins any subset of the plan's choices; None leaves a choice to the search."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    sp: bool | None = None
    microbatch_size: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    zero: int | None = None
    stage_boundaries: tuple[str, ...] | None = None
    bucket_mb: float | None = None
    collective_algorithm: str | None = None
    collective_matmul: bool | None = None
    grad_reduce_dtype: str | None = None
    #: tile counts of spatial parallelism on the tp axis (Mesh.spatial); () pins none
    spatial: tuple[int, ...] | None = None
    #: expert parallelism degree (Mesh.ep; 1 pins none)
    ep: int | None = None
    #: chunks of each MoE layer's tokens under ep (Plan.moe_chunks)
    moe_chunks: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.spatial, list):
            object.__setattr__(self, "spatial", tuple(self.spatial))
        check_spatial("Constraints.spatial", self.spatial, self.tp, self.sp)
        for name in ("dp", "tp", "pp", "microbatch_size", "num_microbatches", "virtual_stages",
                     "ep", "moe_chunks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise PlanError(f"Constraints.{name} must be a positive integer, got {value!r}")
        _check_choice("Constraints.schedule", self.schedule, SCHEDULES, optional=True)
        _check_choice("Constraints.recompute", self.recompute, RECOMPUTE, optional=True)
        _check_choice("Constraints.collective_algorithm", self.collective_algorithm,
                      COLLECTIVE_ALGORITHMS, optional=True)
        _check_choice("Constraints.grad_reduce_dtype", self.grad_reduce_dtype, REDUCE_DTYPES,
                      optional=True)
        if self.zero is not None and (isinstance(self.zero, bool)
                                      or self.zero not in (0, 1, 2, 3)):
            raise PlanError(f"Constraints.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        _check_zero_algorithm("Constraints", self.zero or 0, self.collective_algorithm)
        if self.bucket_mb is not None and (isinstance(self.bucket_mb, bool)
                                           or not isinstance(self.bucket_mb, (int, float))
                                           or not self.bucket_mb > 0):
            raise PlanError(f"Constraints.bucket_mb must be a number > 0, got {self.bucket_mb!r}")
        for name in ("sp", "collective_matmul"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise PlanError(f"Constraints.{name} must be True or False, got {value!r}")
        if self.collective_matmul and (self.sp is False or self.tp == 1):
            raise PlanError("Constraints.collective_matmul=True chunks the collectives of "
                            "sequence parallelism: it needs tp > 1 and sp (got tp="
                            f"{self.tp!r}, sp={self.sp!r})")
        if self.stage_boundaries is not None and (
                not isinstance(self.stage_boundaries, (tuple, list))
                or not all(isinstance(b, str) for b in self.stage_boundaries)):
            raise PlanError(f"Constraints.stage_boundaries must be a tuple of node names, got "
                            f"{self.stage_boundaries!r}")

    def pinned(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}


def stage_ranks(schedule: str, pp: int, virtual_stages: int) -> tuple[int, ...]:
    """The pp coordinate of each of the pp × v stages: looped (s mod pp) or V-shaped."""
    stages = pp * virtual_stages
    if schedule in V_SCHEDULES:
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(stages))
    return tuple(s % pp for s in range(stages))


def schedule_problem(schedule: str, pp: int, virtual_stages: int,
                     num_microbatches: int) -> str | None:
    """Why torch's `schedule` cannot run pp ranks × v stages × m microbatches (None: it can)."""
    v, m = virtual_stages, num_microbatches
    if pp == 1:
        if schedule != "none" or v != 1:
            return f"schedule {schedule!r} with {v} virtual stages needs pp > 1"
        return None
    if schedule == "none":
        return f"pp={pp} needs a pipeline schedule"
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        return f"schedule {schedule!r} runs one stage per rank, not virtual_stages={v}"
    if schedule == "interleaved" and v < 2:
        return "schedule 'interleaved' needs virtual_stages ≥ 2 (use '1f1b' for one)"
    if schedule in V_SCHEDULES and v != 2:
        return f"schedule {schedule!r} runs exactly two (V-shaped) stages per rank, not {v}"
    if schedule == "1f1b" and m < pp:
        return f"schedule '1f1b' needs at least pp={pp} microbatches, got {m}"
    if schedule in ("interleaved", "zero-bubble") and m >= pp and m % (m // pp):
        return (f"schedule {schedule!r} needs the {m} microbatches to split into rounds of "
                f"pp={pp} (use a multiple of {pp})")
    if schedule == "zbv" and m < 2 * pp:
        return f"schedule 'zbv' needs at least 2 × pp = {2 * pp} microbatches, got {m}"
    if schedule == "dualpipev" and m < 2 * pp:
        return f"schedule 'dualpipev' needs at least 2 × pp = {2 * pp} microbatches, got {m}"
    return None


# ---------------------------------------------------------------------- validation
def _check_choice(name: str, value: Any, allowed: tuple, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value not in allowed:
        raise PlanError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {value!r}")


def _check_zero_algorithm(where: str, zero: int, algorithm: str | None) -> None:
    """ZeRO 1–3 reduce-scatter the gradients: only ZeRO 0 all-reduces them hierarchically."""
    if zero and algorithm not in (None, "flat"):
        raise PlanError(
            f"{where}.collective_algorithm={algorithm!r} with {where}.zero={zero}: ZeRO 1–3 "
            f"reduce-scatter the gradients with the flat algorithm; the hierarchical "
            f"all-reduces run with zero=0. Use zero=0 with collective_algorithm={algorithm!r},"
            f" or zero={zero} with collective_algorithm='flat'")


def _validate(plan: Plan) -> None:
    _check_choice("plan.schedule", plan.schedule, SCHEDULES)
    _check_choice("plan.recompute", plan.recompute, RECOMPUTE)
    _check_choice("plan.collective_algorithm", plan.collective_algorithm, COLLECTIVE_ALGORITHMS)
    _check_choice("plan.optimizer", plan.optimizer, OPTIMIZERS)
    _check_choice("plan.grad_reduce_dtype", plan.grad_reduce_dtype, REDUCE_DTYPES, optional=True)
    if plan.zero not in (0, 1, 2, 3):
        raise PlanError(f"plan.zero must be 0..3, got {plan.zero!r}")
    _check_zero_algorithm("plan", plan.zero, plan.collective_algorithm)
    _check_collective_matmul(plan)
    _check_sizes(plan)
    _check_shardings(plan)
    _check_spatial_plan(plan)
    for name in ("global_batch", "microbatch_size", "num_microbatches", "virtual_stages",
                 "moe_chunks"):
        value = getattr(plan, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"plan.{name} must be a positive integer, got {value!r}")
    if plan.mesh.dp * plan.local_batch != plan.global_batch:
        raise PlanError(
            f"plan.global_batch {plan.global_batch} != dp {plan.mesh.dp} × microbatch_size "
            f"{plan.microbatch_size} × num_microbatches {plan.num_microbatches}")
    _check_placement(plan)


#: placements found valid, by identity (the value keeps the tuple alive, so its id is not
#: reused): the planner builds thousands of plans that share a few placement tuples
_VALID_PLACEMENTS: dict[tuple[int, int], tuple] = {}


def _check_placement(plan: Plan) -> None:
    placement, world = plan.placement, plan.mesh.world_size
    if _VALID_PLACEMENTS.get((id(placement), world)) is placement:
        return
    ranks = sorted(p.rank for p in placement)
    if ranks != list(range(world)):
        raise PlanError(
            f"plan.placement must list ranks 0..{world - 1} once each (the mesh "
            f"{plan.mesh.describe()} has {world} ranks); it lists {len(ranks)} ranks")
    devices = {(p.node, p.device) for p in placement}
    if len(devices) != len(placement):
        raise PlanError("plan.placement puts two ranks on the same (node, device)")
    if isinstance(placement, tuple):
        if len(_VALID_PLACEMENTS) >= 64:
            _VALID_PLACEMENTS.clear()
        _VALID_PLACEMENTS[(id(placement), world)] = placement


def _check_sizes(plan: Plan) -> None:
    """bucket_mb > 0 and gather_min_mb ≥ 0, finite: a negative bucket size would make
    every gradient its own bucket, a negative threshold no layer share a gather."""
    for name, low, strict in (("bucket_mb", 0.0, True), ("gather_min_mb", 0.0, False)):
        value = getattr(plan, name)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and (value > low if strict else value >= low))
        if not ok:
            bound = "> 0" if strict else "≥ 0"
            raise PlanError(f"plan.{name} must be a finite number {bound}, got {value!r}: "
                            "the file was edited; make the plan again (ah.plan or "
                            "`autohybrid plan --out`), or pin it with Constraints(bucket_mb=...)")


_PLACEMENT = re.compile(r"replicate|partial|shard\((0|[1-9][0-9]*)\)")


def _check_shardings(plan: Plan) -> None:
    """Each NodeSharding well formed, once per node, and only on a tp axis (the graph's
    names are checked against the model in planning.check_plan_fits_model)."""
    if plan.shardings and plan.mesh.tp == 1:
        raise PlanError(f"plan.shardings lists {len(plan.shardings)} tp placements but the "
                        f"mesh {plan.mesh.describe()} has no tp axis: the file was edited; "
                        "make the plan again (or pin tp with Constraints(tp=...))")
    seen: set[str] = set()
    for s in plan.shardings:
        if not isinstance(s.placement, str) or not _PLACEMENT.fullmatch(s.placement):
            raise PlanError(f"plan.shardings: node {s.node!r} has placement {s.placement!r}; "
                            "a placement is 'replicate', 'partial' or 'shard(d)'")
        if s.node in seen:
            raise PlanError(f"plan.shardings lists node {s.node!r} twice")
        seen.add(s.node)


def _check_spatial_plan(plan: Plan) -> None:
    """Spatial parallelism runs with dp and ZeRO; the combinations its equivalence tests do
    not prove (tests/test_spatial_parallel.py) are refused, each with its reason."""
    if not plan.mesh.spatial:
        return
    if plan.shardings:
        raise PlanError(f"plan.shardings lists {len(plan.shardings)} tp placements but the "
                        f"mesh {plan.mesh.describe()} uses the tp axis for spatial tiles, not "
                        "for split weights: the file was edited; make the plan again")
    if plan.mesh.pp > 1:
        raise PlanError(f"the mesh {plan.mesh.describe()} combines spatial tiles with a "
                        "pipeline; stages would send tiles, which autohybrid does not do: "
                        "pin pp=1 with spatial")
    if plan.recompute != "none":
        raise PlanError(f"recompute={plan.recompute!r} with spatial tiles would rerun the "
                        "halo exchanges inside checkpointed blocks, which no test proves "
                        "yet: use recompute='none' with spatial")


def _check_collective_matmul(plan: Plan) -> None:
    chunked = plan.collective_matmul_layers
    if plan.collective_matmul and not (plan.mesh.sp and plan.mesh.tp > 1):
        raise PlanError("plan.collective_matmul chunks the all-gathers and reduce-scatters "
                        "of sequence parallelism: it needs tp > 1 and sp=True (the mesh is "
                        f"{plan.mesh.describe()})")
    if chunked and not plan.collective_matmul:
        raise PlanError("plan.collective_matmul_layers lists layers but "
                        "plan.collective_matmul is False")
    for entry in chunked:
        if not isinstance(entry.chunks, int) or isinstance(entry.chunks, bool) \
                or entry.chunks < 2:
            raise PlanError(f"plan.collective_matmul_layers: layer {entry.layer!r} has "
                            f"{entry.chunks!r} chunks; a collective matmul needs at least 2")


# ---------------------------------------------------------------------- JSON helpers
#: fields added since FORMAT_VERSION 1 was first written: a plan file without them reads
#: as their default
_ADDED_FIELDS = {"Plan": ("params_hash", "moe_chunks", "experts_stacked"),
                 "Mesh": ("spatial", "ep"), "Alternative": ("constraints",),
                 "Constraints": ("ep", "moe_chunks")}
#: fields written only when not at their default, so that plans without them keep their
#: JSON (and hash) byte for byte
_WRITTEN_IF_SET = {"Mesh": ("ep",), "Constraints": ("ep", "moe_chunks"),
                   "Plan": ("moe_chunks", "experts_stacked")}


def _to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        optional = _WRITTEN_IF_SET.get(type(obj).__name__, ())
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in fields(obj)
                if f.name not in optional or getattr(obj, f.name) != f.default}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(o) for o in obj]
    return obj


def _from_jsonable(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise PlanError(f"{path} must be an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise PlanError(f"unknown field {path}.{unknown[0]} (known: {', '.join(sorted(known))})")
    kwargs = {}
    for f in fields(cls):
        if f.name not in data and f.name in _ADDED_FIELDS.get(cls.__name__, ()):
            continue  # a plan written before the field existed: its default
        if f.name not in data:  # to_json writes every field: a missing one is an edit gone wrong
            raise PlanError(f"missing field {path}.{f.name}")
        kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{path}.{f.name}")
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        return _convert(inner[0], value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise PlanError(f"{path} must be a list, got {type(value).__name__}")
        item = typing.get_args(tp)[0]
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return _from_jsonable(tp, value, path)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise PlanError(f"{path} must be {tp.__name__}, got {value!r}")
    return value
