"""`ah.compile(..., check=True)`: the first step is compared with eager before it steps.

A plan that computes eager's numbers trains as without the check. A deliberately wrong
tensor-parallel program (tp_copy's backward loses the all-reduce, the class of bug that
let a Phi3 train silently wrong: one rank's share of a gradient dropped) is caught at the
first step on every rank, with the first parameter whose gathered gradient differs named,
and nothing stepped. A plan whose dropout masks differ from eager's by design is refused
at compile time with the reason.
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
from autohybrid.runtime.selfcheck import FirstStepCheck, has_random_ops

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

    _drop_tp_copy_all_reduce()
    plain = ah.compile(zoo_model("gpt-tiny"), ah.Cluster.local(2), (x,), loss_fn=lm_loss,
                       example_targets=y, constraints=TP)
    plain.forward_backward((x,), y)
    eager = zoo_model("gpt-tiny")
    lm_loss(eager(x), y).backward()
    name = _first_differing(plain.full_grads(), grads_of(eager))
    fails.check("the injected bug changed no gradient", name is not None)

    checked = ah.compile(zoo_model("gpt-tiny"), ah.Cluster.local(2), (x,), loss_fn=lm_loss,
                         example_targets=y, optimizer=_sgd, constraints=TP, check=True)
    before = checked.full_state_dict()
    try:
        checked.train_step((x,), y)
        fails.append("the wrong plan passed the check")
    except ah.NumericsError as exc:
        fails.check(f"the error names {name!r}: {exc}",
                    f"gradient of parameter {name!r} differs" in str(exc))
    after = checked.full_state_dict()
    for key, want in before.items():   # nothing was stepped
        fails.check(f"{key} was stepped", torch.equal(after[key], want))
    return fails


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
