"""The training loop users expect: `compiled.fit(loader, ...)`, and the LR scheduler check.

Owns the loop over a loader's batches (steps, epochs, the data position: fit_data.py),
when to write a checkpoint and what to resume from (through `compiled.save` /
`compiled.load`, runtime/checkpoint.py, which own what a checkpoint holds), and what rank
0 shows (report/fit_progress.py). A step is `compiled.train_step`; the loop never touches
the model's state itself. It takes a CompiledModel without importing compiled.py (the
layer above): every rank runs it, on the same batches.

`build_scheduler` checks what `ah.compile(..., scheduler=...)`'s factory returns;
compiled.py steps the scheduler after each optimizer step.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..errors import AutohybridError, TrainingArgumentError
from ..report.fit_progress import FitDisplay
from .fit_data import (DataPosition, as_batch, batch_tokens, encode_state, epoch_batches,
                       is_one_shot, is_stateful)

SCHEDULER_EXAMPLE = ("scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, "
                     "lambda step: min(1.0, (step + 1) / 100))")


def build_scheduler(factory: Callable[[torch.optim.Optimizer], Any],
                    optimizer: torch.optim.Optimizer) -> Any:
    """`factory(optimizer)`, checked to be an LR scheduler built on `optimizer`."""
    try:
        scheduler = factory(optimizer)
    except AutohybridError:
        raise
    except Exception as exc:
        raise TrainingArgumentError(
            f"scheduler: the factory raised {type(exc).__name__}: {exc}. It is called with "
            f"compiled.optimizer (a {type(optimizer).__name__}) and must return an LR "
            f"scheduler built on it, e.g. {SCHEDULER_EXAMPLE}") from exc
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TrainingArgumentError(
            "scheduler: ReduceLROnPlateau steps on a metric (an evaluation loss), and "
            "train_step steps the scheduler once per optimizer step without one: build it "
            "yourself on compiled.optimizer and call .step(metric) after evaluating, or "
            f"pass a per-step schedule, e.g. {SCHEDULER_EXAMPLE}")
    missing = [m for m in ("step", "state_dict", "load_state_dict", "get_last_lr")
               if not callable(getattr(scheduler, m, None))]
    if missing:
        raise TrainingArgumentError(
            f"scheduler: the factory returned a {type(scheduler).__name__}, not an LR "
            f"scheduler (it has no {', '.join(missing)}): return a torch.optim.lr_scheduler "
            f"object built on the optimizer it is given, e.g. {SCHEDULER_EXAMPLE}")
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise TrainingArgumentError(
            "scheduler: the factory returned a scheduler of another optimizer than the one "
            "it was given (compiled.optimizer, which steps this rank's shards): build it on "
            f"its argument, e.g. {SCHEDULER_EXAMPLE}")
    return scheduler


@dataclass
class FitResult:
    """What one `fit` call did (the same on every rank)."""
    losses: list[float] = field(default_factory=list)  # one per train_step of this call
    step_s: list[float] = field(default_factory=list)  # each train_step's wall time
    lrs: list[float] = field(default_factory=list)  # param group 0's lr after each step
    start_step: int = 0      # compiled.step when the loop began (after a resume's load)
    step: int = 0            # compiled.step at the end
    epoch: int = 0           # the data position at the end: epochs completed,
    batches: int = 0         # and batches consumed in the current epoch
    tokens: int = 0          # tokens trained on (fit_data.batch_tokens)
    seconds: float = 0.0     # time in train_step
    checkpoints: list[str] = field(default_factory=list)  # written by this call
    resumed_from: str | None = None

    @property
    def steps(self) -> int:
        """train_steps this call ran."""
        return len(self.losses)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "steps": self.steps, "tokens_per_s": self.tokens_per_s}


def fit(compiled: Any, loader: Iterable, *, steps: int | None = None,
        epochs: int | None = None, save_every: int | None = None,
        save_dir: str | Path | None = None, resume: bool = False,
        keep_last: int | None = None, max_grad_norm: float | None = None,
        log_every: int | None = 10) -> FitResult:
    """Train `compiled` on `loader`'s (inputs, targets) batches; call it on every rank.

    Runs until `compiled.step` (train_steps completed, counting those before a resume)
    reaches `steps`, or the data position reaches `epochs` epochs, whichever comes
    first; without either, one epoch of a re-iterable loader. A re-iterable loader (a
    list, a DataLoader) is iterated again for each epoch; a one-shot iterator ends the
    run when it ends. With `save_dir`, a checkpoint (`compiled.save`, its `extra`
    holding the data position) every `save_every` steps and at the end, `keep_last`
    kept; `resume=True` first loads the latest one under `save_dir` if there is one
    (else starts afresh) and skips the batches it had consumed (fit_data.py: what a
    resume reproduces). Rank 0 shows a progress bar on a terminal, a line every
    `log_every` steps otherwise (None: quiet)."""
    _check_options(loader, steps, epochs, save_every, save_dir, resume, keep_last, log_every)
    if steps is None and epochs is None:
        epochs = 1
    position, loader_state, result = DataPosition(), None, FitResult()
    if resume:
        position, loader_state, result.resumed_from = _resume(compiled, save_dir, loader)
    result.start_step = saved_at = compiled.step
    one_shot = is_one_shot(loader)
    display = FitDisplay(compiled.rank == 0, steps, compiled.step, log_every)
    with display:
        if result.resumed_from:
            display.note(f"resumed from {result.resumed_from} at step {compiled.step}, "
                         f"epoch {position.epoch}, batch {position.batches}")
        while not _done(compiled, steps, epochs, position):
            ended = True
            for batch in epoch_batches(loader, position, loader_state):
                inputs, targets = as_batch(batch, position.batches)
                start = time.perf_counter()
                loss = float(compiled.train_step(inputs, targets, max_grad_norm=max_grad_norm))
                elapsed = time.perf_counter() - start
                position.batches += 1
                result.losses.append(loss)
                result.step_s.append(elapsed)
                lr = _lr(compiled)
                result.lrs.append(lr)
                tokens = batch_tokens(inputs)
                result.tokens += tokens
                result.seconds += elapsed
                last = steps is not None and compiled.step >= steps
                display.step(compiled.step, position.epoch, loss, lr, elapsed, tokens, last)
                if save_every is not None and compiled.step % save_every == 0:
                    result.checkpoints.append(_save(compiled, save_dir, position, loader,
                                                    keep_last, display))
                    saved_at = compiled.step
                if last:
                    ended = False
                    break
            if ended and position.batches == 0 and loader_state is None:
                raise TrainingArgumentError(
                    f"fit: the loader yielded no batch in epoch {position.epoch}: give it "
                    "data (a DataLoader over an empty dataset, or drop_last=True with fewer "
                    "samples than batch_size, yields none)")
            loader_state = None  # restored once: later epochs start from the beginning
            if ended:
                position = DataPosition(position.epoch + 1, 0)
                if one_shot:
                    break
    if save_dir is not None and saved_at != compiled.step:
        result.checkpoints.append(_save(compiled, save_dir, position, loader, keep_last,
                                        display))
    result.step, result.epoch, result.batches = compiled.step, position.epoch, position.batches
    return result


def _lr(compiled: Any) -> float:
    """The learning rate of the optimizer's first param group (nan without one)."""
    optimizer = compiled.optimizer
    if optimizer is None or not optimizer.param_groups:
        return float("nan")
    return float(optimizer.param_groups[0]["lr"])


