"""The training loop: `ah.compile(..., scheduler=...)` and `compiled.fit(loader, ...)`.

Process-free (one rank, in this process): the scheduler is stepped after every optimizer
step (not after an fp16 step skipped for overflow) and a factory that returns no
scheduler is refused; fit over lists, DataLoaders (set_epoch on the sampler) and one-shot
iterators trains what eager trains on the same batches, with what it shows (log lines, a
progress bar on a terminal) and its refusals of options that cannot work; the data
position's pieces (skipping, a loader's own state as JSON). With processes
(warm ranks): under dp2 and tp2 the learning rates, losses and gathered parameters equal
eager with the same scheduler, SGD and AdamW in float64, trained by train_step and by fit.
"""
from __future__ import annotations

import copy
import io
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import autohybrid as ah
from _equiv import (OPTIMIZERS, Failures, eager_step, lm_loss, report, state_of, zoo_batches,
                    zoo_model)
from _limits import guard
from _pool import launch
from autohybrid.runtime.fit_data import (DataPosition, decode_state, encode_state,
                                         epoch_batches)

LAUNCH_TIMEOUT_S = guard(150)


def warmup_cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warm-up over 2 steps, then cosine decay: the schedule LLM runs use."""
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[2])


def step_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _mlp_batches(n: int, batch: int = 4, seed: int = 0) -> list[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(batch, 16, generator=g, dtype=torch.float64),),
             torch.randint(0, 8, (batch,), generator=g)) for _ in range(n)]


def _compile_mlp(batches, optimizer=OPTIMIZERS["sgd"], scheduler=step_lr, **kw):
    model = zoo_model("mlp-tiny")
    ref = copy.deepcopy(model)
    compiled = ah.compile(model, ah.Cluster.local(1), batches[0][0], loss_fn=F.cross_entropy,
                          example_targets=batches[0][1], optimizer=optimizer,
                          scheduler=scheduler, **kw)
    return compiled, ref


def _eager(ref, batches, optimizer, scheduler) -> tuple[list[float], list[float]]:
    """Eager losses and learning rates (after each step) on `batches`."""
    opt = optimizer(list(ref.parameters()))
    sched = scheduler(opt)
    losses, lrs = [], []
    for inputs, targets in batches:
        losses.append(float(eager_step(ref, opt, lambda m, x, y: F.cross_entropy(m(*x), y),
                                       inputs, targets)))
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return losses, lrs


# ============================================================================ scheduler
@pytest.mark.timeout(120)
def test_scheduler_steps_after_each_optimizer_step_and_refuses_non_schedulers() -> None:
    batches = _mlp_batches(4)
    compiled, ref = _compile_mlp(batches, OPTIMIZERS["adamw"], warmup_cosine)
    assert compiled.scheduler.optimizer is compiled.optimizer
    lrs = []
    for inputs, targets in batches:
        compiled.train_step(inputs, targets)
        lrs.append(compiled.optimizer.param_groups[0]["lr"])
    eager_losses, eager_lrs = _eager(ref, batches, OPTIMIZERS["adamw"], warmup_cosine)
    assert lrs == pytest.approx(eager_lrs, rel=1e-12)
    assert compiled.scheduler.get_last_lr()[0] == pytest.approx(eager_lrs[-1], rel=1e-12)
    torch.testing.assert_close(compiled.full_state_dict(), state_of(ref))
    assert _compile_mlp(batches, scheduler=None)[0].scheduler is None
    # a new optimizer (what _adopt_train_layout builds when the training graph's stages or
    # shards differ from the forward's) gets a new scheduler on it
    before = compiled.scheduler
    compiled._make_optimizer()
    assert compiled.scheduler is not before
    assert compiled.scheduler.optimizer is compiled.optimizer

    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cases = [
        (lambda opt: "cosine", "not an LR scheduler"),
        (lambda opt: 1 / 0, "the factory raised ZeroDivisionError"),
        (lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "ReduceLROnPlateau"),
        (lambda opt: torch.optim.lr_scheduler.StepLR(other, 2), "another optimizer"),
        ("steplr", "scheduler must be a function"),
    ]
    for factory, message in cases:
        with pytest.raises(ah.TrainingArgumentError, match=message) as err:
            _compile_mlp(batches, scheduler=factory)
        assert "scheduler" in str(err.value) and "lambda opt" in str(err.value)
    with pytest.raises(ah.TrainingArgumentError, match="no optimizer= was given"):
        _compile_mlp(batches, optimizer=None)


@pytest.mark.timeout(120)
def test_scheduler_skips_an_fp16_step_skipped_for_overflow() -> None:
    """GradScaler.step skips the optimizer on overflow; the scheduler is not stepped then
    (as Hugging Face's Trainer does), so the schedule follows the steps taken."""
    torch.manual_seed(0)
    model = ah.models.preset("mlp-tiny")   # fp32 parameters: fp16 is mixed precision
    batches = [ah.models.example_batch("mlp-tiny", 8, seed=100 + s) for s in range(4)]
    compiled = ah.compile(model, ah.Cluster.local(1), batches[0][0], loss_fn=F.cross_entropy,
                          example_targets=batches[0][1], optimizer=OPTIMIZERS["sgd"],
                          scheduler=step_lr, dtype=torch.float16,
                          grad_scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 24,
                                                           backoff_factor=2.0 ** -8))
    taken = 0
    for inputs, targets in batches:
        compiled.train_step(inputs, targets)
        taken += not compiled.found_inf
        assert compiled.scheduler.last_epoch == taken
    assert 0 < taken < len(batches)   # the first step overflows at 2**24
    assert compiled.step == len(batches)


