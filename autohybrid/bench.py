"""`ah.bench`: autohybrid's compiled run against eager PyTorch and against the hand-written
PyTorch baseline of the same layout, on the same model, seed and global batches.

Why this exists: a step time alone says nothing. Beside it a user needs what one process
of plain PyTorch does (eager), what a careful user gets from PyTorch's own parallel APIs
on the same mesh (autohybrid/baselines.py: DDP, ZeroRedundancyOptimizer, FSDP2, DTensor,
pipelining), what the planner predicted, and proof that all of them trained the same
function (their losses beside eager's).

How it measures, on every rank of one `ah.launch` (a fresh model per variant, built from
the same seed, the same batches):

- order: eager first (rank 0); then the compiled run alone — `warmup` + `steps` timed
  steps, its profiled steps, its memory; then the baseline, whose timed steps alternate
  with steps of the compiled run (still alive), a barrier before each: compiled step,
  baseline step, next batch, baseline step, compiled step, next batch, ... (the order
  alternates, so what one step leaves the next falls on both alike). The compiled run's
  figures are those paired steps
  (`paired_times`), and `paired_ratio` is the median over steps of compiled ÷ baseline,
  two adjacent steps each: on a machine shared with other jobs (or two ranks sharing two
  cores) load falls on both alike, which two runs one after another cannot promise.
- step time: a barrier before each step; a step's time is the slowest rank's (the parent
  takes the maximum over ranks per step), after `float(loss)` (which waits for CUDA
  kernels). Eager runs on rank 0 alone, the others wait on a long-timeout gloo group.
- precision: `dtype` (e.g. "bf16") is what `ah.compile(dtype=...)` takes; narrower than the
  model's float32 parameters it is mixed precision (autocast, fp32 master weights), and
  eager runs its forward and loss under the same `torch.autocast` (fp16 with a
  `torch.amp.GradScaler`, as the compiled run scales its loss) and the baseline its whole
  `train_step` (forward and backward are one call there; no loss scaling), so that the
  comparison is between equals. The result records it (`dtype`, `autocast`).
- exposed communication: more steps under `torch.profiler` (one; `breakdown=True`: 5, their
  median) (CPU activity; CUDA too on
  a CUDA device, where the timeline reads kernels and NCCL kernels), turned into
  a timeline by runtime/profile.py's `timeline_from_events` — the machinery behind
  `compiled.profile` — for every variant alike: communication time not covered by the
  main thread's compute. One correction: DTensor's functional collectives wait inside an
  op (`_c10d_functional::wait_tensor`), which the timeline would count as compute; those
  waits are taken out of compute here. The figure is the largest over the ranks, beside
  the profiled step's own duration (`profiled_step_s`: the profiler slows a step). On
  CUDA it is NCCL kernel time not overlapped by compute kernels on other streams.
- breakdown (report/breakdown.py): the same profiled steps by part — compute per phase and
  by op kind (matmul, attention, copies, other ops, framework: the runtime's Python,
  hooks and autograd's engine between ops), optimizer, each collective kind exposed and
  hidden — the median step of the slowest rank; `format_breakdown()` prints it beside
  the cost model's parts.
- peak memory per rank: on CUDA `torch.cuda.max_memory_allocated` over one step, reset
  before it, less what the compiled run (alive beside the baseline) holds. On
  CPU there is no allocator high-water mark, and RSS includes the Python heap, libraries
  and freed-but-cached pages; we measure instead ``held + transient``: `held` = bytes of
  the distinct tensor storages reachable from the variant's objects at the start of one
  more step (parameters, their gradients, optimizer state, shards, buffers, whatever the
  variant keeps; DTensor counted by its local shard; storages held only inside C++
  objects, such as DDP's gradient buckets, are not reachable and not counted), and
  `transient` = the highest running sum of torch.profiler's `[memory]` allocation events
  (frees negative) during that step: the step's activations and temporaries. The JSON
  names it `cpu_live_tensor_bytes` so nobody mistakes it for RSS.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import statistics
import time
import types
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from . import baselines as torch_baselines
from . import logs
from .cluster import Cluster
from .errors import AutohybridError, ClusterError, ModelError
from .plan import Constraints, Plan

OPTIMIZERS = {"sgd": (torch.optim.SGD, 0.01), "adamw": (torch.optim.AdamW, 1e-3)}
CUDA_MEASURE = "cuda_max_memory_allocated"
CPU_MEASURE = "cpu_live_tensor_bytes"
#: the step ranges runtime/profile.py's timeline expects
_FUNCTIONAL_WAIT = "_c10d_functional::wait_tensor"
#: how long ranks that do not run eager wait for rank 0 (big models on CPU are slow)
_EAGER_WAIT = timedelta(hours=4)
_NO_TIMELINE = "not measured: a rank's profiled step gave no timeline"
#: profiled steps per variant under breakdown=True (their median is reported)
BREAKDOWN_STEPS = 5
#: the reachable-object walk stops after this many objects (a lower bound beyond)
_WALK_LIMIT = 2_000_000


class BenchError(AutohybridError, ValueError):
    """`ah.bench` was given an argument it cannot use (the message names it)."""


# ---------------------------------------------------------------------- the result
@dataclass
class Run:
    """One variant's measurements (seconds, bytes); numbers are None when unavailable."""

    name: str
    kind: str  # "eager" | "compiled" | "baseline"
    available: bool = True
    reason: str = ""
    step_times_s: list[float] = field(default_factory=list)
    median_s: float | None = None
    min_s: float | None = None
    max_s: float | None = None
    iqr_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: list[int] = field(default_factory=list)
    memory_measure: str = ""
    exposed_comm_s: float | None = None
    exposed_comm_per_rank_s: list[float] = field(default_factory=list)
    exposed_comm_note: str = ""  # why exposed_comm_s is null
    #: the profiled step's duration (slowest rank), which exposed_comm_s is part of
    profiled_step_s: float | None = None
    #: compiled run only: the median over steps of its time ÷ the baseline's, the two
    #: steps adjacent (None without a baseline)
    paired_ratio: float | None = None
    #: the median of the profiled steps' breakdowns, the slowest rank's
    #: (report/breakdown.py StepBreakdown.to_dict(); None where not measured)
    breakdown: dict[str, Any] | None = None
    losses: list[float] = field(default_factory=list)
    loss_vs_eager: dict[str, Any] | None = None


