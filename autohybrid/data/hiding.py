"""Adaptive sample hiding (KAKURENBO, Thao Nguyen et al., NeurIPS 2023).

Each epoch, among the fraction F_e of samples with the lowest loss (as last measured),
the sampler hides those the model predicts correctly with a target-class probability of
at least τ; the others (the visible samples) are trained on. The statistics of a sample
— loss, whether the prediction is correct, the target-class probability — come from the
training forward pass of the epoch it was visible in (`record`), and hidden samples get a
forward-only pass at the end of the epoch (`hidden_indices`: the caller runs it and
records the result), so a sample the model forgets comes back.

The schedule:

- no sample is hidden before `warmup_epochs` epochs have been seen (nothing is measured
  before the first epoch ends; default 1);
- F_e follows the learning-rate milestones: F before the first, then 0.8·F, 0.6·F and
  0.4·F after the first, second and third (`fraction_at`);
- the learning rate is scaled by 1 / (1 − F_e) while hiding is on (`lr_scale`), since an
  epoch of fewer samples takes fewer steps.

`HidingSampler` yields global batches of sample indices: a permutation of the visible
samples drawn from (seed, epoch) — the same on every rank — cut into batches. With data
parallelism each rank trains its own contiguous part of every global batch
(`compiled.train_step` splits it so; `rank_batches` gives a plain PyTorch loop its part),
so across the ranks every visible sample is trained exactly once per epoch. Per-token
losses (language models) give statistics per sequence (`sample_stats`).

The sampler is plain data (`state_dict` / `load_state_dict`: the statistics, the epoch),
so it goes into checkpoints.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..errors import TrainingArgumentError
from ..sample_stats import sample_stats  # noqa: F401  (ah.data.sample_stats)

#: F_e relative to F after each learning-rate milestone (KAKURENBO's schedule)
DECAY = (1.0, 0.8, 0.6, 0.4)


class HidingSampler:
    """Global batches of the visible samples of an epoch; see the module docstring.

    `num_samples`: the dataset's size; `batch_size`: the global batch; `fraction` (F)
    and `threshold` (τ) as in KAKURENBO (defaults 0.3 and 0.7); `milestones`: the epochs
    at which the learning rate decays; `drop_last`: drop an epoch's last partial batch.
    Call `set_epoch(e)` before iterating epoch e (compiled.fit does)."""

    def __init__(self, num_samples: int, batch_size: int, *, fraction: float = 0.3,
                 threshold: float = 0.7, milestones: Sequence[int] = (),
                 warmup_epochs: int = 1, seed: int = 0, drop_last: bool = False):
        if num_samples < 1 or batch_size < 1:
            raise TrainingArgumentError(f"HidingSampler: num_samples {num_samples} and "
                                        f"batch_size {batch_size} must be at least 1")
        if not 0.0 <= fraction < 1.0:
            raise TrainingArgumentError(f"HidingSampler: fraction {fraction} must be in [0, 1)")
        if not 0.0 <= threshold <= 1.0:
            raise TrainingArgumentError(f"HidingSampler: threshold {threshold} must be in [0, 1]")
        if list(milestones) != sorted(milestones) or warmup_epochs < 0:
            raise TrainingArgumentError(
                f"HidingSampler: milestones {list(milestones)} must be increasing epochs and "
                f"warmup_epochs {warmup_epochs} >= 0")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.fraction, self.threshold = fraction, threshold
        self.milestones, self.warmup_epochs = tuple(milestones), warmup_epochs
        self.seed, self.drop_last = seed, drop_last
        self.epoch = 0
        #: the last measured statistics of every sample (NaN loss: never measured), kept
        #: on the host: bookkeeping, never handed to a collective
        self.loss = torch.full((num_samples,), math.nan, dtype=torch.float64, device="cpu")
        self.correct = torch.zeros(num_samples, dtype=torch.bool, device="cpu")
        self.prob = torch.zeros(num_samples, dtype=torch.float64, device="cpu")
        self.hidden = torch.zeros(num_samples, dtype=torch.bool, device="cpu")

    # ---------------------------------------------------------------- the schedule
    def fraction_at(self, epoch: int) -> float:
        """F_e: 0 during warm-up, then F scaled by DECAY after each milestone passed."""
        if epoch < self.warmup_epochs:
            return 0.0
        passed = sum(epoch >= m for m in self.milestones)
        return self.fraction * DECAY[min(passed, len(DECAY) - 1)]

    def lr_scale(self, epoch: int | None = None) -> float:
        """1 / (1 − F_e) while hiding is on, else 1."""
        return 1.0 / (1.0 - self.fraction_at(self.epoch if epoch is None else epoch))

    # ---------------------------------------------------------------- statistics
    def record(self, indices: Any, loss: Any, correct: Any, prob: Any) -> None:
        """The statistics of samples `indices` from their latest forward pass (every
        rank records the same values: those of the whole global batch, or gathered)."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        values = [torch.as_tensor(v).detach().reshape(-1).cpu() for v in (loss, correct, prob)]
        if any(v.numel() != idx.numel() for v in values):
            raise TrainingArgumentError(
                f"HidingSampler.record: {idx.numel()} indices but statistics of sizes "
                f"{[v.numel() for v in values]}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_samples):
            raise TrainingArgumentError(f"HidingSampler.record: indices outside "
                                        f"[0, {self.num_samples})")
        self.loss[idx] = values[0].double()
        self.correct[idx] = values[1].bool()
        self.prob[idx] = values[2].double()

    def choose_hidden(self, epoch: int) -> torch.Tensor:
        """The rule: among the ⌊F_e · N⌋ samples of lowest loss (measured ones only;
        ties broken by index), those predicted correctly with target probability ≥ τ."""
        hidden = torch.zeros(self.num_samples, dtype=torch.bool, device="cpu")
        count = int(math.floor(self.fraction_at(epoch) * self.num_samples + 1e-9))
        measured = torch.nonzero(~torch.isnan(self.loss)).flatten()
        if count == 0 or measured.numel() == 0:
            return hidden
        # a stable sort of the measured samples (in index order) by loss: ties by index
        order = torch.sort(self.loss[measured], stable=True).indices
        candidates = measured[order[:count]]
        keep = self.correct[candidates] & (self.prob[candidates] >= self.threshold)
        hidden[candidates[keep]] = True
        return hidden

    # ---------------------------------------------------------------- an epoch
    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch`: choose its hidden samples from the statistics so far."""
        self.epoch = epoch
        self.hidden = self.choose_hidden(epoch)

    def visible_indices(self) -> torch.Tensor:
        """This epoch's visible samples in their training order (from seed and epoch)."""
        visible = torch.nonzero(~self.hidden).flatten()
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return visible[torch.randperm(visible.numel(), generator=g)]

    def hidden_indices(self) -> torch.Tensor:
        """This epoch's hidden samples: forward them (no training) at the epoch's end and
        `record` what they give."""
        return torch.nonzero(self.hidden).flatten()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.visible_indices().tolist()
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            if self.drop_last and len(batch) < self.batch_size:
                return
            yield batch

    def __len__(self) -> int:
        visible = int((~self.hidden).sum())
        return visible // self.batch_size if self.drop_last else \
            -(-visible // self.batch_size)

    def rank_batches(self, rank: int, world: int) -> Iterator[list[int]]:
        """Data-parallel rank `rank` of `world`: its contiguous part of every global batch
        (as `compiled.train_step` splits one: the first `len % world` parts one larger)."""
        if not 0 <= rank < world:
            raise TrainingArgumentError(f"HidingSampler.rank_batches: rank {rank} of {world}")
        for batch in self:
            base, extra = divmod(len(batch), world)
            start = rank * base + min(rank, extra)
            yield batch[start:start + base + (rank < extra)]

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "loss": self.loss.clone(), "correct": self.correct.clone(),
                "prob": self.prob.clone(), "hidden": self.hidden.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("loss", "correct", "prob", "hidden"):
            value = torch.as_tensor(state[key])
            if value.shape != (self.num_samples,):
                raise TrainingArgumentError(
                    f"HidingSampler.load_state_dict: {key!r} holds {tuple(value.shape)} "
                    f"statistics; this sampler has {self.num_samples} samples")
        self.epoch = int(state["epoch"])
        self.loss = torch.as_tensor(state["loss"]).double().clone()
        self.correct = torch.as_tensor(state["correct"]).bool().clone()
        self.prob = torch.as_tensor(state["prob"]).double().clone()
        self.hidden = torch.as_tensor(state["hidden"]).bool().clone()

    def summary(self) -> str:
        visible = int((~self.hidden).sum())
        return (f"epoch {self.epoch}: {visible} of {self.num_samples} samples visible "
                f"({visible / self.num_samples:.0%}), {self.num_samples - visible} hidden, "
                f"F_e {self.fraction_at(self.epoch):.2f}, lr ×{self.lr_scale():.3f}")
