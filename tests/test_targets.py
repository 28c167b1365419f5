"""Capture with and without example targets (issue 17, E4 and E8).

- E4: a model that cannot run without its targets (Hugging Face T5 trained with
  `labels=`, `loss_fn=None`: its decoder inputs come from the labels) compiles with
  example_targets: only the training graph is captured, the plan is made on it and names
  it (`Plan.model_hash`), and a saved plan is checked against it. Capturing it without
  targets fails with a hint that says the targets are missing, and `compiled(inputs)`
  says the model needs them.
- E8: without example_targets the training graph is captured at the first train_step;
  the shards (and stages) then come from it, not from the forward graph the plan was made
  on (the vocabulary-parallel loss splits llama's untied output layer, which the forward
  graph keeps whole). `compiled(inputs)` before and after training still gives eager's
  output, and the optimizer stays the same object (a scheduler made on it keeps working);
  a meta model (sharded materialization) is captured then on its meta parameters.

The distributed cases run in one `ah.launch` per world size (tests/_equiv.py).
"""
from __future__ import annotations

import copy

import pytest
import torch

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.capture import capture
from autohybrid.models import coverage

from _equiv import (OPTIMIZERS, Failures, compare_training, default_eager_loss, lm_loss,
                    report, train_and_compare, zoo_batches, zoo_model)

needs_transformers = pytest.mark.skipif(not coverage.have_transformers(),
                                        reason="transformers is not installed")
SGD = OPTIMIZERS["sgd"]


def _t5():
    torch.manual_seed(0)
    return coverage.build("t5", dtype=torch.float64)


def _t5_eager_loss(model, inputs, targets):
    return model(*inputs, labels=targets).loss


# ----------------------------------------------------------------------------- in process
@pytest.mark.slow
@needs_transformers
@pytest.mark.timeout(120)
def test_a_model_that_needs_its_targets_plans_compiles_and_says_so() -> None:
    case = _t5()
    (ids,), labels = case.batches[0]
    # with its targets, ah.plan makes the plan on the training graph and names it
    plan = ah.plan(case.model, ah.Cluster.local(1), (ids,), example_targets=labels,
                   optimizer="sgd")
    # ... compile reuses it (checked against the training graph) and trains like eager
    ref = copy.deepcopy(case.model)
    compiled = ah.compile(case.model, ah.Cluster.local(1), (ids,), example_targets=labels,
                          plan=ah.Plan.from_json(plan.to_json()), optimizer=SGD)
    assert compiled.plan == plan and plan.model_hash == compiled._train.hash
    loss = compiled.train_step((ids,), labels)
    torch.testing.assert_close(loss, _t5_eager_loss(ref, (ids,), labels).detach())
    # compiled(inputs) cannot run it without targets and says so; the capture's own hint
    # names the missing labels and the fix
    with pytest.raises(ah.CaptureError) as err:
        compiled((ids,))
    text = str(err.value)
    assert "cannot run without its targets" in text
    assert "the model ran without targets" in text and "`labels`" in text
    assert "give example_targets" in text


@pytest.mark.timeout(120)
def test_a_plan_names_the_graph_it_was_made_on() -> None:
    model = ah.models.preset("gpt-tiny")
    (ids,), targets = ah.models.example_batch("gpt-tiny", 4)
    cluster = ah.Cluster.local(1)
    with_targets = ah.plan(model, cluster, (ids,), loss_fn=lm_loss, example_targets=targets)
    train_hash = capture(model, (ids,), lm_loss, targets).hash
    forward_hash = capture(model, (ids,), with_loss=False).hash
    assert with_targets.model_hash == train_hash != forward_hash
    assert ah.plan(model, cluster, (ids,)).model_hash == forward_hash
    # a plan made on the training graph needs it to be checked against
    with pytest.raises(ah.PlanError, match="compile with the same loss_fn and example_targets"):
        ah.compile(model, cluster, (ids,), loss_fn=lm_loss, plan=with_targets)
    ah.compile(model, cluster, (ids,), loss_fn=lm_loss, example_targets=targets,
               plan=with_targets)


# ----------------------------------------------------------------------------- 2 ranks
def _equal_or_refused(fails: Failures, name: str, case, constraints, steps: int = 2) -> str:
    """Compile `case` under `constraints`: refused (an AutohybridError) or it trains like
    eager; never an error at run time."""
    ref = copy.deepcopy(case.model)
    (inputs, targets) = case.batches[0]
    try:
        compiled = ah.compile(case.model, ah.Cluster.local(2), inputs, loss_fn=case.loss_fn,
                              example_targets=targets, optimizer=SGD,
                              constraints=constraints)
    except ah.AutohybridError as exc:
        fails.check(f"{name}: refused without a reason", bool(str(exc).strip()))
        return "refused"
    compare_training(fails, name, compiled, ref, SGD(list(ref.parameters())),
                     case.batches[:steps], _t5_eager_loss)
    return "equal"


