"""Per-sample statistics of the training forward pass (loss, correct, target probability),
computed inside the captured training graph so no extra pass is needed to get them.

`StatsLoss(loss_fn, stats_fn)` is what a training capture is given in place of the loss
function when statistics are asked for (`compiled.record_sample_stats`, which
`compiled.fit(..., sampler=ah.data.HidingSampler(...))` calls): the captured graph then
returns the loss and an (N, 3) float tensor — per sample of the (micro)batch, its loss,
1.0 when predicted correctly, and its target-class probability — detached, so the
gradients are the loss's alone. The passes treat it as any per-sample output: data
parallelism keeps each rank's rows (the runtime gathers them), tensor parallelism joins
split logits where the statistics need them whole, a pipeline's last stage computes them.

The statistics are those of a classifier's logits (`sample_stats`): (N, C) with class
targets (N,), or (N, T, V) with token targets (N, T), per sequence. A model that
computes its own loss from its labels and returns (N, T, V) logits (a causal language
model) may shift its labels first, which this module cannot see: it refuses, asking for
`stats_fn(logits, targets) -> (loss, correct, prob)` (`logits_of` the model's output).

`RemedyLoss(gamma, temperature, weighted)` is a training loss of the same kind
(`compiled.use_loss`): knowledge distillation against a teacher's logits and per-sample
weights, packed into the target, which `compiled.fit(..., distill=ah.data.Distillation(...),
impact=ah.data.ImpactFactors(...))` uses (the previous epoch's model as the teacher, each
worker's impact factor as its samples' weight).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from .errors import CaptureError, TrainingArgumentError

#: columns of the statistics tensor
COLUMNS = ("loss", "correct", "prob")


def sample_stats(logits: torch.Tensor, targets: torch.Tensor, *,
                 ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (loss, correct, target probability) of a classifier's output.

    `logits` (N, C) with `targets` (N,): the cross-entropy, argmax == target, and the
    softmax probability of the target. `logits` (N, T, V) with `targets` (N, T) (a
    language model): per sequence over its tokens that are not `ignore_index` — the mean
    token cross-entropy, correct when every such token is predicted, and the geometric
    mean of the target-token probabilities, exp(−loss). A sequence with no such token
    has loss 0, is correct and has probability 1 (it teaches nothing)."""
    logits = logits.detach().float()
    if logits.dim() == 2 and targets.dim() == 1:
        loss = F.cross_entropy(logits, targets, reduction="none")
        prob = logits.softmax(-1).gather(1, targets[:, None]).squeeze(1)
        return loss, logits.argmax(-1) == targets, prob
    if logits.dim() == 3 and targets.dim() == 2 and logits.shape[:2] == targets.shape:
        valid = targets != ignore_index
        safe = targets.masked_fill(~valid, 0)
        token = F.cross_entropy(logits.transpose(1, 2), safe, reduction="none") * valid
        count = valid.sum(1)
        loss = token.sum(1) / count.clamp(min=1)
        correct = ((logits.argmax(-1) == safe) | ~valid).all(1)
        return loss, correct, torch.exp(-loss)
    raise TrainingArgumentError(
        f"sample_stats: logits {tuple(logits.shape)} and targets {tuple(targets.shape)}: "
        "give (N, C) logits with (N,) class targets, or (N, T, V) with (N, T) token targets")


