"""`compiled.fit(dataset, epochs=..., sampler=HidingSampler(...), shuffle=PartialShuffle(...))`:
the training loop with adaptive sample hiding and partial local shuffling.

Every rank runs it with the same arguments. Per epoch e:

- hiding (`sampler`): `set_epoch(e)` chooses the hidden samples from the statistics so
  far and the learning rate is scaled to `sampler.lr_scale(e)` (param groups and the
  scheduler's base rates, relative to the scale in force); the training graph records
  each sample's loss, correctness and target probability in its forward pass
  (`compiled.record_sample_stats`, gathered over dp) and the sampler records them; at the
  epoch's end the hidden samples get a forward-only pass (the model in eval mode, under
  no_grad) whose statistics are recorded, so a sample the model forgets comes back.
- without shuffling: the sampler's global batches, each rank building the batch from
  the dataset and training its dp part (`train_step`).
- partial local shuffling (`shuffle`, workers = the plan's dp degree): each dp rank holds
  the tensors of its part only and trains on its part's visible samples in the epoch's
  local order (`train_step(..., local=True)`, `batch_size // dp` per rank, every rank the
  same number of steps: the fewest any part gives, the remainder left to later epochs).
  The exchange before epoch e + 1 is started when epoch e starts, on process groups of
  its own, and waited for when e ends: it overlaps the epoch's training. The end-of-epoch
  forward of hidden samples reads them from `dataset`.
- the non-IID remedies (remedies.py, off by default), through the training loss
  sample_stats.RemedyLoss (`compiled.use_loss`: the training graph captured again with
  the teacher's logits and the weights packed into the targets):
  distillation (`distill=Distillation(γ, T)`): every epoch ends with a forward of every
  sample (eval mode) whose logits are the next epoch's teacher, which also refreshes the
  hidden samples' statistics; from epoch 1 on the loss is (1 − γ)·CE + γ·T²·KL against
  them. Impact factors (`impact=ImpactFactors(...)`, with a shuffle): at the start of
  every epoch after the first, each worker's factor from its first batch and the shared
  batch; its samples then weigh dp·α_w. Without a sampler or a shuffle, batches of
  `batch_size` are a seeded permutation of every sample per epoch.

Checkpoints (`save_dir`, every `save_every` epochs and at the end) hold the data position
and each part's state (the sampler's statistics, the shuffle's parts, the learning-rate
scale, the teacher's logits, the impact factors); `resume=True` continues from the next
epoch, as the uninterrupted run would.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, TensorDataset, default_collate

from ..errors import TrainingArgumentError
from ..report.fit_progress import FitDisplay
from ..runtime.fit import FitResult, _lr
from ..runtime.fit_data import DataPosition, batch_tokens, decode_state, encode_state
from ..runtime.groups import row_group
from ..sample_stats import RemedyLoss, StatsLoss, logits_of, pack_targets
from .hiding import HidingSampler
from .remedies import Distillation, ImpactFactors, check_plan, impact_factors
from .shuffle import PartialShuffle


@dataclass
class DataFitResult(FitResult):
    """FitResult, and per epoch what the data parts did (the same on every rank)."""
    samples: int = 0               # samples trained on (forward and backward)
    forwarded: int = 0             # hidden samples given the end-of-epoch forward
    exchanged: int = 0             # samples sent between workers (all workers)
    bytes_exchanged: int = 0       # bytes this rank sent
    epochs_log: list[dict[str, Any]] = field(default_factory=list)


class Samples:
    """Batches of a dataset by sample index: a tuple (inputs, targets) of tensors, a
    TensorDataset (indexed directly), or any map-style dataset of (inputs, targets)
    samples (collated with default_collate)."""

    def __init__(self, dataset: Any):
        if isinstance(dataset, TensorDataset):
            dataset = tuple(dataset.tensors)
        if isinstance(dataset, (tuple, list)) and len(dataset) == 2 and \
                all(isinstance(t, torch.Tensor) for t in dataset):
            if dataset[0].shape[0] != dataset[1].shape[0]:
                raise TrainingArgumentError(
                    f"fit: inputs of {dataset[0].shape[0]} samples and targets of "
                    f"{dataset[1].shape[0]}: give one target per sample")
            self.tensors: tuple[torch.Tensor, ...] | None = tuple(dataset)
            self.dataset = None
            self.size = int(dataset[0].shape[0])
        elif isinstance(dataset, Dataset) and hasattr(dataset, "__len__"):
            self.tensors, self.dataset, self.size = None, dataset, len(dataset)
        else:
            raise TrainingArgumentError(
                "fit(sampler=/shuffle=): the data must be a map-style dataset of "
                "(inputs, targets) samples (a torch Dataset with __len__, a "
                f"TensorDataset) or a tuple (inputs, targets) of tensors; got a "
                f"{type(dataset).__name__}")

    def take(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if self.tensors is not None:
            return self.tensors[0][idx], self.tensors[1][idx]
        batch = default_collate([self.dataset[i] for i in idx.tolist()])
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TrainingArgumentError("fit: each dataset sample must be (inputs, targets)")
        return batch[0], batch[1]


def fit_data(compiled: Any, dataset: Any, *, epochs: int | None,
             sampler: HidingSampler | None, shuffle: PartialShuffle | None,
             distill: Distillation | None = None, impact: ImpactFactors | None = None,
             batch_size: int | None = None, stats_fn: Callable | None = None,
             save_every: int | None = None, save_dir: Any = None, resume: bool = False,
             keep_last: int | None = None, max_grad_norm: float | None = None,
             log_every: int | None = 10) -> DataFitResult:
    """The loop of the module docstring; `compiled.fit` calls it when given any of the
    parts (sampler, shuffle, distill, impact)."""
    data = Samples(dataset)
    batch_size = _check(compiled, data, epochs, sampler, shuffle, distill, batch_size,
                        save_every, save_dir, resume)
    check_plan(compiled, impact, shuffle)
    result, state = DataFitResult(), _State()
    position = DataPosition()
    if resume:
        position, result.resumed_from = _resume(compiled, save_dir, sampler, shuffle,
                                                distill, state)
    result.start_step = compiled.step
    if sampler is not None:
        compiled.record_sample_stats(stats_fn)
    loop = _Loop(compiled, data, sampler, shuffle, distill, impact, batch_size, max_grad_norm,
                 state, result, stats_fn)
    display = FitDisplay(compiled.rank == 0, None, compiled.step, log_every)
    saved_epoch = position.epoch
    with display:
        if result.resumed_from:
            display.note(f"resumed from {result.resumed_from} at step {compiled.step}, "
                         f"epoch {position.epoch}")
        for epoch in range(position.epoch, epochs):
            log = loop.epoch(epoch, display, last=epoch == epochs - 1)
            result.epochs_log.append(log)
            display.note(_describe(log, data.size))
            position = DataPosition(epoch + 1, 0)
            if save_dir is not None and (epoch + 1) % (save_every or epochs) == 0:
                result.checkpoints.append(_save(compiled, save_dir, position, sampler,
                                                shuffle, distill, state, keep_last, display))
                saved_epoch = epoch + 1
        if save_dir is not None and saved_epoch != position.epoch:
            result.checkpoints.append(_save(compiled, save_dir, position, sampler, shuffle,
                                            distill, state, keep_last, display))
    if sampler is not None:
        compiled.record_sample_stats(enabled=False)
    if distill is not None or impact is not None:
        compiled.use_loss(None)
    result.step, result.epoch, result.batches = compiled.step, position.epoch, 0
    if shuffle is not None:
        result.bytes_exchanged = shuffle.bytes_sent
    return result


@dataclass
class _State:
    """What the loop keeps besides its parts: the learning-rate scale in force, with
    distillation the teacher's logits of every sample (the previous epoch's model), with
    impact factors the workers' latest."""
    lr_scale: float = 1.0
    teacher: torch.Tensor | None = None
    weights: torch.Tensor | None = None   # the workers' impact factors, sum 1


