"""Non-IID remedies for local and partial shuffling (off by default; data/fit.py runs them).

With local or partial shuffling each worker's part can be skewed (by class, by source).
Two remedies, composable, both through the training loss `sample_stats.RemedyLoss`:

- `Distillation(gamma, temperature)`: from epoch 1 on, the loss is (1 − γ)·CE + γ·T²·KL
  against the logits the model gave every sample at the end of the previous epoch (a
  forward of every sample, eval mode), curbing overfitting to the local part.
- `ImpactFactors(shared=64)`: each worker's gradient weighted by an impact factor
  instead of the plain mean. At the start of every epoch after the first, on a small
  shared batch S (`shared` samples drawn once from the seed, the same on every worker):
  worker w's loss on S after a step along its own gradient g_w alone, to first order
  ℓ_w = L_S − η·⟨∇L_S, g_w⟩ (η the learning rate), with ⟨∇L_S, g_w⟩ the derivative of
  w's loss on its next batch along ∇L_S, by central differences (the parameters moved
  by ±ε·∇L_S / ‖∇L_S‖ on every rank alike, two forwards). The factors α_w ∝ 1 / ℓ_w,
  normalised to sum to 1 (a worker whose step would lower the shared loss more weighs
  more); worker w's samples then carry the weight M·α_w, so the step's gradient is
  Σ_w α_w·g_w (the plain mean: every α_w = 1/M).

  The parameters are moved in place, which ZeRO's sharded gradients do not allow: a
  plan with ZeRO is refused. ImpactFactors needs a shuffle (the workers' parts).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..errors import TrainingArgumentError
from ..sample_stats import RemedyLoss, logits_of


@dataclass(frozen=True)
class Distillation:
    """Knowledge distillation against the previous epoch's model (see the module)."""
    gamma: float = 0.5
    temperature: float = 2.0

    def __post_init__(self) -> None:
        RemedyLoss(self.gamma, self.temperature)   # its checks


@dataclass(frozen=True)
class ImpactFactors:
    """Impact-factor weighted gradients (see the module): `shared` samples in the shared
    batch, drawn with `seed`; `epsilon` the relative step of the central differences."""
    shared: int = 64
    epsilon: float = 1e-2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.shared < 1 or not self.epsilon > 0:
            raise TrainingArgumentError(f"ImpactFactors: shared {self.shared} must be at "
                                        f"least 1 and epsilon {self.epsilon} positive")

    def shared_indices(self, num_samples: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 17)
        return torch.randperm(num_samples, generator=g)[:min(self.shared, num_samples)]


def check_plan(compiled: Any, impact: ImpactFactors | None, shuffle: Any) -> None:
    """ImpactFactors' requirements, before anything trains."""
    if impact is None:
        return
    if shuffle is None:
        raise TrainingArgumentError(
            "fit(impact=...): impact factors weight each worker's part; give shuffle="
            "ah.data.PartialShuffle(...) (the parts)")
    if compiled.plan.zero:
        raise TrainingArgumentError(
            f"fit(impact=...): the plan shards gradients with ZeRO-{compiled.plan.zero}, and "
            "impact factors move the parameters along the shared batch's gradient in "
            "place: compile with Constraints(zero=0)")
    unit = compiled.plan.mesh.dp * compiled.plan.num_microbatches
    if impact.shared % unit:
        raise TrainingArgumentError(
            f"fit(impact=...): the shared batch of {impact.shared} samples must split into "
            f"the plan's dp × microbatches = {unit}")


def impact_factors(compiled: Any, data: Any, shared: torch.Tensor,
                   probes: Sequence[Sequence[int]], epsilon: float) -> torch.Tensor:
    """The workers' impact factors α (sum 1), from the shared batch `shared` and each
    worker's probe batch `probes[w]` (see the module). Every rank calls it alike; the
    model trains with the compiled loss here (the caller switches it)."""
    model = compiled.model
    params = [p for p in compiled._trained_params().values()]
    xs, ys = data.take(shared)
    loss_s = float(compiled.forward_backward(xs, ys))     # ∇L_S in p.grad, not stepped
    norm = float(compiled.clip_grad_norm_(math.inf))
    lr = float(compiled.optimizer.param_groups[0]["lr"]) if compiled.optimizer else 0.0
    step = epsilon / max(norm, 1e-12)
    batch = torch.cat([torch.as_tensor(list(p), dtype=torch.long) for p in probes])
    xb, yb = data.take(batch)
    sizes = [len(p) for p in probes]
    was_training = model.training
    model.eval()
    losses = []
    try:
        with torch.no_grad():
            for sign in (1.0, -1.0):
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=sign * step)
                logits = logits_of(compiled(xb)).float().cpu()
                for p in params:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-sign * step)
                per = F.cross_entropy(logits, yb.cpu(), reduction="none")
                losses.append(torch.stack([part.mean() for part in per.split(sizes)]))
    finally:
        model.train(was_training)
        for p in params:
            p.grad = None
    # the central difference of t ↦ L_w(θ + t·∇L_S) at 0: ⟨∇L_S, g_w⟩
    alignment = (losses[0] - losses[1]) / (2 * step)
    lookahead = (loss_s - lr * alignment).clamp(min=1e-6 * max(loss_s, 1e-12))
    inverse = 1.0 / lookahead.double()
    return (inverse / inverse.sum()).float()