@dataclass
class BenchResult:
    """What `ah.bench` measured; `to_dict()` is the JSON other tools plot and render."""

    model: str
    cluster: str
    world_size: int
    global_batch: int
    steps: int
    warmup: int
    optimizer: str
    lr: float
    plan: dict[str, str]
    predicted: dict[str, Any]
    runs: list[Run]
    loss_check: dict[str, Any]
    prediction_check: dict[str, Any]
    #: the run's dtype ("float32", "bfloat16", …) and the autocast dtype (None: none)
    dtype: str = "float32"
    autocast: str | None = None
    #: the whole Plan the compiled run used (Plan.to_dict(); `Plan.from_dict` reads it)
    full_plan: dict[str, Any] = field(default_factory=dict)
    #: the compiled run's profiled step on every rank (report/timeline.py's
    #: Timeline.to_dict(); on CUDA its intervals are kernels and NCCL kernels)
    measured_timeline: dict[str, Any] | None = None

    def run(self, name: str) -> Run:
        for r in self.runs:
            if r.name == name:
                return r
        raise KeyError(f"no run named {name!r}; runs: {[r.name for r in self.runs]}")

    @property
    def baseline(self) -> Run:
        return next(r for r in self.runs if r.kind == "baseline")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        """The result as JSON text; also written to `path` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def format_table(self) -> str:
        """A plain-text table: one row per variant (n/a rows give their reason)."""
        return format_table(self)

    def format_breakdown(self) -> str:
        """Where each variant's step goes (report/breakdown.py), the slowest rank's median
        profiled step, beside the cost model's parts of the compiled plan's step."""
        from .report.breakdown import StepBreakdown, format_breakdown, predicted_parts

        rows = [(r.name, StepBreakdown.from_dict(r.breakdown) if r.breakdown else None)
                for r in self.runs if r.available]
        parts = (predicted_parts(Plan.from_dict(self.full_plan).predicted)
                 if self.full_plan else None)
        return format_breakdown(rows, parts)


# ---------------------------------------------------------------------- the entry point
def bench(model: str | Callable[[], tuple], cluster: Cluster, *,
          global_batch: int | None = None, steps: int = 5, warmup: int = 2,
          plan: Plan | None = None, constraints: Constraints | None = None,
          optimizer: str = "sgd", lr: float | None = None, baselines: bool = True,
          json_path: str | Path | None = None, plot_path: str | Path | None = None,
          seed: int = 0, loss_tolerance: float = 1e-5,
          timeout_s: float | None = None, start_method: str | None = None,
          dtype: torch.dtype | str | None = None, breakdown: bool = False,
          calibration: Any = None) -> BenchResult:
    """Train `model` eagerly in one process, compiled by autohybrid, and (`baselines`)
    with the hand-written PyTorch baseline of the plan's layout, on `cluster` (local
    processes); return their step times, throughput, memory, exposed communication and
    losses side by side.

    `model`: a MODEL string (zoo preset or `path/file.py:factory`, see models/spec.py),
    or a zero-argument factory returning `(model, inputs, targets, loss_fn)` (called once
    per variant after `torch.manual_seed(seed)`, so each starts from the same weights).
    `global_batch` defaults to the example batch's size. `plan` reuses a Plan;
    `constraints` pins planning choices (not both). `optimizer` "sgd" (lr 0.01) or
    "adamw" (lr 1e-3). `loss_tolerance`: the largest relative loss difference from eager
    still called equal (loosen it for bf16). `dtype`: as `ah.compile(dtype=...)`; eager and
    the baseline train under the same autocast. Writes the JSON to `json_path` and a plot
    to `plot_path`. `start_method`: how `ah.launch` starts the ranks (None: spawn on CUDA,
    fork on CPU; under spawn a factory `model` must be a top-level function).
    `calibration`: a profile from `ah.calibrate` (or its JSON path): the plan is searched,
    and predicted, with the figures it measured (`Profile.apply`) instead of the
    cluster's placeholders.
    """
    _check_cluster(cluster)
    if calibration is not None:
        from .api import load_calibration

        cluster = load_calibration(calibration).apply(cluster)
    job = _Job(source=_source(model, global_batch), global_batch=global_batch,
               steps=_count("steps", steps, 1), warmup=_count("warmup", warmup, 0),
               plan=_typed("plan", plan, Plan), constraints=_typed("constraints", constraints,
                                                                  Constraints),
               optimizer=_optim(optimizer, lr), baselines=bool(baselines), seed=seed,
               cluster=cluster, dtype=_dtype(dtype),
               profile_steps=BREAKDOWN_STEPS if breakdown else 1)
    if plan is not None and constraints is not None:
        raise BenchError("ah.bench: pass plan= or constraints=, not both (a plan is "
                         "already decided; constraints steer a new search)")
    if not isinstance(loss_tolerance, (int, float)) or not loss_tolerance > 0:
        raise BenchError(f"ah.bench: loss_tolerance must be a positive number, got "
                         f"{loss_tolerance!r}")
    from .runtime.launch import launch

    per_rank = launch(_rank_main, cluster, args=(job,), timeout_s=timeout_s,
                      start_method=start_method)
    result = aggregate(per_rank, job, optimizer, float(loss_tolerance))
    if json_path is not None:
        result.to_json(json_path)
    if plot_path is not None:
        from .report.plots import plot_bench
        plot_bench(result.to_dict(), plot_path)
    return result


# ---------------------------------------------------------------------- input checks
@dataclass
class _Job:
    """Everything a rank needs (picklable, or inherited by fork)."""

    source: Any  # models.spec.ModelSpec or a zero-argument factory
    global_batch: int | None
    steps: int
    warmup: int
    plan: Plan | None
    constraints: Constraints | None
    optimizer: torch_baselines.Optim
    baselines: bool
    seed: int
    cluster: Cluster
    dtype: str | None = None  # a dtype name ("bfloat16"), None: the model's own
    profile_steps: int = 1  # profiled steps per variant (the breakdown's median)


def _dtype(dtype: Any) -> str | None:
    if dtype is None:
        return None
    if not isinstance(dtype, (str, torch.dtype)):
        raise BenchError(f"ah.bench: dtype must be a torch.dtype or a name like 'bf16', got "
                         f"{type(dtype).__name__}")
    from .planning import dtype_name

    return dtype_name(dtype, nn.Linear(1, 1))


def _autocast_dtype(job: "_Job", model: nn.Module) -> torch.dtype | None:
    """The autocast dtype `ah.compile(dtype=job.dtype)` gives this model (None: none)."""
    if job.dtype is None:
        return None
    from .runtime.precision import mixed_compute_dtype

    first = next(iter(model.parameters()), None)
    return mixed_compute_dtype(getattr(torch, job.dtype),
                               first.dtype if first is not None else torch.float32)


def _under_autocast(step: Callable, device: torch.device, compute: torch.dtype | None
                    ) -> Callable:
    """`step` with its forward and loss under `torch.autocast(compute)` (eager AMP)."""
    if compute is None:
        return step

    def run(inputs: tuple, targets: Any) -> torch.Tensor:
        with torch.autocast(device.type, dtype=compute):
            return step(inputs, targets)
    return run


def _check_cluster(cluster: Any) -> None:
    if not isinstance(cluster, Cluster):
        raise ClusterError(f"ah.bench: cluster must be an ah.Cluster (e.g. "
                           f"ah.Cluster.local(2)), got {type(cluster).__name__}")
    if not cluster.is_local:
        raise ClusterError(f"ah.bench starts its ranks as local processes, but {cluster.name!r} "
                           "is not a local cluster; use ah.Cluster.local(n) on one machine")


def _source(model: Any, global_batch: int | None) -> Any:
    """A MODEL string parsed to a ModelSpec (at the global batch), or the factory."""
    if global_batch is not None and (not isinstance(global_batch, int)
                                     or isinstance(global_batch, bool) or global_batch < 1):
        raise BenchError(f"ah.bench: global_batch must be a positive int, got {global_batch!r}")
    if isinstance(model, str):
        from .models import spec

        parsed = spec.parse(model)
        return parsed.with_inputs(batch=global_batch) if global_batch else parsed
    if isinstance(model, nn.Module) or not callable(model):
        raise ModelError(f"ah.bench: model must be a MODEL string (zoo preset or "
                         f"path/file.py:factory) or a zero-argument factory returning "
                         f"(model, inputs, targets, loss_fn), got {type(model).__name__}; a "
                         f"model instance cannot be rebuilt fresh for each variant")
    return model


def _count(name: str, value: Any, least: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise BenchError(f"ah.bench: {name} must be an int >= {least}, got {value!r}")
    return value


def _typed(name: str, value: Any, kind: type) -> Any:
    if value is not None and not isinstance(value, kind):
        raise BenchError(f"ah.bench: {name} must be an ah.{kind.__name__} or None, got "
                         f"{type(value).__name__}")
    return value


def _optim(name: Any, lr: float | None) -> torch_baselines.Optim:
    if name not in OPTIMIZERS:
        raise BenchError(f"ah.bench: optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    cls, default_lr = OPTIMIZERS[name]
    lr = default_lr if lr is None else lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise BenchError(f"ah.bench: lr must be a positive number, got {lr!r}")
    return torch_baselines.Optim(cls, {"lr": float(lr)})


# ---------------------------------------------------------------------- one rank
@dataclass
class _Workload:
    model: nn.Module
    inputs: tuple
    targets: Any
    loss_fn: Callable
    ref: str
    tokens_per_sample: int | None
    spec_workload: Any = None  # models.spec.Workload when built from a MODEL string


def _is_spec(source: Any) -> bool:
    return hasattr(source, "build") and not callable(source)


def _build(job: _Job) -> _Workload:
    """A fresh model (seeded: every variant starts from the same weights) and its batch."""
    if _is_spec(job.source):
        w = job.source.build(device="cpu", seed=job.seed)
        if w.targets is None or w.loss_fn is None:
            raise ModelError(f"ah.bench: {w.ref} gives no targets or loss function; eager "
                             "and the baselines need both (return (model, inputs, targets, "
                             "loss_fn) from the factory)")
        return _Workload(w.model, tuple(w.inputs), w.targets, w.loss_fn, w.ref,
                         w.tokens_per_sample, w)
    torch.manual_seed(job.seed)
    out = job.source()
    if not (isinstance(out, tuple) and len(out) == 4 and isinstance(out[0], nn.Module)
            and callable(out[3])):
        raise ModelError("ah.bench: the model factory must return (model, inputs, targets, "
                         f"loss_fn), got {type(out).__name__}")
    model, inputs, targets, loss_fn = out
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    first = inputs[0]
    tokens = (int(first.shape[1]) if first.dim() == 2 and not first.is_floating_point()
              else None)
    name = getattr(job.source, "__qualname__", type(job.source).__name__)
    return _Workload(model, inputs, targets, loss_fn, name, tokens)


def _batches(job: _Job, w: _Workload) -> list[tuple[tuple, Any]]:
    """warmup + steps global batches, the same on every rank: fresh seeded draws for
    zoo models, else the example batch again."""
    count = job.warmup + job.steps
    if w.spec_workload is not None:
        return [(tuple(i), t) for i, t in w.spec_workload.batches(count, seed=job.seed)]
    return [(w.inputs, w.targets)] * count


def _rank_main(rank: int, job: _Job) -> dict[str, Any]:
    """Every variant on this rank; plain data back to the parent."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if job.cluster.device_type == "cuda" else torch.device("cpu"))
    waiting = dist.new_group(backend="gloo", timeout=_EAGER_WAIT)
    first = _build(job)
    batch = int(first.inputs[0].shape[0])
    if job.global_batch is not None and batch != job.global_batch:
        raise BenchError(f"ah.bench: global_batch={job.global_batch} but the factory's "
                         f"batch has {batch} samples; make the factory build that batch")
    data = [(_to(i, device), _to(t, device)) for i, t in _batches(job, first)]
    compute = _autocast_dtype(job, first.model)
    out: dict[str, Any] = {"batch": batch, "ref": first.ref,
                           "tokens_per_sample": first.tokens_per_sample,
                           "autocast": str(compute).removeprefix("torch.") if compute else None}
    del first
    out["eager"] = _eager(rank, job, data, device, waiting)
    resident = _allocated(device)
    compiled, plan = _compiled(job)
    out["compiled"] = _measure(compiled.train_step, rank, data, device, compiled, "autohybrid",
                               job.profile_steps)
    out["plan"] = {"summary": plan.summary(), "mesh": plan.mesh.describe(), "hash": plan.hash()}
    out["full_plan"] = plan.to_dict()
    out["predicted"] = {"step_time_s": plan.predicted.step_time_s,
                        "exposed_comm_s": plan.predicted.exposed_comm_s,
                        "memory_per_rank_bytes": int(plan.predicted.memory_per_rank_bytes)}
    out["baseline"] = _baseline(rank, job, data, device, plan, compiled,
                                _allocated(device) - resident)
    del compiled
    gc.collect()
    return out