class _Loop:
    def __init__(self, compiled: Any, data: Samples, sampler: HidingSampler | None,
                 shuffle: PartialShuffle | None, distill: Distillation | None,
                 impact: ImpactFactors | None, batch_size: int,
                 max_grad_norm: float | None, state: _State, result: DataFitResult,
                 stats_fn: Callable | None):
        self.compiled, self.data, self.sampler, self.shuffle = compiled, data, sampler, shuffle
        self.distill, self.impact = distill, impact
        self.shared = impact.shared_indices(data.size) if impact is not None else None
        self.batch_size, self.max_grad_norm = batch_size, max_grad_norm
        self.state, self.result = state, result
        self.dp, self.worker = compiled.plan.mesh.dp, compiled.coords[1]
        self.stats = StatsLoss(compiled.loss_fn, stats_fn)   # of the end-of-epoch forward
        self.local: list[torch.Tensor] | None = None   # this worker's part (shuffle)
        self.group = _exchange_group(compiled) if shuffle is not None else None

    # ------------------------------------------------------------------ one epoch
    def epoch(self, epoch: int, display: FitDisplay, last: bool) -> dict[str, Any]:
        sampler, shuffle = self.sampler, self.shuffle
        if sampler is not None:
            sampler.set_epoch(epoch)
            self._scale_lr(sampler.lr_scale(epoch))
        distilled = self.distill is not None and self.state.teacher is not None
        self._use_remedies()
        hidden = sampler.hidden if sampler is not None else None
        sent_before = shuffle.samples_sent if shuffle is not None else 0
        trained = 0
        if shuffle is None:
            for indices in (sampler if sampler is not None else self._batches(epoch)):
                trained += self._step(indices, indices, None, epoch, display)
        else:
            trained = self._shuffled_epoch(epoch, hidden, display, last)
        if self.distill is not None:   # every sample: the next epoch's teacher
            forwarded = self._forward(torch.arange(self.data.size), teacher=True)
        elif sampler is not None:
            forwarded = self._forward(sampler.hidden_indices())
        else:
            forwarded = 0
        self.result.samples += trained
        self.result.forwarded += forwarded
        exchanged = (shuffle.samples_sent - sent_before) if shuffle is not None else 0
        self.result.exchanged += exchanged
        return {"epoch": epoch, "trained": trained,
                "hidden": int(hidden.sum()) if hidden is not None else 0,
                "forwarded": forwarded, "exchanged": exchanged,
                "distilled": distilled,
                "impact": self.state.weights.tolist() if self.state.weights is not None
                else None,
                "lr_scale": self.state.lr_scale}

    def _shuffled_epoch(self, epoch: int, hidden: torch.Tensor | None,
                        display: FitDisplay, last: bool) -> int:
        """Epoch `epoch` on this worker's part; the exchange before the next epoch (none
        after the last) runs meanwhile. Epoch 0 trains the first partition."""
        shuffle, per_rank = self.shuffle, self.batch_size // self.dp
        if self.local is None:   # this worker's part, read once
            self.local = list(self.data.take(shuffle.parts[self.worker]))
        if 0 < epoch and shuffle.epoch < epoch:   # not exchanged ahead: an earlier fit's
            self.local = shuffle.exchange(epoch, self.local, group=self.group)   # last epoch
        rows_of = {i: r for r, i in enumerate(shuffle.parts[self.worker])}
        orders = [[i for i in shuffle.local_order(w) if hidden is None or not hidden[i]]
                  for w in range(shuffle.workers)]
        steps = min(len(o) for o in orders) // per_rank
        if self.impact is not None and epoch > 0 and steps:   # on each worker's first batch
            self.compiled.use_loss(None)
            self.state.weights = impact_factors(
                self.compiled, self.data, self.shared, [o[:per_rank] for o in orders],
                self.impact.epsilon)
            self._use_remedies()
        tensors = self.local
        # the next epoch's exchange, overlapping this one's training
        handle = (shuffle.exchange(epoch + 1, tensors, group=self.group, async_op=True)
                  if not last else None)
        trained = 0
        for s in range(steps):
            mine = orders[self.worker][s * per_rank:(s + 1) * per_rank]
            rows = torch.tensor([rows_of[i] for i in mine], dtype=torch.long)
            everyone = [i for o in orders for i in o[s * per_rank:(s + 1) * per_rank]]
            batch = [t[rows.to(t.device)] for t in tensors]
            trained += self._step(everyone, mine, batch, epoch, display)
        if handle is not None:
            self.local = handle.wait()
        return trained

    def _remedy(self) -> RemedyLoss | None:
        """The loss of the remedies in force (None: the compiled one): distillation once
        there is a teacher, weights once there are impact factors."""
        teacher = self.distill is not None and self.state.teacher is not None
        weights = self.impact is not None and self.state.weights is not None
        if not (teacher or weights):
            return None
        return RemedyLoss(self.distill.gamma if teacher else 0.0,
                          self.distill.temperature if teacher else 2.0, weighted=weights)

    def _use_remedies(self) -> None:
        self.compiled.use_loss(self._remedy())   # captured again only when it changes

    def _batches(self, epoch: int):
        """Global batches of every sample (no sampler, no shuffle: distillation alone),
        a seeded permutation per epoch, the last partial batch dropped."""
        g = torch.Generator().manual_seed(1_000_003 * 7 + epoch)
        order = torch.randperm(self.data.size, generator=g).tolist()
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            yield order[start:start + self.batch_size]

    def _step(self, indices: Sequence[int], mine: Sequence[int], local: Any, epoch: int,
              display: FitDisplay) -> int:
        """One train_step on the global batch `indices` (in the order the statistics come
        back): built from the dataset, or with `local` (this rank's tensors of samples
        `mine`) this rank's part only."""
        inputs, targets = self.data.take(mine) if local is None else local
        remedy = self._remedy()
        if remedy is not None:
            teacher = weights = None
            if remedy.gamma > 0:
                teacher = self.state.teacher[torch.as_tensor(list(mine), dtype=torch.long)]
                teacher = teacher.to(targets.device)
            if remedy.weighted:   # this worker's samples (weights need a shuffle: local)
                weight = float(self.state.weights[self.worker]) * self.dp
                weights = torch.full((len(mine),), weight, device=targets.device)
            dtype = inputs.dtype if inputs.is_floating_point() else torch.float32
            targets = pack_targets(targets, teacher, weights, dtype)
        local = local is not None
        start = time.perf_counter()
        loss = float(self.compiled.train_step(inputs, targets, local=local,
                                              max_grad_norm=self.max_grad_norm))
        elapsed = time.perf_counter() - start
        if self.sampler is not None:
            stats = self.compiled.last_sample_stats.cpu()
            self.sampler.record(indices, stats[:, 0], stats[:, 1] > 0.5, stats[:, 2])
        result = self.result
        result.losses.append(loss)
        result.step_s.append(elapsed)
        result.lrs.append(_lr(self.compiled))
        tokens = batch_tokens(inputs) * (self.dp if local else 1)
        result.tokens += tokens
        result.seconds += elapsed
        display.step(self.compiled.step, epoch, loss, result.lrs[-1], elapsed, tokens)
        return len(indices)

    def _forward(self, samples: torch.Tensor, teacher: bool = False) -> int:
        """The forward of `samples` (eval mode, no gradients), in batches of the global
        batch size padded to a multiple of dp: the hidden samples' statistics recorded;
        with `teacher`, every sample's logits kept as the next epoch's teacher."""
        if samples.numel() == 0:
            return 0
        logits = [] if teacher else None
        hidden_mask = self.sampler.hidden if self.sampler is not None else None
        model, compiled = self.compiled.model, self.compiled
        was_training = model.training
        model.eval()
        try:
            for start in range(0, samples.numel(), self.batch_size):
                chunk = samples[start:start + self.batch_size]
                pad = (-chunk.numel()) % self.dp
                padded = torch.cat([chunk, chunk[-1:].expand(pad)]) if pad else chunk
                inputs, targets = self.data.take(padded)
                output = compiled(inputs)
                n = chunk.numel()
                if logits is not None:
                    logits.append(logits_of(output)[:n].detach().cpu())
                if hidden_mask is None:
                    continue
                keep = hidden_mask[chunk]   # visible ones keep their training statistics
                if keep.any():
                    stats = self.stats.stats(output, targets.to(compiled.device)).cpu()[:n]
                    self.sampler.record(chunk[keep], stats[keep, 0], stats[keep, 1] > 0.5,
                                        stats[keep, 2])
        finally:
            model.train(was_training)
        if logits is not None:
            self.state.teacher = torch.cat(logits)
        return samples.numel()

    def _scale_lr(self, scale: float) -> None:
        """The learning rates at `scale` × their unscaled values (relative to the scale
        in force): the optimizer's groups and the scheduler's base rates."""
        factor = scale / self.state.lr_scale
        if factor == 1.0:
            return
        optimizer, scheduler = self.compiled.optimizer, self.compiled.scheduler
        for group in optimizer.param_groups if optimizer is not None else ():
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]
        self.state.lr_scale = scale


