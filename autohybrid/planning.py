"""Planning for one model: a Plan searched on its captured graphs (`make_plan`), or a
given Plan checked against them (`check_plan_fits_model`).

Shared by `ah.plan` / `ah.compile` (api.py, compiled.py) and the dry run
(runtime/dry_run.py), so it sits below all of them: it reads captured graphs, the
search and what the passes and the runtime accept (trial.py, features.py), and imports
nothing that runs a model.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

import dataclasses

from .capture import CapturedGraph, model_hashes
from .checks import check_global_batch, check_plan_world_size, params_hash
from .cluster import Cluster
from .errors import AutohybridError, NotExecutableError, PlanError
from .features import unsupported
from .passes.global_loss import whole_batch_term
from .passes.pipeline_split import pipeline_blockers
from .passes.sync_batch_norm import training_batch_norms
from .plan import Constraints, Plan, schedule_problem
from .search.planner import PlanRequest, search
from .search.space import profile as model_profile
from .search.tp_choice import Rates
from .spatial_costs import SpatialCosts
from .trial import PassTrial


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


def _seq_len(inputs: tuple) -> int | None:
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point():
            return int(t.shape[1])
    return None


def _batch_size(inputs: tuple) -> int:
    if not inputs or not isinstance(inputs[0], torch.Tensor) or inputs[0].dim() == 0:
        raise AutohybridError("example_inputs must hold at least one tensor with a batch dim")
    return int(inputs[0].shape[0])


def make_plan(named: CapturedGraph, train: CapturedGraph | None, model: nn.Module,
              cluster: Cluster, example_inputs: tuple, global_batch: int | None,
              dtype: torch.dtype | str | None, constraints: Constraints | None,
              optimizer: str, executable_only: bool, model_ref: str | None = None,
              calibration: Any = None, trial: Callable[[Plan], str | None] | None = None,
              moe_load_skew: float = 0.0) -> Plan:
    """Search a plan for captured graphs (the training graph's costs when there is one).

    `named` is the graph the plan names (`Plan.model_hash`, checked when the plan is
    reused): the training graph in the model's own precision when there is one, else the
    forward graph (capture.model_hashes). `calibration` (a calibrate.Profile, loaded:
    api.load_calibration) replaces the cluster's figures with measured ones; the plan
    records its hash.

    Executable means executed: candidates are tried best first, each rewritten for rank
    0 on fake process groups (`trial`, by default trial.PassTrial of the
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
    check_global_batch(global_batch)
    profile_ = calibration
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
        global_batch=global_batch if global_batch is not None else _batch_size(example_inputs),
        seq=_seq_len(example_inputs), dtype=dtype_name(dtype, model), graph_dtype_bytes=width,
        optimizer=optimizer, constraints=constraints or Constraints(), model_ref=model_ref,
        has_batch_norm=bool(training_batch_norms(costed.gm)),
        pp_blockers=tuple(pipeline_blockers(costed.gm)),
        whole_batch_sums=train is not None and whole_batch_term(train.gm,
                                                                train.user_outputs[0]),
        calibration_hash=profile_.hash() if profile_ is not None else None,
        moe_load_skew=moe_load_skew)
    if trial is None:
        trial = PassTrial(costed, rank=0, example_inputs=tuple(example_inputs))
    plan = search(profile, cluster, request, unsupported, executable_only, trial,
                  spatial=SpatialCosts(costed, tuple(example_inputs)))
    return dataclasses.replace(plan, params_hash=params_hash(model))


def refuse_split_batch_norm(plan: Plan, gm: Any) -> None:
    """Refuse microbatches under BatchNorm in training mode: its statistics would cover one
    microbatch, not the global batch as in eager."""
    if plan.num_microbatches > 1 and training_batch_norms(gm):
        raise PlanError(
            f"the plan splits each rank's batch into {plan.num_microbatches} "
            "microbatches, but the model has BatchNorm in training mode: its statistics "
            "would then cover one microbatch, not the global batch as in eager. Use one "
            "microbatch (Constraints(num_microbatches=1))")


def _check_sharded_names(plan: Plan, graph: CapturedGraph) -> None:
    """Every node and parameter the plan places on the tp axis is one of the graph's: a
    name the graph lacks (an edited or foreign plan) would be ignored by the passes."""
    known = {n.name for n in graph.gm.graph.nodes} | set(graph.param_fqns) \
        | set(graph.canonical.values())
    unknown = [s.node for s in plan.shardings if s.node not in known]
    if unknown:
        raise PlanError(f"plan.shardings names {len(unknown)} node(s) or parameter(s) this "
                        f"model's graph does not have, first {unknown[0]!r}: the file was "
                        "edited or belongs to another model; make the plan again")


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
    check_plan_world_size(plan, cluster.world_size)
    if plan.model_hash == graph.hash:
        _check_sharded_names(plan, graph)
    problem = schedule_problem(plan.schedule, plan.mesh.pp, plan.virtual_stages,
                               plan.num_microbatches)
    if problem:
        raise PlanError(f"the plan's pipeline schedule cannot run: {problem}")
    reasons = unsupported(plan)
    if reasons:
        raise NotExecutableError("this plan cannot run yet: " + "; ".join(reasons))