def _allocated(device: torch.device) -> int:
    """Bytes the CUDA allocator holds now (0 on CPU): what a variant still alive beside the
    one being measured holds is taken out of the latter's peak."""
    if device.type != "cuda":
        return 0
    gc.collect()
    return int(torch.cuda.memory_allocated(device))


def _to(x: Any, device: torch.device) -> Any:
    """A batch's tensors (one, or a tuple of them) on `device`: every variant gets its
    data already there, so no step pays for the copy."""
    if isinstance(x, tuple):
        return tuple(_to(t, device) for t in x)
    return x.to(device) if isinstance(x, torch.Tensor) else x


def _eager(rank: int, job: _Job, data: list, device: torch.device, waiting: Any) -> dict:
    """Rank 0 trains the whole model on the whole batch; the others wait for it."""
    if rank != 0:
        dist.barrier(group=waiting)
        return {}
    _reset_cuda(device)
    w = _build(job)
    model = w.model.to(device)
    opt = job.optimizer(model.parameters())
    compute = _autocast_dtype(job, model)
    scaler = (torch.amp.GradScaler(device.type) if compute == torch.float16 else None)

    def step(inputs: tuple, targets: Any) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with (torch.autocast(device.type, dtype=compute) if compute is not None
              else contextlib.nullcontext()):
            loss = w.loss_fn(model(*inputs), targets)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach().float()

    times, losses = _timed(step, data, rank, "eager", barrier=False)
    profiled = _profiled(step, data, rank, device, job.profile_steps)
    memory = _peak_memory(step, data[0], device, (model, opt))
    dist.barrier(group=waiting)
    return {"times": times, "losses": losses, "memory": memory, "exposed": 0.0,
            "profiled": profiled["profiled"], "breakdown": profiled["breakdown"]}