# ---------------------------------------------------------------------- set-up
def _check(compiled: Any, data: Samples, epochs: int | None, sampler: Any, shuffle: Any,
           distill: Any, batch_size: int | None, save_every: int | None, save_dir: Any,
           resume: bool) -> int:
    if sampler is not None and not isinstance(sampler, HidingSampler):
        raise TrainingArgumentError(f"fit: sampler must be an ah.data.HidingSampler, got a "
                                    f"{type(sampler).__name__} (a torch sampler goes into "
                                    "the DataLoader you pass instead)")
    if distill is not None and not isinstance(distill, Distillation):
        raise TrainingArgumentError(f"fit: distill must be an ah.data.Distillation, got a "
                                    f"{type(distill).__name__}")
    if shuffle is not None and not isinstance(shuffle, PartialShuffle):
        raise TrainingArgumentError(f"fit: shuffle must be an ah.data.PartialShuffle, got a "
                                    f"{type(shuffle).__name__}")
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        raise TrainingArgumentError(f"fit(sampler=/shuffle=): epochs must be a positive int "
                                    f"(hiding and shuffling work epoch by epoch), got "
                                    f"{epochs!r}")
    for part in (sampler, shuffle):
        if part is not None and part.num_samples != data.size:
            raise TrainingArgumentError(
                f"fit: the {type(part).__name__} is for {part.num_samples} samples and the "
                f"dataset holds {data.size}")
    if sampler is not None:
        if batch_size is not None and batch_size != sampler.batch_size:
            raise TrainingArgumentError(f"fit: batch_size {batch_size} differs from the "
                                        f"sampler's {sampler.batch_size}")
        batch_size = sampler.batch_size
    if batch_size is None:
        raise TrainingArgumentError("fit(shuffle=/distill=): give batch_size=, the global "
                                    "batch")
    dp = compiled.plan.mesh.dp
    if shuffle is not None:
        if shuffle.workers != dp:
            raise TrainingArgumentError(
                f"fit: the PartialShuffle has {shuffle.workers} workers and the plan "
                f"{dp} data-parallel ranks: give PartialShuffle(..., workers={dp})")
        if batch_size % dp:
            raise TrainingArgumentError(
                f"fit(shuffle=...): the global batch {batch_size} must split evenly over "
                f"the {dp} data-parallel ranks, each training its own part's samples")
    for name, value in (("save_every", save_every), ("resume", resume or None)):
        if value is not None and save_dir is None:
            raise TrainingArgumentError(f"fit: {name}={value!r} needs save_dir=")
    return batch_size


