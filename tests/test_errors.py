"""Every bad input gives a typed error (an `ah.AutohybridError`) naming the culprit.

Unknown presets, a cluster that does not match the processes launched, invalid plan
files, ranks holding different plans, inputs whose shape does not fit the model, and
train_step called with the wrong tensors. Multi-rank cases run under `ah.launch` (fork,
gloo) with a launch timeout and a collective timeout, so a mistake fails instead of hangs.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from autohybrid import models

LAUNCH_TIMEOUT_S = guard(90)


@pytest.fixture(autouse=True)
def _short_collective_timeout(monkeypatch) -> None:
    monkeypatch.setenv("AUTOHYBRID_COLLECTIVE_TIMEOUT_S", "30")


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def _gpt_tiny_batch():
    return models.example_batch("gpt-tiny", 4)


# --------------------------------------------------------------------------- presets


@pytest.mark.timeout(30)
def test_every_error_is_an_autohybrid_error() -> None:
    for cls in (ah.CaptureError, ah.ClusterError, ah.PlanError, ah.NoPlanFitsError,
                ah.NotExecutableError, ah.RuntimeFailure, ah.RankFailure):
        assert issubclass(cls, ah.AutohybridError)
    assert issubclass(ah.NoPlanFitsError, ah.PlanError)
    assert issubclass(ah.NotExecutableError, ah.PlanError)


@pytest.mark.timeout(30)
def test_unknown_cluster_preset_names_the_closest() -> None:
    with pytest.raises(ah.ClusterError) as err:
        ah.Cluster.preset("dgx-a1000")
    text = str(err.value)
    # names a known preset as the closest (hardware.closest_name picks 'dgx-v100' here, not
    # 'dgx-a100-*': see the test report) and lists every known preset
    closest = text.split("closest: '")[1].split("'")[0]
    assert "'dgx-a1000'" in text and closest in ah.cluster.PRESETS
    assert all(name in text for name in ah.cluster.PRESETS)
    with pytest.raises(ah.ClusterError, match="closest: 'dgx-h100'"):
        ah.Cluster.parse("dgx-h10")
    with pytest.raises(ah.ClusterError, match="local:N"):
        ah.Cluster.parse("local:zero")


@pytest.mark.timeout(30)
def test_unknown_model_preset_names_close_matches() -> None:
    # models.preset raises ValueError (not an AutohybridError yet; see the test report)
    with pytest.raises(Exception) as err:
        models.preset("gpt-tinyy")
    assert "'gpt-tinyy'" in str(err.value) and "'gpt-tiny'" in str(err.value)
    with pytest.raises(Exception, match="llama3-70b"):
        models.preset("llama3-7b")


# --------------------------------------------------------------------------- clusters


def _compile_for_four_ranks(rank: int) -> None:
    model = models.preset("gpt-tiny")
    inputs, targets = _gpt_tiny_batch()
    ah.compile(model, ah.Cluster.local(4), inputs, loss_fn=_loss, example_targets=targets)


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_cluster_world_size_must_match_the_processes_launched() -> None:
    with pytest.raises(ah.RankFailure) as err:
        ah.launch(_compile_for_four_ranks, ah.Cluster.local(2), timeout_s=LAUNCH_TIMEOUT_S)
    text = str(err.value)
    assert "ClusterError" in err.value.traceback_text
    assert "world_size 4" in text and "2 processes" in text


@pytest.mark.timeout(60)
def test_several_ranks_without_torch_distributed_is_a_cluster_error() -> None:
    model = models.preset("gpt-tiny")
    inputs, targets = _gpt_tiny_batch()
    with pytest.raises(ah.ClusterError, match="ah.launch"):
        ah.compile(model, ah.Cluster.local(2), inputs, loss_fn=_loss, example_targets=targets)
    with pytest.raises(ah.AutohybridError, match="ah.Cluster"):
        ah.compile(model, "local:1", inputs, loss_fn=_loss)


# --------------------------------------------------------------------------- plans


@pytest.mark.timeout(60)
def test_invalid_plan_files(tmp_path) -> None:
    model = models.preset("gpt-tiny")
    inputs, _ = _gpt_tiny_batch()
    plan = ah.plan(model, ah.Cluster.local(1), inputs)

    not_json = tmp_path / "plan.json"
    not_json.write_text(plan.to_json()[:-20])  # truncated
    with pytest.raises(ah.PlanError, match="not valid JSON"):
        ah.Plan.from_json(not_json)

    data = json.loads(plan.to_json())
    data["version"] = 99
    wrong_version = tmp_path / "v99.json"
    wrong_version.write_text(json.dumps(data))
    with pytest.raises(ah.PlanError, match="version 99"):
        ah.Plan.from_json(wrong_version)

    with pytest.raises(ah.PlanError, match="missing.json"):
        ah.Plan.from_json(tmp_path / "missing.json")


def _compile_with_own_plan(rank: int, plans: list) -> str | None:
    model = models.preset("gpt-tiny")
    inputs, targets = _gpt_tiny_batch()
    try:
        ah.compile(model, ah.Cluster.local(2), inputs, loss_fn=_loss, example_targets=targets,
                   plan=plans[rank])
    except ah.PlanError as exc:
        return str(exc)
    return None


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_ranks_holding_different_plans_all_raise_naming_the_ranks() -> None:
    model = models.preset("gpt-tiny")
    inputs, _ = _gpt_tiny_batch()
    plan = ah.plan(model, ah.Cluster.local(2), inputs, executable_only=True)
    other = dataclasses.replace(plan, bucket_mb=plan.bucket_mb / 5)
    assert other.hash() != plan.hash()
    messages = ah.launch(_compile_with_own_plan, ah.Cluster.local(2), args=([plan, other],),
                         timeout_s=LAUNCH_TIMEOUT_S)
    for message in messages:  # every rank raised PlanError
        assert message is not None
        assert f"rank 0: {plan.hash()}" in message and f"rank 1: {other.hash()}" in message


# --------------------------------------------------------------------------- inputs


@pytest.mark.timeout(60)
def test_compile_with_inputs_that_do_not_fit_the_model() -> None:
    model = models.preset("mlp-tiny")  # 16 input features
    with pytest.raises(ah.CaptureError) as err:
        ah.compile(model, ah.Cluster.local(1), (torch.randn(4, 17),), loss_fn=F.cross_entropy,
                   example_targets=torch.randint(0, 8, (4,)))
    assert "layers.0" in str(err.value) and "example_inputs" in str(err.value)


@pytest.mark.timeout(60)
def test_train_step_with_the_wrong_tensors() -> None:
    model = models.preset("mlp-tiny")
    x, y = torch.randn(4, 16), torch.randint(0, 8, (4,))
    compiled = ah.compile(model, ah.Cluster.local(1), (x,), loss_fn=F.cross_entropy,
                          example_targets=y)
    with pytest.raises(ah.AutohybridError, match="expected 1 tensor"):
        compiled.train_step((x, x), y)
    with pytest.raises(ah.AutohybridError, match="expected 1 tensor"):
        compiled.train_step(x, (y, y))
    with pytest.raises(ah.AutohybridError, match=r"inputs\[0\] must be a tensor"):
        compiled.train_step([x.tolist()], y)
    with pytest.raises(ah.AutohybridError, match="expected 1 tensor"):
        compiled((x, x))
    compiled.train_step(x, y)  # the right tensors still work after the errors


@pytest.mark.timeout(60)
def test_planning_inputs_that_cannot_work() -> None:
    model = models.preset("gpt-tiny")
    inputs, targets = models.example_batch("gpt-tiny", 6)
    with pytest.raises(ah.PlanError, match="multiple of 4"):
        ah.plan(model, ah.Cluster.local(4), inputs, executable_only=True,
                constraints=ah.Constraints(tp=1, pp=1))
    with pytest.raises(ah.PlanError, match="dp=3"):
        ah.plan(model, ah.Cluster.local(2), inputs, constraints=ah.Constraints(dp=3))
    with pytest.raises(ah.PlanError, match="num_microbatches=4"):
        ah.plan(model, ah.Cluster.local(1), inputs, constraints=ah.Constraints(num_microbatches=4))
    with pytest.raises(ah.PlanError, match="constraints must be ah.Constraints"):
        ah.plan(model, ah.Cluster.local(1), inputs, constraints={"dp": 1})
    with pytest.raises(ah.PlanError, match="dtype"):
        ah.plan(model, ah.Cluster.local(1), inputs, dtype="int8")
    meta = models.preset("gpt-tiny", device="meta")
    with pytest.raises(ah.NotExecutableError, match="meta device"):
        ah.compile(meta, ah.Cluster.local(1), inputs, loss_fn=_loss, example_targets=targets)