def _compiled(job: _Job) -> tuple[Any, Plan]:
    from .api import compile as ah_compile

    w = _build(job)
    compiled = ah_compile(w.model, job.cluster, w.inputs, loss_fn=w.loss_fn,
                          example_targets=w.targets, optimizer=job.optimizer, plan=job.plan,
                          constraints=job.constraints, global_batch=job.global_batch,
                          dtype=job.dtype)
    return compiled, compiled.plan


def _baseline(rank: int, job: _Job, data: list, device: torch.device, plan: Plan,
              compiled: Any, compiled_bytes: int) -> dict:
    """The hand-written baseline of the plan's layout, or why there is none. Its steps
    alternate with steps of the (already measured) compiled run, a barrier before each,
    so that both see the same machine: `paired_times` are the compiled run's."""
    if not job.baselines:
        return {"name": "n/a", "reason": "baselines=False: not run"}
    w = _build(job)
    choice = torch_baselines.choose(plan, w.model)
    if not choice.available:
        return {"name": choice.name, "reason": choice.reason}
    base = torch_baselines.build(choice, plan, w.model, w.loss_fn, job.optimizer, w.inputs,
                                 device)
    step = _under_autocast(base.train_step, device, _autocast_dtype(job, w.model))
    times, losses, paired = _alternated(step, compiled.train_step, data, rank, choice.name)
    run = _measure(step, rank, data, device, base, choice.name, job.profile_steps,
                   timed=(times, losses), other_bytes=compiled_bytes)
    del base
    gc.collect()
    return {"name": choice.name, "reason": "", "note": choice.note, "paired_times": paired,
            **run}