def _done(compiled: Any, steps: int | None, epochs: int | None,
          position: DataPosition) -> bool:
    return ((steps is not None and compiled.step >= steps)
            or (epochs is not None and position.epoch >= epochs))


def _check_options(loader: Any, steps: int | None, epochs: int | None,
                   save_every: int | None, save_dir: Any, resume: bool,
                   keep_last: int | None, log_every: int | None) -> None:
    """Typed errors for options that cannot work, before anything trains."""
    try:
        iter(loader) if not is_one_shot(loader) else None
    except TypeError:
        raise TrainingArgumentError(
            f"fit: loader must be an iterable of (inputs, targets) batches (a list, a "
            f"DataLoader, a generator), got a {type(loader).__name__}") from None
    for name, value in (("steps", steps), ("epochs", epochs), ("save_every", save_every),
                        ("keep_last", keep_last), ("log_every", log_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise TrainingArgumentError(f"fit: {name} must be a positive int or None, got "
                                        f"{value!r}")
    if steps is None and epochs is None and is_one_shot(loader):
        raise TrainingArgumentError(
            "fit: a one-shot iterator (a generator) has no epochs to count and fit cannot "
            "tell how long it runs: pass steps=N (or epochs=1 to train until it ends)")
    for name, value in (("save_every", save_every), ("keep_last", keep_last),
                        ("resume", resume or None)):
        if value is not None and save_dir is None:
            raise TrainingArgumentError(f"fit: {name}={value!r} needs save_dir=, the "
                                        "directory checkpoints are written to and resumed "
                                        "from")


def _resume(compiled: Any, save_dir: Any, loader: Any) -> tuple[DataPosition, Any, str | None]:
    """The data position (and the loader's own state) of the latest checkpoint under
    `save_dir`, loaded into `compiled`; a fresh start when there is none."""
    from .checkpoint import latest

    path = latest(save_dir)
    if path is None:
        return DataPosition(), None, None
    extra = compiled.load(path) or {}
    saved = extra.get("fit")
    if saved is None:
        if compiled.rank == 0:
            warnings.warn(f"fit(resume=True): {path} holds no data position (it was not "
                          "written by fit): the loader starts from its first batch",
                          stacklevel=3)
        return DataPosition(), None, str(path)
    position = DataPosition.from_extra(saved, str(path))
    state = saved.get("loader") if is_stateful(loader) else None
    return position, state, str(path)


def _save(compiled: Any, save_dir: Any, position: DataPosition, loader: Any,
          keep_last: int | None, display: FitDisplay) -> str:
    fit_extra: dict[str, Any] = position.to_extra()
    if is_stateful(loader):
        fit_extra["loader"] = encode_state(loader.state_dict())
    path = compiled.save(save_dir, extra={"fit": fit_extra}, keep_last=keep_last)
    display.note(f"saved {path} (step {compiled.step})")
    return str(path)