def logits_of(output: Any) -> torch.Tensor:
    """The logits of what a model returns: a tensor, `.logits` (a Hugging Face
    ModelOutput), a dict's "logits", or the first tensor of two or more dims of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)):
        logits = next((o for o in output if isinstance(o, torch.Tensor) and o.dim() >= 2),
                      None)
    if not isinstance(logits, torch.Tensor):
        raise CaptureError(
            f"per-sample statistics: the model returned a {type(output).__name__} with no "
            "logits (a tensor, .logits, or a tuple holding one): give "
            "stats_fn=(logits, targets) -> (loss, correct, prob)")
    return logits


class RemedyLoss:
    """The training loss of the non-IID remedies (data/remedies.py, run by data/fit.py):
    per sample (1 − γ)·CE(logits, y) + γ·T²·KL(softmax(teacher / T) ‖ softmax(logits / T))
    (knowledge distillation against a teacher's logits; γ = 0: the cross-entropy alone),
    times the sample's weight when `weighted` (a worker's impact factor), averaged over
    the batch — one mean of per-sample values, so batch shards sum to it exactly
    (passes/global_loss.py). The target packs, per sample, the label, the weight (when
    weighted) and the teacher's logits (when γ > 0) in one tensor (`pack_targets`). A
    value: its fingerprint is (γ, T, weighted) (capture_cache.py)."""

    def __init__(self, gamma: float = 0.5, temperature: float = 2.0, weighted: bool = False):
        if not 0.0 <= gamma <= 1.0 or not temperature > 0:
            raise TrainingArgumentError(f"distillation: gamma {gamma} must be in [0, 1] and "
                                        f"temperature {temperature} positive")
        self.gamma, self.temperature = float(gamma), float(temperature)
        self.weighted = bool(weighted)

    def __call__(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        logits = logits_of(output)
        first = 2 if self.weighted else 1   # where the teacher's logits start
        width = first + (logits.shape[-1] if self.gamma > 0 else 0)
        if logits.dim() != 2 or target.dim() != 2 or target.shape[1] != width:
            raise CaptureError(
                f"non-IID remedies: logits {tuple(logits.shape)} and packed targets "
                f"{tuple(target.shape)}: they train a classifier's (N, C) logits against "
                f"(N, {width}) targets (the label{', the weight' if self.weighted else ''}"
                f"{', the teacher logits' if self.gamma > 0 else ''}: pack_targets)")
        per_sample = F.cross_entropy(logits, self.labels(target), reduction="none")
        if self.gamma > 0:
            t = self.temperature
            student = F.log_softmax(logits.float() / t, dim=-1)
            teacher = F.log_softmax(target[:, first:].float() / t, dim=-1)
            kl = (teacher.exp() * (teacher - student)).sum(-1)
            per_sample = (1.0 - self.gamma) * per_sample + self.gamma * t * t * kl
        if self.weighted:
            per_sample = per_sample * target[:, 1].to(per_sample.dtype)
        return per_sample.mean()

    @staticmethod
    def labels(target: torch.Tensor) -> torch.Tensor:
        return target[:, 0].long()

    def _key(self) -> tuple:
        return (self.gamma, self.temperature, self.weighted)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemedyLoss) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def pack_targets(labels: torch.Tensor, teacher: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N,) class labels, with (N,) weights and the teacher's (N, C) logits where given,
    as RemedyLoss's packed target (in the teacher's dtype, else `dtype`)."""
    dtype = teacher.dtype if teacher is not None else dtype
    columns = [labels[:, None].to(dtype)]
    if weights is not None:
        columns.append(weights[:, None].to(dtype))
    if teacher is not None:
        columns.append(teacher)
    return torch.cat(columns, dim=1)


class StatsLoss:
    """`loss_fn` (None: the model computes its loss from its targets) with per-sample
    statistics: `stats(output, target)` is the (N, 3) tensor of COLUMNS, from
    `stats_fn(logits_of(output), target)` or, by default, `sample_stats`. A value: its
    fingerprint is its two functions' (capture_cache.py)."""

    def __init__(self, loss_fn: Callable | None, stats_fn: Callable | None = None):
        if isinstance(loss_fn, StatsLoss):
            loss_fn = loss_fn.loss_fn
        self.loss_fn, self.stats_fn = loss_fn, stats_fn

    def stats(self, output: Any, target: Any) -> torch.Tensor:
        logits = logits_of(output)
        if isinstance(self.loss_fn, RemedyLoss):   # the label of a packed target
            target = self.loss_fn.labels(target)
        if self.stats_fn is not None:
            values = self.stats_fn(logits, target)
        else:
            if isinstance(target, tuple):
                raise CaptureError(
                    f"per-sample statistics: the model takes {len(target)} targets; the "
                    "default statistics are a classifier's (one target tensor): give "
                    "stats_fn=(logits, targets) -> (loss, correct, prob)")
            if self.loss_fn is None and logits.dim() == 3:
                raise CaptureError(
                    "per-sample statistics: the model computes its loss from its labels "
                    f"and returns {logits.dim()}-dim logits, which it may compare with "
                    "shifted labels (a causal language model does): give "
                    "stats_fn=(logits, targets) -> (loss, correct, prob) that aligns them "
                    "as its loss does")
            values = sample_stats(logits, target)
        return stats_tensor(values)


def stats_tensor(values: Any) -> torch.Tensor:
    """(loss, correct, prob) of N samples as one detached (N, 3) float tensor."""
    if isinstance(values, torch.Tensor) and values.dim() == 2 and values.shape[1] == 3:
        return values.detach().float()
    if not isinstance(values, (tuple, list)) or len(values) != 3:
        raise TrainingArgumentError(
            "stats_fn must return (loss, correct, prob), three tensors of one value per "
            f"sample, or one (N, 3) tensor; got {type(values).__name__}")
    columns = [torch.as_tensor(v).detach().reshape(-1).float() for v in values]
    return torch.stack(columns, dim=1)
