"""`ah.compile(..., check=True)`: the first step is compared with eager before it steps.

A plan that computes eager's numbers trains as without the check. A deliberately wrong
tensor-parallel program (tp_copy's backward loses the all-reduce, the class of bug that
let a Phi3 train silently wrong: one rank's share of a gradient dropped) is caught at the
first step on every rank, with the first parameter whose gathered gradient differs named,
and nothing stepped. A plan whose dropout masks differ from eager's by design is refused
at compile time with the reason.

The per-stage check (`check="stage"`, or check=True where the whole model does not fit on
rank 0) passes right pp2×dp2 and pp2×tp2 plans and catches the same injected bug, while
each stage's reference holds that stage's parameters only and no rank gathers the whole
model's gradients; which check check=True picks follows the plan's memory figures.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import (Failures, eager_step, grads_of, lm_loss, report, state_of, zoo_batches,
                    zoo_model)
from autohybrid.ops import tensor_parallel as tp_ops
from autohybrid.runtime.selfcheck import (FirstStepCheck, check_mode, has_random_ops,
                                          requested_check, whole_check_bytes)
from autohybrid.runtime.stage_exchange import recv_value, send_value, wait_all

TP = ah.Constraints(tp=2, dp=1, pp=1, sp=False)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def _first_differing(compiled_grads: dict, eager_grads: dict) -> str | None:
    for name, want in eager_grads.items():
        got = compiled_grads[name]
        if (got is None) != (want is None) or (
                want is not None and not torch.allclose(got, want, rtol=1e-3, atol=1e-9)):
            return name
    return None


def _drop_tp_copy_all_reduce() -> None:
    """Inject a wrong sharding: f's backward (an all-reduce) keeps this rank's share."""
    tp_ops.tp_copy.register_autograd(lambda ctx, grad: (grad.clone(), None),
                                     setup_context=lambda ctx, inputs, output: None)


def _wrong_plan_is_refused(fails: Failures, world: int, constraints: ah.Constraints,
                           check: bool | str, x: torch.Tensor, y: torch.Tensor,
                           calls: list[str] | None = None) -> None:
    """With the injected bug, the checked first step raises NumericsError naming the first
    parameter whose gathered gradient differs, and steps nothing (and, given `calls`,
    gathers no whole model)."""
    _drop_tp_copy_all_reduce()
    plain = ah.compile(zoo_model("gpt-tiny"), ah.Cluster.local(world), (x,), loss_fn=lm_loss,
                       example_targets=y, constraints=constraints)
    plain.forward_backward((x,), y)
    eager = zoo_model("gpt-tiny")
    lm_loss(eager(x), y).backward()
    name = _first_differing(plain.full_grads(), grads_of(eager))
    fails.check("the injected bug changed no gradient", name is not None)
    checked = ah.compile(zoo_model("gpt-tiny"), ah.Cluster.local(world), (x,),
                         loss_fn=lm_loss, example_targets=y, optimizer=_sgd,
                         constraints=constraints, check=check)
    before = checked.full_state_dict()
    if calls is not None:
        calls.clear()
    try:
        checked.train_step((x,), y)
        fails.append(f"the wrong plan passed the check (check={check!r})")
    except ah.NumericsError as exc:
        fails.check(f"the error names {name!r}: {exc}",
                    f"gradient of parameter {name!r} differs" in str(exc))
    if calls is not None:
        fails.check(f"the wrong plan's check gathered the whole model: {calls}", not calls)
    after = checked.full_state_dict()
    for key, want in before.items():   # nothing was stepped
        fails.check(f"{key} was stepped", torch.equal(after[key], want))


def _rank(rank: int) -> list[str]:
    fails = Failures()
    model = zoo_model("gpt-tiny")
    (x,), y = zoo_batches("gpt-tiny", 8, steps=1)[0]
    ref = copy.deepcopy(model)
    compiled = ah.compile(model, ah.Cluster.local(2), (x,), loss_fn=lm_loss,
                          example_targets=y, optimizer=_sgd, constraints=TP, check=True)
    loss = compiled.train_step((x,), y)   # a right plan passes the check and steps
    expected = eager_step(ref, _sgd(list(ref.parameters())),
                          lambda m, i, t: lm_loss(m(*i), t), (x,), y)
    fails.close("right plan: loss", loss, expected)
    fails.close_dict("right plan: state", compiled.full_state_dict(), state_of(ref))

    _wrong_plan_is_refused(fails, 2, TP, True, x, y)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(200)
def test_check_passes_a_right_plan_and_names_the_parameter_of_a_wrong_one():
    results = pool_launch(_rank, 2, timeout_s=guard(180))
    assert not any(results), report(results)


def _dropout_graph() -> fx.GraphModule:
    def fn(x):
        return torch.ops.aten.native_dropout.default(x, 0.1, True)[0]
    return fx.symbolic_trace(fn)


def test_dropout_under_a_batch_split_is_refused_with_the_reason():
    gm = _dropout_graph()
    assert has_random_ops(gm)
    assert not has_random_ops(fx.symbolic_trace(lambda x: F.relu(x)))
    assert not has_random_ops(fx.symbolic_trace(   # dropout_p = 0: no random numbers
        lambda q: torch.ops.aten.scaled_dot_product_attention.default(q, q, q, None, 0.0)))
    check = FirstStepCheck(torch.nn.Linear(2, 2), rank=1, init_seed=None, autocast=None)
    check.refuse_unless_comparable(gm, dp=1, num_microbatches=1)   # same masks as eager
    with pytest.raises(ah.AutohybridError, match="dropout.*dp=2"):
        check.refuse_unless_comparable(gm, dp=2, num_microbatches=1)
    with pytest.raises(ah.AutohybridError, match="4 microbatches"):
        check.refuse_unless_comparable(gm, dp=1, num_microbatches=4)


# ============================================================================ per stage
def _count_whole_gathers(calls: list[str]) -> None:
    """Record every whole-model gather (full_grads, or any merge of the stages)."""
    from autohybrid.runtime import gathered
    for name in ("full_grads", "full_state_dict", "_merged"):
        original = getattr(gathered, name)

        def counted(c, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(c, *args, **kwargs)
        setattr(gathered, name, counted)


def _exchange_values(fails: Failures, rank: int) -> None:
    """What crosses stages arrives as sent: tensors (with requires_grad), sizes, None."""
    sent = [torch.arange(6.0, dtype=torch.float64).reshape(2, 3).requires_grad_(), 7, 2.5,
            None, True, torch.tensor([[1, 2]])]
    if rank == 0:
        works = [w for v in sent for w in send_value(v, 1, tag=5, device=torch.device("cpu"))]
        wait_all(works)
    elif rank == 1:
        got = [recv_value(0, tag=5, device=torch.device("cpu")) for _ in sent]
        fails.check(f"exchange: {got}", got[1:5] == sent[1:5] and got[0].requires_grad
                    and torch.equal(got[0], sent[0]) and torch.equal(got[5], sent[5])
                    and not got[5].requires_grad)


def _stage_rank(rank: int) -> list[str]:
    """pp2×dp2 (ZeRO-1, V-shaped: rank 0's reference runs the first and the last stage)
    and pp2×tp2 (also of a meta model) on 4 ranks under check='stage': right plans pass
    and train like eager; with the injected bug the pp2×tp2 check names the parameter."""
    fails = Failures()
    _exchange_values(fails, rank)
    (x,), y = zoo_batches("gpt-tiny", 8, steps=1)[0]
    calls: list[str] = []
    _count_whole_gathers(calls)
    everything = [n for n, _ in zoo_model("gpt-tiny").named_parameters()]
    cases = {"pp2×dp2 zbv": ah.Constraints(pp=2, dp=2, tp=1, zero=1, schedule="zbv",
                                           virtual_stages=2, num_microbatches=4),
             "pp2×tp2": ah.Constraints(pp=2, dp=1, tp=2, sp=False, num_microbatches=2)}
    cases["pp2×tp2 meta"] = cases["pp2×tp2"]   # materialized shard by shard
    for case, constraints in cases.items():
        meta = case.endswith("meta")
        model = (ah.models.preset("gpt-tiny", device="meta").double() if meta
                 else zoo_model("gpt-tiny"))
        ref = (ah.init.materialize(copy.deepcopy(model), 3) if meta
               else copy.deepcopy(model))
        compiled = ah.compile(model, ah.Cluster.local(4), (x,), loss_fn=lm_loss,
                              example_targets=y, optimizer=_sgd, constraints=constraints,
                              check="stage", init_seed=3 if meta else None)
        loss = compiled.train_step((x,), y)
        fails.check(f"{case}: checked stage by stage, no whole gather ({calls})",
                    compiled._check.per_stage and not calls)
        held = set(compiled._check.held)
        is_ref = compiled.coords[1:] == (0, 0)
        fails.check(f"{case}: rank {rank} held {sorted(held)}",
                    held == compiled._owned if is_ref else not held)
        fails.check(f"{case}: a stage's reference held the whole model",
                    not set(everything) <= held)
        expected = eager_step(ref, _sgd(list(ref.parameters())),
                              lambda m, i, t: lm_loss(m(*i), t), (x,), y)
        fails.close(f"{case}: loss", loss, expected)
        fails.close_dict(f"{case}: state", compiled.full_state_dict(), state_of(ref))
        calls.clear()

    _wrong_plan_is_refused(fails, 4, cases["pp2×tp2"], "stage", x, y, calls)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_stage_check_passes_right_pp_plans_and_names_the_parameter_of_a_wrong_one():
    results = pool_launch(_stage_rank, 4, timeout_s=guard(120))
    assert not any(results), report(results)


def _plan(constraints: ah.Constraints) -> ah.Plan:
    (x,), y = zoo_batches("gpt-tiny", 8, steps=1)[0]
    return ah.plan(zoo_model("gpt-tiny"), ah.Cluster.local(4), (x,), loss_fn=lm_loss,
                   example_targets=y, constraints=constraints)


def test_check_true_picks_the_whole_model_where_it_fits_and_stages_otherwise():
    for value, want in ((True, "auto"), (False, None), (None, None), ("whole", "whole"),
                        ("stage", "stage")):
        assert requested_check(value) == want
    for bad in ("yes", 1, "Stage"):
        with pytest.raises(ah.AutohybridError, match="check='stage'"):
            requested_check(bad)
    pp = _plan(ah.Constraints(pp=2, dp=2, tp=1, num_microbatches=2))
    flat = _plan(ah.Constraints(pp=1, dp=2, tp=2))
    params = sum(p.numel() * p.element_size() for p in zoo_model("gpt-tiny").parameters())
    need, figures = whole_check_bytes(pp, params)
    assert need > 3 * params and "gathered gradients" in figures
    roomy, tight = 2 * need, need // 2   # device bytes: 90 % of them usable
    assert check_mode("auto", pp, params, roomy) == "whole"
    assert check_mode("auto", pp, params, tight) == "stage"
    assert check_mode("whole", pp, params, tight) == "whole"   # asked for: tried
    assert check_mode("stage", pp, params, roomy) == "stage"
    assert check_mode(None, pp, params, tight) is None
    with pytest.raises(ah.AutohybridError, match=r"GiB on rank 0.*pp=2"):
        check_mode("auto", flat, params, tight // 4)   # no stages: refused, not skipped
    with pytest.raises(ah.AutohybridError, match="single stage"):
        check_mode("stage", flat, params, roomy)
    with pytest.raises(ah.AutohybridError, match="check='stage'"):
        ah.compile(zoo_model("gpt-tiny"), ah.Cluster.local(1), zoo_batches("gpt-tiny", 2)[0][0],
                   check="sometimes")