def _exchange_group(compiled: Any) -> Any:
    """This rank's group for the shuffle's exchange: the members of its dp group, in a
    group of their own (so the exchange never interleaves with the training's
    collectives); every rank creates every such group, in order."""
    if not dist.is_initialized() or compiled.plan.mesh.dp == 1:
        return None
    mesh = compiled.plan.mesh
    ranks = torch.tensor([p.rank for p in compiled.plan.placement]).reshape(
        mesh.pp, mesh.dp, mesh.tp)
    return row_group(ranks.movedim(1, -1).reshape(-1, mesh.dp).tolist(), "dp (exchange)")


def _describe(log: dict[str, Any], total: int) -> str:
    visible = total - log["hidden"]
    line = (f"epoch {log['epoch']}: visible {visible}/{total} ({visible / total:.0%}), "
            f"hidden {log['hidden']}, trained {log['trained']}, exchanged "
            f"{log['exchanged']}, lr ×{log['lr_scale']:.3f}")
    if log["distilled"]:
        line += ", distilled"
    if log["impact"] is not None:
        line += ", impact " + " ".join(f"{a:.3f}" for a in log["impact"])
    return line


# ---------------------------------------------------------------------- checkpoints
def _save(compiled: Any, save_dir: Any, position: DataPosition, sampler: Any, shuffle: Any,
          distill: Any, state: _State, keep_last: int | None, display: FitDisplay) -> str:
    parts: dict[str, Any] = {"lr_scale": state.lr_scale}
    if distill is not None and state.teacher is not None:
        parts["teacher"] = encode_state(state.teacher, "the teacher's logits")
    if state.weights is not None:
        parts["impact"] = state.weights.tolist()
    if sampler is not None:
        parts["sampler"] = encode_state(sampler.state_dict(), "HidingSampler.state_dict()")
    if shuffle is not None:
        parts["shuffle"] = encode_state(shuffle.state_dict(), "PartialShuffle.state_dict()")
    path = compiled.save(save_dir, extra={"fit": position.to_extra(), "data": parts},
                         keep_last=keep_last)
    display.note(f"saved {path} (step {compiled.step}, epoch {position.epoch})")
    return str(path)


