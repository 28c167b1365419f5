"""Determinism: the same model, cluster and options give a byte-identical plan JSON (in
one process and across fresh processes with other hash seeds), and the same seed gives
bitwise-identical losses in two runs of the same plan (one process, and 2 ranks).

tests/test_plan.py checks a forward-graph plan searched twice; here the training graph
with pinned tp and pp (shardings, stage boundaries, schedule: the fields a search fills
from dicts and sets), the CLI in two processes, and training runs.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch
from autohybrid import models


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def _plan(constraints: ah.Constraints | None) -> str:
    model = models.preset("gpt-tiny", device="meta")
    (x,), y = models.example_batch(model, 8)
    return ah.plan(model, ah.Cluster.local(4), (x,), loss_fn=_loss, example_targets=y,
                   constraints=constraints, model_ref="gpt-tiny").to_json()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("constraints", [None, ah.Constraints(tp=2, pp=2, schedule="1f1b")],
                         ids=["searched", "tp2-pp2"])
def test_two_plan_calls_give_byte_identical_json(constraints) -> None:
    assert _plan(constraints) == _plan(constraints)


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_cli_plan_json_is_byte_identical_across_processes() -> None:
    procs = []
    for seed in ("1", "2"):  # string hashing differs between the two processes
        env = {**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "autohybrid.cli", "plan",
                                       "gpt-tiny", "--cluster", "local:4", "--json"],
                                      env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    outputs = []
    try:
        for proc in procs:  # side by side
            out, err = proc.communicate(timeout=guard(120))
            assert proc.returncode == 0, err.decode()
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert outputs[0] == outputs[1] and outputs[0].startswith(b"{")


def _train(world: int, plan: ah.Plan | None, steps: int = 3) -> tuple[list[float], ah.Plan]:
    torch.manual_seed(0)
    model = models.preset("gpt-tiny", dropout=0.1)  # dropout: the generator matters too
    batches = [models.example_batch(model, 8, seed=s) for s in range(steps)]
    (x,), y = batches[0]
    compiled = ah.compile(model, ah.Cluster.local(world), (x,), loss_fn=_loss,
                          example_targets=y, plan=plan,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    losses = [compiled.train_step(inputs, targets).item() for inputs, targets in batches]
    return losses, compiled.plan


@pytest.mark.timeout(120)
def test_same_seed_same_plan_gives_bitwise_equal_losses() -> None:
    first, plan = _train(1, None)
    again, _ = _train(1, plan)
    assert [x.hex() for x in first] == [x.hex() for x in again]


def _train_on_rank(rank: int, plan_json: str | None) -> tuple[list[float], str]:
    losses, plan = _train(2, ah.Plan.from_json(plan_json) if plan_json else None)
    return losses, plan.to_json()


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_same_seed_same_plan_gives_bitwise_equal_losses_on_two_ranks() -> None:
    first = launch(_train_on_rank, 2, args=(None,), timeout_s=guard(90))
    plan_json = first[0][1]
    again = launch(_train_on_rank, 2, args=(plan_json,), timeout_s=guard(90))
    hexes = [[x.hex() for x in losses] for losses, _ in first + again]
    assert all(h == hexes[0] for h in hexes)