def _alternated(step: Callable, other: Callable, data: list, rank: int, label: str
                ) -> tuple[list[float], list[float], list[float]]:
    """`step` over `data` (times and losses), each step beside one of `other` (its times):
    adjacent steps, so load from other jobs falls on both alike; `other` first in even
    pairs, second in odd ones, so what one leaves the next (a cache the other's tensors
    evicted, memory the allocator handed back) falls on both alike too."""
    times, losses, others = [], [], []

    def timed(fn, inputs, targets) -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        loss = float(fn(inputs, targets))
        return time.perf_counter() - start, loss

    bar = logs.progress(len(data), f"bench {label} (paired)") if rank == 0 else _quiet()
    with bar as progress:
        for i, (inputs, targets) in enumerate(data):
            if i % 2 == 0:
                others.append(timed(other, inputs, targets)[0])
            took, loss = timed(step, inputs, targets)
            if i % 2:
                others.append(timed(other, inputs, targets)[0])
            times.append(took)
            losses.append(loss)
            progress.advance()
    return times, losses, others


def _measure(step: Callable, rank: int, data: list, device: torch.device, holder: Any,
             label: str, profile_steps: int, timed: tuple | None = None,
             other_bytes: int = 0) -> dict:
    """Timed steps (unless `timed` gives them), then `profile_steps` profiled steps for the
    exposed communication and the breakdown, and one for memory."""
    times, losses = timed or _timed(step, data, rank, label, barrier=True)
    dist.barrier()
    profiled = _profiled(step, data, rank, device, profile_steps)
    dist.barrier()
    memory = _peak_memory(step, data[0], device, holder, other_bytes)
    dist.barrier()
    return {"times": times, "losses": losses, "memory": memory, **profiled}