def _forward_matches(fails: Failures, what: str, compiled, ref, inputs) -> None:
    with torch.no_grad():
        fails.close(what, compiled(inputs), ref(*inputs))


def _two_ranks(rank: int, with_t5: bool) -> tuple[list[str], dict[str, str]]:
    fails, outcome = Failures(), {}
    if with_t5:
        case = _t5()
        ref = copy.deepcopy(case.model)
        compiled, _ = train_and_compare(fails, "t5 dp2", case.model, case.batches[:2], 2,
                                        loss_fn=None, eager_loss=_t5_eager_loss,
                                        constraints=ah.Constraints(dp=2, tp=1, pp=1))
        try:
            compiled(case.batches[0][0])
            fails.append("t5 dp2: compiled(inputs) ran a model that needs its targets")
        except ah.CaptureError as exc:
            fails.check(f"t5: compiled(inputs) error {exc}",
                        "cannot run without its targets" in str(exc))
        del ref
        for plan_name, constraints in (("tp2", ah.Constraints(dp=1, tp=2, pp=1)),
                                       ("pp2", ah.Constraints(dp=1, tp=1, pp=2))):
            outcome[f"t5 {plan_name}"] = _equal_or_refused(fails, f"t5 {plan_name}", _t5(),
                                                           constraints)
    # llama-tiny (untied output layer) under tp=2 without example_targets
    batches = zoo_batches("llama-tiny", 4, steps=2)
    for sp, opt in ((False, "sgd"), (True, "adamw")):
        name = f"llama tp2 sp={sp} {opt} no example_targets"
        model, ref = zoo_model("llama-tiny"), zoo_model("llama-tiny")
        compiled = ah.compile(model, ah.Cluster.local(2), batches[0][0], loss_fn=lm_loss,
                              optimizer=OPTIMIZERS[opt],
                              constraints=ah.Constraints(tp=2, dp=1, pp=1, sp=sp))
        if not sp:  # the forward before any train_step, on the forward graph's shards
            _forward_matches(fails, f"{name}: forward before training", compiled, ref,
                             batches[0][0])
        optimizer = compiled.optimizer
        ref_opt = OPTIMIZERS[opt](list(ref.parameters()))
        halve = lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)  # noqa: E731
        compare_training(fails, name, compiled, ref, ref_opt, batches,
                         default_eager_loss(lm_loss), scheduler=halve)
        fails.check(f"{name}: the optimizer was replaced", compiled.optimizer is optimizer)
        _forward_matches(fails, f"{name}: forward after training", compiled, ref,
                         batches[1][0])
    # the same from a meta model (sharded materialization): the training graph captured
    # at the first step from the meta parameters, the shards materialized again
    name = "meta llama tp2 no example_targets"
    seeded = ah.init.materialize(ah.models.preset("llama-tiny", device="meta"), seed=3)
    compiled = ah.compile(ah.models.preset("llama-tiny", device="meta"), ah.Cluster.local(2),
                          batches[0][0], loss_fn=lm_loss, init_seed=3, optimizer=SGD,
                          constraints=ah.Constraints(tp=2, dp=1, pp=1))
    _forward_matches(fails, f"{name}: forward before training", compiled, seeded,
                     batches[0][0])
    compare_training(fails, name, compiled, seeded, SGD(list(seeded.parameters())), batches,
                     default_eager_loss(lm_loss))
    _forward_matches(fails, f"{name}: forward after training", compiled, seeded,
                     batches[1][0])
    return list(fails), outcome


@pytest.mark.procs
@pytest.mark.timeout(480)
def test_t5_and_llama_without_example_targets_train_like_eager() -> None:
    with_t5 = coverage.have_transformers()
    results = pool_launch(_two_ranks, 2, args=(with_t5,), timeout_s=guard(420))
    fails = [r[0] for r in results]
    assert all(not f for f in fails), report(fails)
    if with_t5:
        assert results[0][1] == results[1][1]  # every rank refused or trained alike


# ----------------------------------------------------------------------------- 4 ranks
def _zero_ranks(rank: int) -> list[str]:
    fails = Failures()
    batches = zoo_batches("llama-tiny", 4, steps=2)
    train_and_compare(fails, "llama tp2 dp2 zero1 adamw no example_targets",
                      zoo_model("llama-tiny"), batches, 4, loss_fn=lm_loss,
                      optimizer=OPTIMIZERS["adamw"], example_targets=False,
                      constraints=ah.Constraints(tp=2, dp=2, pp=1, zero=1))
    return list(fails)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_llama_tp_and_zero_without_example_targets_train_like_eager() -> None:
    results = pool_launch(_zero_ranks, 4, timeout_s=guard(240))
    assert all(not f for f in results), report(results)