def _resume(compiled: Any, save_dir: Any, sampler: Any, shuffle: Any, distill: Any,
            state: _State) -> tuple[DataPosition, str | None]:
    from ..runtime.checkpoint import latest

    path = latest(save_dir)
    if path is None:
        return DataPosition(), None
    extra = compiled.load(path) or {}
    position = DataPosition.from_extra(extra.get("fit", {}), str(path))
    parts = extra.get("data")
    if parts is None or position.batches:
        raise TrainingArgumentError(
            f"fit(resume=True): {path} was not written at an epoch's end by a fit with "
            "sampler= or shuffle= (it holds no data parts): resume it with the fit that "
            "wrote it")
    for name, part in (("sampler", sampler), ("shuffle", shuffle)):
        if (part is None) != (name not in parts):
            raise TrainingArgumentError(
                f"fit(resume=True): {path} was written {'with' if name in parts else 'without'}"
                f" {name}=, and this fit is called {'with' if part is not None else 'without'}"
                " it: resume with the same parts")
        if part is not None:
            part.load_state_dict(decode_state(parts[name]))
    state.lr_scale = float(parts["lr_scale"])
    if distill is not None and "teacher" in parts:
        state.teacher = decode_state(parts["teacher"])
    if "impact" in parts:
        state.weights = torch.tensor(parts["impact"], dtype=torch.float32)
    return position, str(path)
