"""A compiled model's state gathered across its shards: whole parameters, buffers and
gradients (full_state_dict, full_grads), one pipeline stage's (stage_full, for the
per-stage check) and the global gradient norm (clip_grad_norm).

Split parameters come back from the tp group (runtime/tp_state.py), ZeRO shards from
the dp group (runtime/zero.py), other stages' parameters from the pp group
(runtime/pipeline.merge_stages). Every function takes a CompiledModel (`c`, read
through its attributes: this module sits below compiled.py) and is collective: every
rank calls it.
"""
from __future__ import annotations

from .comm_device import comm_device
from typing import Any

import torch
import torch.distributed as dist

from ..capture import canonical_names
from ..errors import AutohybridError
from .pipeline import merge_stages


def clip_grad_norm(c: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm (across all shards); returns the norm."""
    params = c._optimizer_params()
    grads = [p.grad for p in params if p.grad is not None]
    distributed = (c.sharded is not None or c._owned is not None
                   or c.zero is not None)
    if not grads and not distributed:
        return torch.zeros((), device=c.device)  # the norm of no gradients, where they'd be
    if distributed:  # every rank joins the norm's collectives, with or without grads
        if norm_type != 2.0:
            raise AutohybridError(f"clip_grad_norm_ with tensor or pipeline parallelism "
                                  f"or ZeRO supports the 2-norm only, got "
                                  f"norm_type={norm_type}")
        total = squared_grad_norm(c).sqrt()
        total = total.to(grads[0].dtype) if grads else total
    else:
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads])
        total = torch.linalg.vector_norm(norms, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


def squared_grad_norm(c: Any) -> torch.Tensor:
    """Σ g² over the whole model: dp shards (ZeRO) summed over the dp group, tp shards
    over the tp group, stages over the pp group, a parameter that stages on k pp ranks
    hold (tied weights) counted once."""
    if c.zero is not None:
        squares = c.zero.squared_grad_norms()
    else:
        squares = {name: p.grad.detach().double().pow(2).sum()
                   for name, p in c._trained_params().items() if p.grad is not None}
    weights: dict[str, float] = {}
    runner = c._runners.get("train")
    if runner is not None:
        ranks = c.plan.stage_ranks()
        for name, stages in runner.split.shared_params.items():
            weights[name] = 1.0 / len({ranks[s] for s in stages})
    if c.sharded is not None:
        total = c.sharded.squared_norm(squares, weights)
    else:
        total = sum((weights.get(name, 1.0) * sq for name, sq in squares.items()),
                    torch.zeros((), dtype=torch.float64, device=comm_device()))
    if c._owned is not None and c.mesh is not None:
        dist.all_reduce(total, group=c.mesh.get_group("pp"))
    return total


def full_state_dict(c: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, whole, as `model.state_dict()` names them (split
    parameters gathered from the tp group, ZeRO shards from the dp group: every rank
    must call it)."""
    local = _zero_locals(c, grads=False)
    if c.sharded is not None:
        state = c.sharded.full_state(c.model, local)
    else:
        canonical = canonical_names(c.model)
        state = {k: (local[canonical[k]].clone() if canonical.get(k) in local
                     else v.detach().clone()) for k, v in c.model.state_dict().items()}
    return _merged(c, state)


def full_grads(c: Any) -> dict[str, torch.Tensor | None]:
    """The gradients of the last step, whole, keyed like `model.named_parameters()`
    (split ones gathered from the tp group, ZeRO shards from the dp group: every rank
    must call it)."""
    local = _zero_locals(c, grads=True)
    if c.sharded is not None:
        all_grads = c.sharded.full_grads(c.model, local)
        grads = {n: all_grads[n] for n, _ in c.model.named_parameters()}
    else:
        canonical = canonical_names(c.model)
        grads = {}
        for n, p in c.model.named_parameters():
            grad = local[canonical[n]] if canonical[n] in local else p.grad
            grads[n] = None if grad is None else grad.detach().clone()
    return _merged(c, grads)


def _merged(c: Any, local: dict[str, Any]) -> dict[str, Any]:
    """`local` with every parameter entry taken from a pp rank whose stages own it."""
    if c.plan.mesh.pp == 1 or c.mesh is None:
        return local
    return merge_stages(local, canonical_names(c.model), c._owned,
                        c.mesh.get_group("pp"), c.plan.mesh.pp, c.device)


def stage_full(c: Any, grads: bool) -> dict[str, Any]:
    """The parameters (or gradients) of this rank's pipeline stages, whole: tp shards
    gathered from the tp group, ZeRO shards from the dp group, never another stage's
    (every rank of the pp coordinate must call it)."""
    zero = _zero_locals(c, grads)
    out: dict[str, Any] = {}
    for name, p in c._trained_params().items():
        local = zero[name] if name in zero else (p.grad if grads else p)
        if local is not None and c.sharded is not None and name in c.sharded.specs:
            local = c.sharded.full(name, local)
        out[name] = None if local is None else (
            local.detach().clone().requires_grad_(p.requires_grad and not grads))
    return out


def trained_names(c: Any) -> dict[str, None]:
    """Every parameter's canonical name, in `named_parameters` order."""
    return dict.fromkeys(canonical_names(c.model)[n]
                         for n, _ in c.model.named_parameters())


def _zero_locals(c: Any, grads: bool) -> dict[str, torch.Tensor | None]:
    """This rank's whole (tp-local) parameters or gradients from the ZeRO shards."""
    if c.zero is None:
        return {}
    get = c.zero.full_grad if grads else c.zero.full_value
    return {name: get(name) for name in c.zero.params}