# ============================================================================ fit
class _EpochSampler(torch.utils.data.Sampler):
    """A sampler seeded per epoch (as DistributedSampler is), recording set_epoch."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch, self.calls = n, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.calls.append(epoch)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch))
                    .tolist())

    def __len__(self) -> int:
        return self.n


@pytest.mark.timeout(180)
def test_fit_trains_what_eager_trains_over_lists_dataloaders_and_iterators(capsys) -> None:
    batches = _mlp_batches(3)
    compiled, ref = _compile_mlp(batches)
    result = compiled.fit(batches, steps=7, log_every=3)   # 2 epochs and a third begun
    eager_losses, eager_lrs = _eager(ref, (batches * 3)[:7], OPTIMIZERS["sgd"], step_lr)
    assert result.losses == pytest.approx(eager_losses, rel=1e-12)
    assert result.lrs == pytest.approx(eager_lrs, rel=1e-12)
    assert (result.steps, result.start_step, result.step) == (7, 0, 7)
    assert (result.epoch, result.batches) == (2, 1)
    assert result.tokens == 7 * 4 and result.tokens_per_s > 0 and len(result.step_s) == 7
    assert compiled.optimizer.param_groups[0]["lr"] == pytest.approx(eager_lrs[-1])
    torch.testing.assert_close(compiled.full_state_dict(), state_of(ref))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["3/7", "6/7", "7/7"]
    assert "epoch 2" in lines[-1] and "tokens/s" in lines[-1] and "/step" in lines[-1]

    # a DataLoader: one epoch by default, its sampler's set_epoch called per epoch
    x = torch.randn(12, 16, dtype=torch.float64)
    y = torch.randint(0, 8, (12,))
    sampler = _EpochSampler(12)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, sampler=sampler)
    assert compiled.fit(loader, log_every=None).steps == 3 and sampler.calls == [0]
    result = compiled.fit(loader, epochs=2, log_every=None)
    assert (result.steps, result.step, result.epoch) == (6, 16, 2)
    assert sampler.calls == [0, 0, 1]
    assert capsys.readouterr().out == ""   # log_every=None: quiet

    # a one-shot iterator ends the run when it ends (steps not reached)
    result = compiled.fit(iter(batches), steps=100, log_every=None)
    assert (result.steps, result.step, result.epoch) == (3, 19, 1)
    result = compiled.fit((b for b in batches), epochs=5, log_every=None)
    assert result.steps == 3
    # steps already reached: nothing to train
    assert compiled.fit(batches, steps=5, log_every=None).steps == 0


@pytest.mark.timeout(120)
def test_fit_shows_a_progress_bar_on_a_terminal(monkeypatch) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    batches = _mlp_batches(2)
    compiled, _ = _compile_mlp(batches)
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    compiled.fit(batches, steps=4)
    text = out.getvalue()
    assert "\x1b[" in text                       # drawn with escape codes, not log lines
    assert "4/4" in text and "tokens/s" in text and "loss 2." in text and "/step" in text
    assert "step 4/4  epoch" not in text


@pytest.mark.timeout(120)
def test_fit_refuses_options_and_batches_that_cannot_work(tmp_path) -> None:
    batches = _mlp_batches(2)
    compiled, _ = _compile_mlp(batches)
    cases = [
        (dict(loader=batches, steps=2, save_every=1), "save_every=1 needs save_dir="),
        (dict(loader=batches, steps=2, resume=True), "resume=True needs save_dir="),
        (dict(loader=batches, steps=2, keep_last=2), "keep_last=2 needs save_dir="),
        (dict(loader=batches, steps=0), "steps must be a positive int"),
        (dict(loader=batches, epochs=1.5), "epochs must be a positive int"),
        (dict(loader=batches, steps=2, log_every=0), "log_every must be a positive int"),
        (dict(loader=iter(batches)), "pass steps=N"),
        (dict(loader=42, steps=2), "loader must be an iterable"),
        (dict(loader=[x for x, _ in batches], steps=2), "batch 0 of the loader is a tuple of 1"),
        (dict(loader=[batches[0][1]], steps=2), "batch 0 of the loader is a Tensor"),
        (dict(loader=[], steps=2), "yielded no batch in epoch 0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ah.TrainingArgumentError, match=message):
            compiled.fit(kwargs.pop("loader"), **{"log_every": None, **kwargs})
    assert compiled.step == 0   # nothing trained


# ============================================================================ data position
class _StatefulLoader:
    """A loader with its own state_dict / load_state_dict (as StatefulDataLoader)."""

    def __init__(self, batches: list) -> None:
        self.batches, self.start, self.served = batches, 0, 0

    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, len(self.batches)):
            self.served = i + 1
            yield self.batches[i]

    def state_dict(self) -> dict:
        return {"served": self.served, "generator": torch.Generator().manual_seed(3).get_state(),
                "window": (1, 2)}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["served"]


def test_data_position_skips_or_restores_the_loaders_own_state() -> None:
    data = list(range(7))
    assert list(epoch_batches(data, DataPosition(1, 4))) == [4, 5, 6]
    loader = _StatefulLoader(data)
    it = epoch_batches(loader, DataPosition(0, 0))
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    state = encode_state(loader.state_dict())
    state = json.loads(json.dumps(state))   # what a checkpoint's extra keeps
    decoded = decode_state(state)
    assert torch.equal(decoded["generator"], torch.Generator().manual_seed(3).get_state())
    assert decoded["window"] == [1, 2]
    assert list(epoch_batches(_StatefulLoader(data), DataPosition(0, 3), state)) == [3, 4, 5, 6]
    with pytest.raises(ah.TrainingArgumentError, match=r"loader.state_dict\(\)\['f'\] is a"):
        encode_state({"f": object()})
    with pytest.raises(ah.TrainingArgumentError, match="has the key 3"):
        encode_state({3: 1})


# ============================================================================ processes
SEQ_BATCHES, BATCH = 4, 8
CASES = {  # name: (constraints, optimizer, scheduler, loader kind)
    "dp2/sgd/steplr/list": (ah.Constraints(dp=2, tp=1, pp=1), "sgd", step_lr, "list"),
    "tp2/adamw/warmup-cosine/dataloader": (ah.Constraints(dp=1, tp=2, pp=1), "adamw",
                                           warmup_cosine, "dataloader"),
}


def _loader(kind: str):
    """4 batches of gpt-tiny (float64 model): a list, or a DataLoader whose sampler
    shuffles per epoch (set_epoch), so that the resumed epoch's order matters."""
    batches = zoo_batches("gpt-tiny", BATCH, steps=SEQ_BATCHES)
    if kind == "list":
        return batches
    x = torch.cat([inputs[0] for inputs, _ in batches])
    y = torch.cat([targets for _, targets in batches])
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=_EpochSampler(len(x)))


