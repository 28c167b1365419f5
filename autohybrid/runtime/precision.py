"""Mixed precision: 16-bit compute over fp32 master weights, and fp16 loss scaling.

`ah.compile(model, ..., dtype=torch.bfloat16)` on a model with fp32 parameters captures
and runs its graphs under `torch.autocast` to bf16 (capture.py), as an eager training loop
under `torch.autocast` would: the parameters stay fp32 (they are the master weights the
optimizer steps, and their gradients are fp32), the matmuls run in bf16. Gradients are
reduced over dp in their own dtype (fp32) unless `Plan.grad_reduce_dtype` says otherwise
(runtime/reducer.py casts the buckets).

fp16's narrow range needs loss scaling: `LossScaler` is torch.amp.GradScaler's dynamic
scaling (the loss is multiplied by `scale` before backward, the gradients divided by it
after the reduction; a step whose gradients hold an inf or NaN on any rank is skipped on
every rank and the scale backs off; `growth_interval` clean steps in a row grow it),
decided for all ranks at once, so it matches an eager loop with a GradScaler of the same
settings step for step.

Without loss scaling a non-finite loss is refused (`refuse_nonfinite_loss`): the step
raises NumericsError naming it, before the optimizer steps, so the parameters stay those
of the previous step; with fp16 loss scaling such a step is skipped instead (its
gradients overflow too: `found_inf`), as GradScaler skips it.
"""
from __future__ import annotations

from .comm_device import comm_device
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist

from ..errors import AutohybridError, NotExecutableError, NumericsError

COMPUTE_DTYPES = (torch.bfloat16, torch.float16)


def mixed_compute_dtype(compute: torch.dtype, params: torch.dtype) -> torch.dtype | None:
    """The autocast dtype when `compute` narrower than the parameters' dtype asks for mixed
    precision (None when they are the same: plain training in that dtype)."""
    if compute == params:
        return None
    if compute in COMPUTE_DTYPES and params == torch.float32:
        return compute
    raise NotExecutableError(
        f"dtype={str(compute).removeprefix('torch.')} with {str(params).removeprefix('torch.')} "
        "parameters: mixed precision runs bfloat16 or float16 compute over float32 "
        "parameters (the master weights); cast the model instead (model.to(dtype)) to train "
        "in one dtype")


@dataclass
class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's rule and defaults."""

    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler) -> "LossScaler":
        """The settings (and current scale) of an eager GradScaler."""
        return cls(scale=float(scaler.get_scale()), growth_factor=scaler.get_growth_factor(),
                   backoff_factor=scaler.get_backoff_factor(),
                   growth_interval=scaler.get_growth_interval())

    def update(self, found_inf: bool) -> None:
        """After a step: back off on inf/NaN, grow after `growth_interval` clean steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0


def refuse_nonfinite_loss(loss: torch.Tensor, skipped: bool, step: int) -> None:
    """NumericsError when the loss of train_step `step` (counted from 0) is inf or NaN
    and loss scaling is not skipping the step (`skipped`); the same on every rank (the
    loss is the global batch's)."""
    if skipped or bool(torch.isfinite(loss.detach()).all()):
        return
    raise NumericsError(
        f"train_step {step}: the loss is {float(loss)} (not finite); the optimizer did not "
        f"step, so the parameters are those after step {step - 1}. Look for inf or NaN in "
        "the batch, lower the learning rate, clip gradients (max_grad_norm=...), or, under "
        "float16, let loss scaling skip such steps (grad_scaler)")


def any_nonfinite(grads: Iterable[torch.Tensor | None]) -> bool:
    """Whether any rank's gradients hold an inf or NaN (every rank gets the same answer)."""
    flags = [torch.logical_not(torch.isfinite(g)).any() for g in grads if g is not None]
    found = (torch.stack(flags).any().to(torch.int32) if flags  # a rank with no gradients:
             else torch.zeros((), dtype=torch.int32, device=comm_device()))  # (NCCL)
    found = found.to(comm_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return bool(found.item())


def loss_scaler(autocast: torch.dtype | None,
                grad_scaler: torch.amp.GradScaler | bool | None) -> LossScaler | None:
    """fp16 mixed precision scales the loss (GradScaler's defaults, or `grad_scaler`'s
    settings); False turns it off; other dtypes need none."""
    if autocast != torch.float16 or grad_scaler is False:
        if isinstance(grad_scaler, torch.amp.GradScaler):
            raise AutohybridError("grad_scaler is for float16 mixed precision "
                                  "(ah.compile(..., dtype=torch.float16))")
        return None
    if isinstance(grad_scaler, torch.amp.GradScaler):
        return LossScaler.like(grad_scaler)
    if grad_scaler not in (None, True):
        raise AutohybridError(f"grad_scaler must be a torch.amp.GradScaler, True, False or "
                              f"None, got {type(grad_scaler).__name__}")
    return LossScaler()
