"""User input to `ah.plan` / `ah.compile` checked before anything is captured or run.

What can be known from the arguments alone is checked here, first, so a mistake costs
no capture and starts no process: the global batch, a model with nothing to train, the
optimizer factory (called through `build_optimizer`, which names it when it fails), and
a given Plan against the cluster's world size and the model's parameter names and
shapes (`params_hash`, recorded in every plan by planning.make_plan). What needs the
graph (the graph hash, the plan's node names) is planning.check_plan_fits_model's.
This module owns no state and imports only the foundation.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
import torch.nn as nn

from .cluster import Cluster
from .errors import ModelError, PlanError, UserFunctionError
from .plan import Plan


def params_hash(model: nn.Module) -> str:
    """Hash of the model's parameter names and shapes, in `named_parameters` order (tied
    parameters once): what a plan records to recognize its model without capturing it."""
    text = ";".join(f"{name}:{tuple(p.shape)}" for name, p in model.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_global_batch(global_batch: Any) -> None:
    """None (the example batch) or a positive int; 0, negatives, floats and bools refused
    (0 was read as "not given" and replaced by the example batch)."""
    if global_batch is None:
        return
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise PlanError(f"global_batch must be a positive integer (samples per optimizer "
                        f"step), got {global_batch!r}; leave it None for the example "
                        "inputs' batch size")


def check_trainable(model: nn.Module) -> None:
    """Refuse a model without a parameter that requires gradients: there is nothing to
    train (the first step would fail in autograd or in the optimizer)."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        what = "no parameters" if next(model.parameters(), None) is None else \
            "no parameter that requires gradients (all are frozen)"
        raise ModelError(f"the model ({type(model).__name__}) has {what}: ah.compile trains "
                         "parameters, so there is nothing to train. Give it parameters (or "
                         "set requires_grad=True on some), or run it in eager for inference")


def check_optimizer_factory(optimizer: Any) -> None:
    """`optimizer` is None or a function of the parameter list, not an optimizer object."""
    if optimizer is None:
        return
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise UserFunctionError(
            f"optimizer must be a function of the parameters that returns a "
            f"torch.optim.Optimizer (e.g. optimizer=lambda params: torch.optim.AdamW(params, "
            f"lr=1e-3)): each rank builds it over its own shards; got a "
            f"{type(optimizer).__name__} object")


def build_optimizer(factory: Callable, params: list) -> torch.optim.Optimizer:
    """`factory(params)`, or a UserFunctionError naming the factory when it raises or
    returns anything but a torch.optim.Optimizer (a scheduler, None, ...)."""
    name = getattr(factory, "__qualname__", type(factory).__name__)
    try:
        optimizer = factory(params)
    except Exception as exc:
        raise UserFunctionError(f"the optimizer factory {name} raised {type(exc).__name__}: "
                                f"{exc} (called with this rank's {len(params)} parameters "
                                "as a list); fix it, or check it in eager: "
                                "factory(list(model.parameters()))") from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UserFunctionError(f"the optimizer factory {name} returned a "
                                f"{type(optimizer).__name__}, not a torch.optim.Optimizer; "
                                "return the optimizer (a learning-rate scheduler goes to "
                                "its own argument)")
    return optimizer


def check_plan_before_capture(plan: Any, model: nn.Module, cluster: Cluster) -> None:
    """A given plan is a Plan, for this cluster's world size and this model's parameters
    (when it records them): refused before capture, not after every rank captured."""
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be an ah.Plan (e.g. ah.Plan.from_json(path)), got "
                        f"{type(plan).__name__}")
    check_plan_world_size(plan, cluster.world_size)
    check_plan_params(plan, model)


def check_plan_world_size(plan: Plan, world_size: int) -> None:
    if plan.world_size != world_size:
        raise PlanError(f"the plan's mesh {plan.mesh.describe()} has {plan.world_size} ranks "
                        f"but the cluster has {world_size} (degrees must multiply to the "
                        "world size): run it on a cluster of that size, or make a plan for "
                        "this one (plan=None searches one)")


def check_plan_params(plan: Plan, model: nn.Module) -> None:
    if plan.params_hash is not None and plan.params_hash != params_hash(model):
        ref = f" ({plan.model_ref})" if plan.model_ref else ""
        raise PlanError(f"the plan was made for another model{ref}, graph hash "
                        f"{plan.model_hash}: its parameter names and shapes hash to "
                        f"{plan.params_hash}, this "
                        f"{type(model).__name__}'s to {params_hash(model)}. Make a plan "
                        "for this model (plan=None searches one)")