def _timed(step: Callable, data: list, rank: int, label: str, barrier: bool
           ) -> tuple[list[float], list[float]]:
    """This rank's time and the loss of each step (warm-up included)."""
    times, losses = [], []
    bar = logs.progress(len(data), f"bench {label}") if rank == 0 else _quiet()
    with bar as progress:
        for inputs, targets in data:
            if barrier:
                dist.barrier()
            start = time.perf_counter()
            loss = float(step(inputs, targets))  # waits for the device too
            times.append(time.perf_counter() - start)
            losses.append(loss)
            progress.advance()
    return times, losses


@contextlib.contextmanager
def _quiet():
    yield types.SimpleNamespace(advance=lambda n=1: None)


def _reset_cuda(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ---------------------------------------------------------------------- exposed communication
def _profiled(step: Callable, data: list, rank: int, device: torch.device, steps: int
              ) -> dict[str, Any]:
    """`steps` profiled steps on this rank (the batches of `data` in turn): the median
    exposed communication (see the module docstring), the median profiled step's duration
    (the profiler slows a step: read the two together), the first step's timeline
    (Timeline.to_dict(), the profiler's clock: the same on every local rank) and the
    median breakdown (report/breakdown.py: StepBreakdown.to_dict())."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from .report.breakdown import median_breakdown, op_events, step_breakdowns
    from .report.timeline import STEP_PREFIX, Timeline, clip, subtract, total, union
    from .runtime.profile import timeline_from_events

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        for k in range(steps):
            with record_function(f"{STEP_PREFIX}{k}"):
                float(step(*data[k % len(data)]))
    events = prof.events()
    timeline = timeline_from_events(events, rank, 0.0)
    waits = [(e.time_range.start / 1e6, e.time_range.end / 1e6) for e in events
             if e.name == _FUNCTIONAL_WAIT]
    exposed, spans = [], []
    for k in range(steps):
        span = timeline.intervals(rank, "step", k)[0]
        within = lambda kind: union(clip((iv.start_s, iv.end_s), span.start_s, span.end_s)  # noqa: E731,B023
                                    for iv in timeline.intervals(rank, kind, k))
        cuda = span.args.get("device") == "cuda"  # CUDA: compute is kernels
        compute = subtract(within("compute"), [] if cuda else waits)
        exposed.append(total(subtract(within("communication"), compute)))
        spans.append(span.end_s - span.start_s)
    breakdown = median_breakdown(step_breakdowns(timeline, op_events(events), rank))
    first = Timeline(timeline.source, {rank: [iv for iv in timeline.ranks[rank]
                                              if iv.step == 0]}, dict(timeline.meta))
    return {"exposed": statistics.median(exposed), "profiled": statistics.median(spans),
            "timeline": first.to_dict(), "breakdown": breakdown.to_dict()}


# ---------------------------------------------------------------------- memory
def _peak_memory(step: Callable, batch: tuple, device: torch.device, holder: Any,
                 other_bytes: int = 0) -> int:
    """This variant's peak memory on this rank (see the module docstring); on CUDA the
    allocator's high-water mark over one step, less `other_bytes` (what a variant alive
    beside it holds)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats(device)
        float(step(*batch))
        return int(torch.cuda.max_memory_allocated(device)) - other_bytes
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    held = held_tensor_bytes(holder)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        float(step(*batch))
    return held + transient_peak(prof)