def _compile_gpt(case: str, seed: int = 0):
    constraints, optimizer, scheduler, kind = CASES[case]
    loader = _loader(kind)
    (inputs,), targets = zoo_batches("gpt-tiny", BATCH, steps=1)[0]
    model = zoo_model("gpt-tiny", seed=0)
    torch.manual_seed(seed)   # the generator a resume must take from the checkpoint
    compiled = ah.compile(model, ah.Cluster.local(2), (inputs,), loss_fn=lm_loss,
                          example_targets=targets, optimizer=OPTIMIZERS[optimizer],
                          scheduler=scheduler, constraints=constraints)
    return compiled, loader


def _eager_fit(case: str, steps: int) -> tuple[list[float], list[float], dict]:
    """Eager training over the loader's epochs, as fit walks them."""
    _, optimizer, scheduler, kind = CASES[case]
    ref, loader = zoo_model("gpt-tiny", seed=0), _loader(kind)
    opt = OPTIMIZERS[optimizer](list(ref.parameters()))
    sched = scheduler(opt)
    losses, lrs, epoch = [], [], 0
    while len(losses) < steps:
        if hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)
        for inputs, targets in loader:
            inputs = inputs if isinstance(inputs, tuple) else (inputs,)
            losses.append(float(eager_step(ref, opt, lambda m, x, y: lm_loss(m(*x), y),
                                           inputs, targets)))
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            if len(losses) == steps:
                break
        epoch += 1
    return losses, lrs, state_of(ref)


