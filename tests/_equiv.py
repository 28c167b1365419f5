"""Helpers for equivalence tests: compiled training vs single-process eager training.

Rank functions run many cases inside one `ah.launch` (starting ranks and warming up
torch.export costs far more than a tiny model's step). Each case trains a compiled model
and an independent eager copy of it side by side on the same global batches, and records
every mismatch in a `Failures` list instead of raising, so that one run reports all of
them; the test process then asserts that every rank's list is empty. Exceptions are not
caught: a rank that raises makes `ah.launch` raise `RankFailure` with its traceback.

The eager side never goes through autohybrid: it is `loss.backward()` on the whole batch
and the optimizer built by the same factory over the copy's parameters.
"""
from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah

from _procs import is_dead, live_children  # noqa: F401  (re-exported for the tests)

ZOO = ("mlp-tiny", "gpt-tiny", "llama-tiny", "resnet-tiny")

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
}

Batch = tuple[tuple[torch.Tensor, ...], Any]   # (inputs, targets)


# ----------------------------------------------------------------------------- comparing
class Failures(list):
    """Mismatches found on this rank, as readable lines (picklable: a list of str)."""

    def close(self, what: str, actual: Any, expected: Any) -> None:
        """`torch.testing.assert_close` (default tolerances), recorded instead of raised."""
        try:
            torch.testing.assert_close(actual, expected)
        except AssertionError as exc:
            self.append(f"{what}: {exc}")

    def close_dict(self, what: str, actual: dict, expected: dict) -> None:
        if set(actual) != set(expected):
            self.append(f"{what}: keys differ: only compiled {sorted(set(actual) - set(expected))}"
                        f", only eager {sorted(set(expected) - set(actual))}")
        for key in expected:
            if key in actual:
                if (actual[key] is None) != (expected[key] is None):
                    self.append(f"{what}[{key}]: compiled {_describe(actual[key])}, eager "
                                f"{_describe(expected[key])}")
                elif expected[key] is not None:
                    self.close(f"{what}[{key}]", actual[key], expected[key])

    def check(self, what: str, ok: bool) -> None:
        if not ok:
            self.append(what)


def _describe(t: Any) -> str:
    return "None" if t is None else f"tensor{tuple(t.shape)}"


def report(results: Sequence[Sequence[str]]) -> str:
    """Every rank's failures, for an assertion message."""
    lines = [f"rank {r}: {line}" for r, fails in enumerate(results) for line in fails]
    return f"{len(lines)} mismatch(es):\n" + "\n".join(lines[:60])


# ----------------------------------------------------------------------------- eager side
def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.detach().clone() if p.grad is not None else None)
            for n, p in model.named_parameters()}


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def default_eager_loss(loss_fn: Callable) -> Callable:
    return lambda model, inputs, targets: loss_fn(model(*inputs), targets)


def eager_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, eager_loss: Callable,
               inputs: tuple, targets: Any, max_grad_norm: float | None = None
               ) -> torch.Tensor:
    """One eager step on the whole batch: zero_grad, backward, clip, step; the loss."""
    for p in model.parameters():
        p.grad = None
    loss = eager_loss(model, inputs, targets)
    loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if optimizer is not None:
        optimizer.step()
    return loss.detach()


# ----------------------------------------------------------------------------- one case
def train_and_compare(fails: Failures, name: str, model: nn.Module, batches: Sequence[Batch],
                      world: int, *, loss_fn: Callable | None,
                      optimizer: Callable | None = OPTIMIZERS["sgd"],
                      eager_loss: Callable | None = None,
                      constraints: ah.Constraints | None = None,
                      max_grad_norm: float | None = None,
                      scheduler: Callable | None = None,
                      example: Batch | None = None, example_targets: bool = True,
                      cluster: ah.Cluster | None = None):
    """Train `model` compiled for `world` ranks and an eager copy on `batches`; compare
    the loss, the gathered gradients and the parameters + buffers after every step.

    `example` (default: the first batch) is what `ah.compile` plans and captures with;
    `example_targets=False` leaves the targets to be captured at the first step.
    `cluster` (default: `ah.Cluster.local(world)`) is what it plans for.
    Returns `(compiled, eager_model)` for further checks.
    """
    ref = copy.deepcopy(model)
    inputs0, targets0 = example or batches[0]
    compiled = ah.compile(model, cluster or ah.Cluster.local(world), inputs0, loss_fn=loss_fn,
                          example_targets=targets0 if example_targets else None,
                          optimizer=optimizer, constraints=constraints)
    ref_opt = optimizer(list(ref.parameters())) if optimizer else None
    compare_training(fails, name, compiled, ref, ref_opt, batches,
                     eager_loss or default_eager_loss(loss_fn), max_grad_norm=max_grad_norm,
                     scheduler=scheduler)
    return compiled, ref


def compare_training(fails: Failures, name: str, compiled, ref: nn.Module,
                     ref_opt: torch.optim.Optimizer | None, batches: Sequence[Batch],
                     eager_loss: Callable, *, max_grad_norm: float | None = None,
                     scheduler: Callable | None = None, seed: int | None = None) -> None:
    """Step `compiled` and the eager `ref` (with `ref_opt`) on each batch; compare.
    `seed`: both sides start step k from `torch.manual_seed(seed + k)` (dropout)."""
    schedulers = (scheduler(compiled.optimizer), scheduler(ref_opt)) if scheduler else ()
    for step, (inputs, targets) in enumerate(batches):
        if seed is not None:
            torch.manual_seed(seed + step)
        loss = compiled.train_step(inputs, targets, max_grad_norm=max_grad_norm)
        if seed is not None:
            torch.manual_seed(seed + step)
        expected = eager_step(ref, ref_opt, eager_loss, inputs, targets, max_grad_norm)
        where = f"{name} step {step}"
        fails.close(f"{where} loss", loss, expected)
        fails.close_dict(f"{where} grads", compiled.full_grads(), grads_of(ref))
        fails.close_dict(f"{where} state", compiled.full_state_dict(), state_of(ref))
        for s in schedulers:
            s.step()


# ----------------------------------------------------------------------------- data
def lm_loss(logits: torch.Tensor, targets: torch.Tensor, **kw: Any) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), **kw)


def zoo_loss(name: str) -> Callable:
    return lm_loss if name in ("gpt-tiny", "llama-tiny") else F.cross_entropy


def zoo_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ah.models.preset(name).double()


def zoo_batches(name: str, batch: int, steps: int = 3, seq: int | None = None) -> list[Batch]:
    """`steps` different global batches (float inputs in float64)."""
    out = []
    for step in range(steps):
        inputs, targets = ah.models.example_batch(name, batch, seq=seq, seed=100 + step,
                                                  dtype=torch.float64)
        out.append((inputs, targets))
    return out


def head(batch: Batch, n: int) -> Batch:
    """The first `n` samples of a batch (an example batch the planner can divide)."""
    inputs, targets = batch
    return tuple(t[:n] for t in inputs), targets[:n]


def shard_sizes(n: int, parts: int) -> list[int]:
    """How a batch of `n` splits over `parts` ranks (`torch.tensor_split`)."""
    return [len(t) for t in torch.tensor_split(torch.arange(n), parts)]


# ----------------------------------------------------------------------------- processes
def wait_dead(pids: Sequence[int], timeout_s: float = 5.0) -> list[int]:
    """The pids still alive after waiting up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(is_dead(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not is_dead(p)]


def record_pid(directory: str, rank: int) -> None:
    Path(directory, f"rank{rank}.pid").write_text(str(os.getpid()))