def transient_peak(prof: Any) -> int:
    """The highest running sum of the profiler's `[memory]` events (allocations positive,
    frees negative; frees of blocks allocated before profiling are not reported)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
              and e.device_type() == torch.autograd.DeviceType.CPU]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return peak


def held_tensor_bytes(*roots: Any) -> int:
    """Bytes of the distinct storages of the real tensors reachable from `roots` (and of
    the gradients of those that are leaves). The walk follows object references but not
    into modules, classes or functions' globals (which would reach everything loaded);
    fake and meta tensors hold no memory and are skipped; a DTensor counts its local
    shard."""
    storages: dict[tuple, int] = {}
    seen: set[int] = set()
    stack = list(roots)
    while stack and len(seen) < _WALK_LIMIT:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            _count_tensor(obj, storages)
            stack.extend(gc.get_referents(obj))
            continue
        if isinstance(obj, (types.ModuleType, type, types.CodeType, types.FrameType)):
            continue
        if isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or ()
                         if _cell_filled(c))
            stack.extend(obj.__defaults__ or ())
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _count_tensor(t: torch.Tensor, storages: dict[tuple, int]) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        _count_tensor(t._local_tensor, storages)
        grad = t.grad if t.is_leaf else None
        if grad is not None:
            _count_tensor(grad, storages)
        return
    if type(t) not in (torch.Tensor, nn.Parameter, nn.Buffer) or t.device.type == "meta" \
            or t.is_sparse:
        return
    storage = t.untyped_storage()
    storages[(t.device.type, t.device.index, storage.data_ptr())] = storage.nbytes()
    if t.is_leaf and t.grad is not None:
        _count_tensor(t.grad, storages)


# ---------------------------------------------------------------------- the parent's view
def aggregate(per_rank: list[dict[str, Any]], job: _Job, optimizer: str,
              tolerance: float = 1e-5) -> BenchResult:
    """The ranks' raw measurements → a BenchResult (pure: no processes)."""
    r0 = per_rank[0]
    batch, tokens = r0["batch"], r0["tokens_per_sample"]
    measure = CUDA_MEASURE if job.cluster.device_type == "cuda" else CPU_MEASURE
    eager = _run("eager", "eager", [r0["eager"]], job.warmup, batch, tokens, measure)
    info = r0["baseline"]
    paired = [r["baseline"].get("paired_times") for r in per_rank]
    compiled = _run("autohybrid", "compiled", [
        {**r["compiled"], "times": p} if p else r["compiled"]
        for r, p in zip(per_rank, paired)], job.warmup, batch, tokens, measure)
    if info["reason"]:
        baseline = Run(info["name"] if info["name"] != "n/a" else "baseline", "baseline",
                       available=False, reason=info["reason"], memory_measure=measure)
    else:
        baseline = _run(info["name"], "baseline", [r["baseline"] for r in per_rank],
                        job.warmup, batch, tokens, measure)
        baseline.reason = info.get("note", "")  # how it still differs from the plan
        if all(paired):
            compiled.paired_ratio = statistics.median(
                a / b for a, b in zip(compiled.step_times_s, baseline.step_times_s) if b > 0)
    for run in (compiled, baseline):
        if run.available:
            run.loss_vs_eager = loss_check(run.losses, eager.losses, tolerance)
    predicted = r0["predicted"]
    return BenchResult(
        model=r0["ref"], cluster=job.cluster.name, world_size=job.cluster.world_size,
        global_batch=batch, steps=job.steps, warmup=job.warmup, optimizer=optimizer,
        lr=job.optimizer.kwargs["lr"], plan=r0["plan"], predicted=predicted,
        runs=[eager, compiled, baseline], loss_check=compiled.loss_vs_eager,
        prediction_check=_prediction_check(predicted["step_time_s"], compiled.median_s),
        dtype=job.dtype or "float32", autocast=r0.get("autocast"),
        full_plan=r0.get("full_plan", {}), measured_timeline=_merged_timeline(
            [r["compiled"].get("timeline") for r in per_rank]))


