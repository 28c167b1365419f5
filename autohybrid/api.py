"""`ah.plan` and `ah.compile`: user input checked, then the module that owns each step.

Why this order: the Plan needs the captured graph's costs and hash (capture.py, then
planning.py); the passes need the Plan (rewrite.py); the runtime needs the rewritten
graphs and the Plan's mesh (compiled.py drives capture → plan → rewrite → runtime state
for one rank). This file only wires them and checks user input.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn as nn

from .capture import as_tuple, capture
from .checks import (check_global_batch, check_optimizer_factory, check_plan_before_capture,
                     check_trainable)
from .cluster import Cluster
from .errors import (AutohybridError, InputError, NotExecutableError, PlanError,
                     TrainingArgumentError)
from .plan import Constraints, Plan
from .planning import dtype_name, make_plan
from .runtime.precision import mixed_compute_dtype
from .runtime.selfcheck import requested_check

if TYPE_CHECKING:  # imported when first used: both pull in the runtime (and triton)
    from .calibrate import Profile
    from .compiled import CompiledModel

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def _check_cluster(cluster: Any) -> Cluster:
    if not isinstance(cluster, Cluster):
        raise AutohybridError(f"cluster must be an ah.Cluster (e.g. ah.Cluster.local(4)), got "
                              f"{type(cluster).__name__}")
    return cluster


def load_calibration(calibration: Any) -> "Profile | None":
    """A calibrate.Profile, or the one saved at the JSON path `calibration` (None: none)."""
    from .calibrate import Profile

    if calibration is None or isinstance(calibration, Profile):
        return calibration
    return Profile.from_json(calibration)


def plan(model: nn.Module, cluster: Cluster, example_inputs: Any, *,
         global_batch: int | None = None, dtype: torch.dtype | str | None = None,
         constraints: Constraints | None = None, loss_fn: Callable | None = None,
         example_targets: Any = None, optimizer: str = "adam",
         model_ref: str | None = None, executable_only: bool = False,
         calibration: Any = None, moe_load_skew: float = 0.0) -> Plan:
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
    (or its JSON path) to price with this machine's measured figures. `moe_load_skew`
    (MoE models): how much more than the mean the busiest rank's experts receive under
    expert parallelism (0.25: a quarter more), priced as that much more expert compute on
    every ep rank; `ah.compile(..., plan=...)` runs a plan made so.

    With `example_targets` (and `loss_fn`, or None for a model that returns its loss
    given `labels=`) the plan is made on the training graph and names it, as
    `ah.compile(..., example_targets=...)` does; without, on the forward graph.
    """
    cluster = _check_cluster(cluster)
    check_global_batch(global_batch)
    if isinstance(moe_load_skew, bool) or not isinstance(moe_load_skew, (int, float)) \
            or not moe_load_skew >= 0:
        raise InputError(f"moe_load_skew must be a number >= 0 (0.25: the busiest rank's "
                         f"experts get a quarter more rows), got {moe_load_skew!r}")
    inputs = as_tuple(example_inputs)
    if example_targets is not None:
        train = capture(model, inputs, loss_fn, example_targets)
        named = train
    else:
        train, named = None, capture(model, inputs, with_loss=False)
    return make_plan(named, train, model, cluster, inputs, global_batch, dtype, constraints,
                     optimizer, executable_only=executable_only, model_ref=model_ref,
                     calibration=load_calibration(calibration),
                     moe_load_skew=float(moe_load_skew))


def compile(model: nn.Module, cluster: Cluster, example_inputs: Any, *,
            loss_fn: Callable | None = None, example_targets: Any = None,
            optimizer: OptimizerFactory | None = None, plan: Plan | None = None,
            constraints: Constraints | None = None, global_batch: int | None = None,
            dtype: torch.dtype | str | None = None,
            grad_scaler: torch.amp.GradScaler | bool | None = None,
            init_seed: int | None = None, check: bool | str = False,
            scheduler: SchedulerFactory | None = None) -> "CompiledModel":
    """Compile `model` for `cluster`: capture, plan (or check `plan`), rewrite, set up ranks.

    Call it on every rank (inside `ah.launch` or torchrun) with the same arguments.
    Without `plan`, rank 0 searches one and hands it to the others (what the search
    raises, every rank raises): the search is deterministic, so the others would only
    repeat it (runtime/groups.from_rank_zero).
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
    `scheduler`: `lambda opt: torch.optim.lr_scheduler...(opt, ...)`, built on
    `compiled.optimizer` (kept as `compiled.scheduler`) and stepped once after every
    optimizer step `train_step` takes (not after an fp16 step skipped for overflow).
    """
    from .compiled import CompiledModel

    check = requested_check(check)
    if scheduler is not None and not callable(scheduler):
        raise TrainingArgumentError(
            f"scheduler must be a function of the optimizer returning an LR scheduler, "
            f"e.g. scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10); got "
            f"{type(scheduler).__name__}")
    if scheduler is not None and optimizer is None:
        raise TrainingArgumentError(
            "scheduler= schedules the optimizer's learning rate, and no optimizer= was "
            "given: pass optimizer=lambda params: torch.optim.SGD(params, lr=0.1) too")

    cluster = _check_cluster(cluster)
    check_trainable(model)
    check_optimizer_factory(optimizer)
    check_global_batch(global_batch)
    if plan is not None:  # before capture: a plan for another world or model costs nothing
        check_plan_before_capture(plan, model, cluster)
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
                         check=check, scheduler_factory=scheduler)


def _param_dtype(model: nn.Module) -> torch.dtype:
    first = next(iter(model.parameters()), None)
    return first.dtype if first is not None else torch.float32


def oracle(model: nn.Module, cluster: Cluster, example_inputs: Any, *,
           dataset_size: int, global_batch: int | None = None,
           strategy: str | None = None, segments: int | None = None,
           calibration: Any = None, model_name: str | None = None):
    """The ParaDL oracle for a CNN (cost/oracle.py): per strategy (serial, data,
    spatial, filter, channel, pipeline, data×filter, data×spatial) the per-epoch compute
    and communication seconds and per-PE memory on every rank of `cluster`, each
    strategy's limit on p and whether the cluster's p breaks it. `strategy`: only that
    one (None: all). `global_batch` defaults to the example batch; `segments` is the
    pipeline's micro-batch count S (default min(B, 4p)); `calibration`: a profile from
    `ah.calibrate` (or its JSON path) to price with measured figures. Captures the model
    like `ah.plan` (the meta device works); starts no process."""
    from .cost.cnn_layers import cnn_layers
    from .cost.oracle import STRATEGIES, canonical, evaluate

    cluster = _check_cluster(cluster)
    check_global_batch(global_batch)
    for name, value in (("dataset_size", dataset_size), ("segments", segments)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise TrainingArgumentError(f"{name} must be a positive integer, got {value!r}")
    profile = load_calibration(calibration)
    if profile is not None:
        cluster = profile.apply(cluster)
    inputs = as_tuple(example_inputs)
    batch = global_batch or int(inputs[0].shape[0])
    captured = capture(model, inputs, with_loss=False)
    symbols = {s for s, role in captured.dim_roles.items() if role == "batch"}
    dtype = _param_dtype(model)
    layers = cnn_layers(captured.gm, symbols, cluster.device, str(dtype).removeprefix("torch."))
    names = STRATEGIES if strategy is None else (canonical(strategy),)
    return evaluate(layers, cluster, dataset_size=dataset_size, global_batch=batch,
                    dtype_bytes=torch.empty((), dtype=dtype).element_size(),
                    strategies=names, segments=segments,
                    model=model_name or type(model).__name__)
