"""Orchestration: capture → search → passes → runtime, behind `ah.plan` and `ah.compile`.

Why this order: the Plan needs the captured graph's costs and hash; the passes need the
Plan; the runtime needs the rewritten graphs and the Plan's mesh. Each step is a call to
the module that owns it; this file only wires them and checks user input.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from .capture import CapturedGraph, as_tuple, capture, model_hashes
from .cluster import Cluster
from .errors import AutohybridError, NotExecutableError, PlanError
from .passes.sync_batch_norm import training_batch_norms
from .passes.pipeline_split import pipeline_blockers
from .plan import Constraints, Plan, schedule_problem
from .runtime.features import unsupported
from .runtime.precision import mixed_compute_dtype
from .search.planner import PlanRequest, search
from .search.space import profile as model_profile
from .search.tp_choice import Rates

if TYPE_CHECKING:  # imported lazily at run time (calibrate and runtime sit above api)
    from .calibrate import Profile
    from .compiled import CompiledModel

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def dtype_name(dtype: torch.dtype | str | None, model: nn.Module) -> str:
    if dtype is None:
        first = next(iter(model.parameters()), None)
        dtype = first.dtype if first is not None else torch.float32
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64"}
    name = names.get(str(dtype), str(dtype))
    if name not in ("float32", "float16", "bfloat16", "float64"):
        raise PlanError(f"dtype {dtype!r} is not supported; use torch.float32, torch.bfloat16, "
                        "torch.float16 or torch.float64")
    return name


def optimizer_kind(optimizer: torch.optim.Optimizer | str | None) -> str:
    """How many state tensors per parameter the optimizer keeps: "adam" (2), "sgd" (1), "none"."""
    if optimizer is None:
        return "none"
    if isinstance(optimizer, str):
        return optimizer
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd" if any(g.get("momentum", 0) for g in optimizer.param_groups) else "none"
    return "adam"


def _check_cluster(cluster: Any) -> Cluster:
    if not isinstance(cluster, Cluster):
        raise AutohybridError(f"cluster must be an ah.Cluster (e.g. ah.Cluster.local(4)), got "
                              f"{type(cluster).__name__}")
    return cluster


def _seq_len(inputs: tuple) -> int | None:
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point():
            return int(t.shape[1])
    return None


def _batch_size(inputs: tuple) -> int:
    if not inputs or not isinstance(inputs[0], torch.Tensor) or inputs[0].dim() == 0:
        raise AutohybridError("example_inputs must hold at least one tensor with a batch dim")
    return int(inputs[0].shape[0])


def load_calibration(calibration: Any) -> "Profile | None":
    from .calibrate import Profile

    if calibration is None or isinstance(calibration, Profile):
        return calibration
    return Profile.from_json(calibration)


def make_plan(named: CapturedGraph, train: CapturedGraph | None, model: nn.Module,
              cluster: Cluster, example_inputs: tuple, global_batch: int | None,
              dtype: torch.dtype | str | None, constraints: Constraints | None,
              optimizer: str, executable_only: bool, model_ref: str | None = None,
              calibration: Any = None, trial: Callable[[Plan], str | None] | None = None
              ) -> Plan:
    """Search a plan for captured graphs (the training graph's costs when there is one).

    `named` is the graph the plan names (`Plan.model_hash`, checked when the plan is
    reused): the training graph in the model's own precision when there is one, else the
    forward graph (capture.model_hashes). `calibration` (a Profile or its JSON path)
    replaces the cluster's figures with measured ones; the plan records its hash.

    Executable means executed: candidates are tried best first, each rewritten for rank
    0 on fake process groups (`trial`, by default runtime/dry_run.PassTrial of the
    costed graph), until the passes accept one, which alone is marked executable; one a
    pass rejects drops out with the pass's reason in `plan.alternatives`.
    `executable_only=True` (ah.compile) searches only features the runtime has, and
    raises NotExecutableError when the passes reject every candidate that fits;
    `executable_only=False` (ah.plan's default) also ranks features the runtime lacks
    (such a plan is chosen untried, marked not executable with what is missing) and,
    when the passes reject every candidate, returns the best marked with the reason.
    """
    if constraints is not None and not isinstance(constraints, Constraints):
        raise PlanError(f"constraints must be ah.Constraints, got {type(constraints).__name__}")
    profile_ = load_calibration(calibration)
    if profile_ is not None:
        cluster = profile_.apply(cluster)
    costed = train or named
    profile = model_profile(costed.gm, costed.dim_roles, Rates.of(cluster))
    first = next(iter(model.parameters()), None)
    width = first.element_size() if first is not None else 4
    if costed.autocast is not None:  # mixed precision: the graph holds the compute dtypes
        width = torch.empty((), dtype=costed.autocast).element_size()
    request = PlanRequest(
        model_hash=named.hash,
        global_batch=int(global_batch or _batch_size(example_inputs)),
        seq=_seq_len(example_inputs), dtype=dtype_name(dtype, model), graph_dtype_bytes=width,
        optimizer=optimizer, constraints=constraints or Constraints(), model_ref=model_ref,
        has_batch_norm=bool(training_batch_norms(costed.gm)),
        pp_blockers=tuple(pipeline_blockers(costed.gm)),
        calibration_hash=profile_.hash() if profile_ is not None else None)
    if request.global_batch < 1:
        raise PlanError(f"global_batch must be a positive integer, got {global_batch!r}")
    if trial is None:
        from .runtime.dry_run import PassTrial
        trial = PassTrial(costed, rank=0, example_inputs=tuple(example_inputs))
    return search(profile, cluster, request, unsupported, executable_only, trial)


def plan(model: nn.Module, cluster: Cluster, example_inputs: Any, *,
         global_batch: int | None = None, dtype: torch.dtype | str | None = None,
         constraints: Constraints | None = None, loss_fn: Callable | None = None,
         example_targets: Any = None, optimizer: str = "adam",
         model_ref: str | None = None, executable_only: bool = False,
         calibration: Any = None) -> Plan:
    """Choose a plan without starting processes (the model may live on the meta device).

    Executable means executed: the candidate it would choose is first rewritten for rank
    0 on fake process groups, and one a pass rejects gives way to the next (its reason
    in `plan.alternatives`), so `plan.executable` is True only for a plan whose passes
    ran on this graph; alternatives that were not rewritten say "not tried"
    (`Alternative.executable` None). Plans with features the runtime cannot execute yet
    are ranked too and, when best, chosen without a rewrite and marked
    (`plan.executable` False, `plan.not_executable_because`); when the passes reject
    every candidate that fits, the best comes back marked with the pass's reason.
    `executable_only=True` searches only what `ah.compile` can run today, as it does,
    and raises NotExecutableError instead. `calibration`: a profile from `ah.calibrate`
    (or its JSON path) to price with this machine's measured figures.

    With `example_targets` (and `loss_fn`, or None for a model that returns its loss
    given `labels=`) the plan is made on the training graph and names it, as
    `ah.compile(..., example_targets=...)` does; without, on the forward graph.
    """
    cluster = _check_cluster(cluster)
    inputs = as_tuple(example_inputs)
    if example_targets is not None:
        train = capture(model, inputs, loss_fn, example_targets)
        named = train
    else:
        train, named = None, capture(model, inputs, with_loss=False)
    return make_plan(named, train, model, cluster, inputs, global_batch, dtype, constraints,
                     optimizer, executable_only=executable_only, model_ref=model_ref,
                     calibration=calibration)


def compile(model: nn.Module, cluster: Cluster, example_inputs: Any, *,
            loss_fn: Callable | None = None, example_targets: Any = None,
            optimizer: OptimizerFactory | None = None, plan: Plan | None = None,
            constraints: Constraints | None = None, global_batch: int | None = None,
            dtype: torch.dtype | str | None = None,
            grad_scaler: torch.amp.GradScaler | bool | None = None,
            init_seed: int | None = None, check: bool | str = False) -> "CompiledModel":
    """Compile `model` for `cluster`: capture, plan (or check `plan`), rewrite, set up ranks.

    Call it on every rank (inside `ah.launch` or torchrun) with the same arguments.
    `dtype` narrower than the model's float32 parameters is mixed precision (autocast
    compute, fp32 master weights: runtime/precision.py); with float16 the loss is scaled
    dynamically as a `torch.amp.GradScaler` would (`grad_scaler`: its settings; False: off).
    A model on the meta device is materialized shard by shard: each rank allocates only
    its part, with the values `ah.init.materialize(model, init_seed)` gives the whole
    model (runtime/materialize.py). `check=True` runs the first step in eager too (rank 0
    holds an eager copy) and raises NumericsError, naming the first parameter whose
    gathered gradient differs, before the optimizer steps (runtime/selfcheck.py); where
    the whole model does not fit on rank 0 beside its share, each pipeline stage is
    checked on its own rank instead (runtime/selfcheck_stage.py). check='whole' or
    check='stage' picks one of the two.
    """
    from .compiled import CompiledModel
    from .runtime.selfcheck import requested_check

    check = requested_check(check)

    cluster = _check_cluster(cluster)
    on_meta = [p.device.type == "meta" for p in model.parameters()]
    if any(on_meta) and init_seed is None:
        raise NotExecutableError(
            "the model's parameters are on the meta device: pass init_seed=<int> to "
            "materialize each rank's shards with autohybrid.init's seeded values (the "
            "eager equivalent is ah.init.materialize(model, init_seed)), or build the "
            "model on 'cpu' or 'cuda'")
    if any(on_meta) and not all(on_meta):
        raise NotExecutableError("the model has parameters on the meta device and others "
                                 "not: build it wholly on meta (with init_seed) or wholly "
                                 "on a real device")
    if init_seed is not None and not any(on_meta):
        raise AutohybridError("init_seed is for models on the meta device (their shards "
                              "are materialized); this model's parameters are already "
                              "allocated")
    compute = None
    if dtype is not None or plan is not None:
        name = dtype_name(dtype, model) if dtype is not None else getattr(plan, "dtype", None)
        if plan is not None and dtype is not None and isinstance(plan, Plan) \
                and plan.dtype != name:
            raise PlanError(f"dtype={name} differs from the plan's dtype {plan.dtype}")
        if name is not None:
            compute = mixed_compute_dtype(getattr(torch, name), _param_dtype(model))
    if compute is not None and any(on_meta):
        raise NotExecutableError(
            "mixed precision of a model on the meta device: autocast does not apply to meta "
            "tensors, so its graph cannot be captured as it will run; build the model on a "
            "real device (or materialize it: ah.init.materialize(model, seed))")
    return CompiledModel(model, cluster, as_tuple(example_inputs), loss_fn=loss_fn,
                         example_targets=example_targets, optimizer_factory=optimizer,
                         plan=plan, constraints=constraints, global_batch=global_batch,
                         autocast=compute, grad_scaler=grad_scaler, init_seed=init_seed,
                         check=check)


def _param_dtype(model: nn.Module) -> torch.dtype:
    first = next(iter(model.parameters()), None)
    return first.dtype if first is not None else torch.float32


def check_plan_fits_model(plan: Plan, graph: CapturedGraph, cluster: Cluster,
                          other: Callable[[], CapturedGraph] | None = None) -> None:
    """Refuse a plan made for another model or cluster, or that cannot run.

    `graph` is the graph compile planned on (the training graph when it has example
    targets); `other` captures the forward graph, compared when the plan names it (a plan
    made without targets: capture.model_hashes)."""
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be an ah.Plan (e.g. ah.Plan.from_json(path)), got "
                        f"{type(plan).__name__}")
    hashes = model_hashes(plan.model_hash, graph, other)
    if plan.model_hash not in hashes.values():
        mine = " and its ".join(f"{what} has hash {h}" for what, h in hashes.items())
        advice = "" if graph.with_loss else (
            "; a plan made with example_targets names the training graph, so compile with "
            "the same loss_fn and example_targets to reuse it")
        raise PlanError(f"the plan was made for another model (graph hash {plan.model_hash}); "
                        f"this model's {mine}. Make a new plan for it (plan=None searches "
                        f"one){advice}")
    if plan.world_size != cluster.world_size:
        raise PlanError(f"the plan's mesh {plan.mesh.describe()} has {plan.world_size} ranks "
                        f"but the cluster has {cluster.world_size} (degrees must multiply to the "
                        "world size)")
    problem = schedule_problem(plan.schedule, plan.mesh.pp, plan.virtual_stages,
                               plan.num_microbatches)
    if problem:
        raise PlanError(f"the plan's pipeline schedule cannot run: {problem}")
    reasons = unsupported(plan)
    if reasons:
        raise NotExecutableError("this plan cannot run yet: " + "; ".join(reasons))