def _merged_timeline(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The ranks' timelines of the compiled run's profiled step as one (times from the
    earliest rank's step start), or None where any rank has none."""
    from .report.timeline import Timeline, merge

    if not parts or any(p is None for p in parts):
        return None
    return merge(Timeline.from_dict(p) for p in parts).to_dict()


def _run(name: str, kind: str, ranks: list[dict], warmup: int, batch: int,
         tokens: int | None, measure: str) -> Run:
    """One variant's figures from its ranks' raw data: per measured step the slowest
    rank's time; losses as every rank returns the global loss (rank 0's)."""
    times = [max(r["times"][i] for r in ranks) for i in range(warmup, len(ranks[0]["times"]))]
    stats = step_stats(times)
    slowest = max(ranks, key=lambda r: r.get("profiled") or 0.0)
    exposed = [r["exposed"] for r in ranks]
    unknown = any(x is None for x in exposed)
    return Run(name=name, kind=kind, step_times_s=times, **stats,
               samples_per_s=batch / stats["median_s"],
               tokens_per_s=batch * tokens / stats["median_s"] if tokens else None,
               peak_memory_bytes=[int(r["memory"]) for r in ranks], memory_measure=measure,
               exposed_comm_s=None if unknown else max(exposed),
               exposed_comm_per_rank_s=[] if unknown else exposed,
               exposed_comm_note=_NO_TIMELINE if unknown else "",
               profiled_step_s=max((r["profiled"] for r in ranks if r.get("profiled")),
                                   default=None),
               breakdown=slowest.get("breakdown"), losses=list(ranks[0]["losses"]))


def step_stats(times: list[float]) -> dict[str, float]:
    """Median, min, max and interquartile range of step times (IQR 0 for one step)."""
    if not times:
        raise BenchError("no measured steps")
    q1, _, q3 = (statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1
                 else (times[0],) * 3)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "iqr_s": q3 - q1}


def loss_check(losses: list[float], reference: list[float], tolerance: float
               ) -> dict[str, Any]:
    """The largest absolute and relative (to |reference|) differences step by step; ok
    when every loss is finite and the relative difference is within `tolerance`."""
    if len(losses) != len(reference) or not losses:
        return {"max_abs_diff": math.inf, "max_rel_diff": math.inf, "tolerance": tolerance,
                "ok": False}
    diffs = [abs(a - b) for a, b in zip(losses, reference)]
    rels = [d / max(abs(b), 1e-12) for d, b in zip(diffs, reference)]
    finite = all(math.isfinite(x) for x in losses + reference)
    return {"max_abs_diff": max(diffs), "max_rel_diff": max(rels), "tolerance": tolerance,
            "ok": finite and max(rels) <= tolerance}


def _prediction_check(predicted_s: float, measured_s: float | None) -> dict[str, Any]:
    ratio = measured_s / predicted_s if measured_s and predicted_s > 0 else None
    return {"predicted_s": predicted_s, "measured_s": measured_s,
            "measured_over_predicted": ratio}


# ---------------------------------------------------------------------- the table
def format_table(result: BenchResult) -> str:
    """Plain text: variant, median ms, spread, samples/s, speed-up vs eager and vs the
    baseline (their median / this median), peak memory, exposed comm, predicted."""
    eager = result.runs[0]
    base = next((r for r in result.runs if r.kind == "baseline" and r.available), None)
    head = ["variant", "median ms", "min–max ms (IQR)", "samples/s", "vs eager",
            "vs baseline", "peak memory/rank", "exposed comm ms", "predicted ms"]
    rows = [head]
    for run in result.runs:
        if not run.available:
            rows.append([run.name, f"n/a: {run.reason}"])
            continue
        predicted = (f"{result.predicted['step_time_s'] * 1e3:.1f}" if run.kind == "compiled"
                     else "")
        rows.append([run.name, f"{run.median_s * 1e3:.1f}",
                     f"{run.min_s * 1e3:.1f}–{run.max_s * 1e3:.1f} ({run.iqr_s * 1e3:.1f})",
                     f"{run.samples_per_s:.1f}", _ratio(eager, run),
                     _ratio(base, run) if base is not None and run is not base else "",
                     _bytes(max(run.peak_memory_bytes)) if run.peak_memory_bytes else "",
                     "" if run.exposed_comm_s is None else f"{run.exposed_comm_s * 1e3:.1f}",
                     predicted])
    widths = [max(len(r[i]) for r in rows if len(r) == len(head) and i < len(r))
              for i in range(len(head))]
    lines = [f"{result.model} on {result.cluster} ({result.plan.get('mesh', '')}), global "
             f"batch {result.global_batch}, {result.steps} steps after {result.warmup} "
             f"warm-up, {result.optimizer} lr {result.lr:g}",
             "a step = the slowest rank's; vs X = X's median / this median (> 1: faster "
             "than X); peak memory: the largest rank's"]
    for row in rows:
        if len(row) < len(head):
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]}")
        else:
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(row, widths))))
    lines += [f"note: {run.name}: {run.reason}" for run in result.runs
              if run.available and run.reason]
    paired = next((r.paired_ratio for r in result.runs if r.paired_ratio), None)
    if paired and base is not None:
        lines.append(f"paired: autohybrid ÷ {base.name}, adjacent steps, median "
                     f"{paired:.3f} (< 1: faster)")
    check = result.loss_check or {}
    lines.append(f"losses vs eager: max |diff| {check.get('max_abs_diff', math.nan):.2e} "
                 f"(relative {check.get('max_rel_diff', math.nan):.2e}, tolerance "
                 f"{check.get('tolerance', math.nan):.0e}): "
                 f"{'ok' if check.get('ok') else 'MISMATCH'}; peak memory: "
                 f"{result.runs[1].memory_measure}")
    return "\n".join(lines)


def _ratio(reference: Run | None, run: Run) -> str:
    if reference is None or reference.median_s is None or run.median_s is None:
        return ""
    return f"{reference.median_s / run.median_s:.2f}×"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