def _fit_rank(rank: int, directory: str) -> list[str]:
    """Per case: fit 6 steps uninterrupted (resume=True on an empty save_dir: a fresh
    start) against eager; fit to step 3 (save_every=2, keep_last=1), then a new compile
    and fit(resume=True) to step 6 against the uninterrupted run."""
    fails = Failures()
    for i, case in enumerate(CASES):
        whole_dir, split_dir = f"{directory}/{i}-whole", f"{directory}/{i}-split"
        compiled, loader = _compile_gpt(case)
        whole = compiled.fit(loader, steps=6, save_dir=whole_dir, resume=True, log_every=None)
        fails.check(f"{case}: a resume without a checkpoint starts afresh "
                    f"({whole.resumed_from}, {whole.start_step})",
                    whole.resumed_from is None and whole.start_step == 0)
        losses, lrs, state = _eager_fit(case, 6)
        fails.close(f"{case} losses vs eager", torch.tensor(whole.losses), torch.tensor(losses))
        fails.close(f"{case} learning rates vs eager", torch.tensor(whole.lrs),
                    torch.tensor(lrs))
        fails.close_dict(f"{case} parameters vs eager", compiled.full_state_dict(), state)
        fails.check(f"{case}: lrs change ({lrs})", len(set(lrs)) > 2)
        whole_state = compiled.full_state_dict()

        compiled, loader = _compile_gpt(case)
        first = compiled.fit(loader, steps=3, save_dir=split_dir, save_every=2, keep_last=1,
                             log_every=None)
        fails.check(f"{case}: checkpoints {first.checkpoints}",
                    [p.rsplit("/", 1)[1] for p in first.checkpoints]
                    == ["step-00000002", "step-00000003"])
        saved = sorted(p.name for p in Path(split_dir).iterdir())
        fails.check(f"{case}: keep_last=1 left {saved}", saved == ["step-00000003"])

        compiled, loader = _compile_gpt(case, seed=1234)
        second = compiled.fit(loader, steps=6, save_dir=split_dir, resume=True, log_every=None)
        fails.check(f"{case}: resumed from {second.resumed_from} at {second.start_step}",
                    str(second.resumed_from).endswith("step-00000003")
                    and second.start_step == 3 and second.steps == 3)
        fails.check(f"{case}: data position {second.epoch}, {second.batches}",
                    (second.epoch, second.batches) == (1, 2))
        fails.close(f"{case} resumed losses", torch.tensor(second.losses),
                    torch.tensor(whole.losses[3:]))
        fails.close(f"{case} resumed learning rates", torch.tensor(second.lrs),
                    torch.tensor(whole.lrs[3:]))
        fails.close_dict(f"{case} resumed parameters", compiled.full_state_dict(), whole_state)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_fit_and_scheduler_under_dp2_and_tp2_equal_eager_and_resume_exactly(tmp_path) -> None:
    results = launch(_fit_rank, 2, args=(str(tmp_path),), timeout_s=guard(240))
    assert not any(results), report(results)


@pytest.mark.timeout(180)
def test_fit_resumes_a_stateful_loader_from_its_own_state(tmp_path) -> None:
    """One rank, checkpoints in this process: fit to step 3 (the loader's state_dict in
    the checkpoint), a new compile and loader, fit(resume=True) to step 5: the loader is
    restored by load_state_dict (not skipped), and the losses are the uninterrupted run's."""
    batches = _mlp_batches(4)
    whole = _compile_mlp(batches, OPTIMIZERS["adamw"], warmup_cosine)[0].fit(
        _StatefulLoader(batches), steps=5, log_every=None)
    compiled, _ = _compile_mlp(batches, OPTIMIZERS["adamw"], warmup_cosine)
    first = compiled.fit(_StatefulLoader(batches), steps=3, save_dir=tmp_path, log_every=None)
    compiled, _ = _compile_mlp(batches, OPTIMIZERS["adamw"], warmup_cosine)
    loader = _StatefulLoader(batches)
    restored = []
    loader.load_state_dict = lambda state: (restored.append(state),
                                            _StatefulLoader.load_state_dict(loader, state))
    second = compiled.fit(loader, steps=5, save_dir=tmp_path, resume=True, log_every=None)
    assert restored and restored[0]["served"] == 3 and torch.equal(
        restored[0]["generator"], torch.Generator().manual_seed(3).get_state())
    assert first.losses + second.losses == pytest.approx(whole.losses, rel=1e-12)
    assert second.lrs == pytest.approx(whole.lrs[3:], rel=1e-12)
    assert (second.epoch, second.batches) == (1, 1)
