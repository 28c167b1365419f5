"""Errors from torch inside a pass or a step name the pass, the node, its module and a fix
(autohybrid/blame.py), instead of surfacing raw. Process-free."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import autohybrid as ah
from autohybrid import models
from autohybrid.blame import PassFailure, StepFailure
from autohybrid.capture import capture
from autohybrid.passes.manager import PassContext, run_passes
from autohybrid.plan import Mesh, Plan, RankPlacement

aten = torch.ops.aten


def _plan() -> Plan:
    return Plan(model_hash="test", cluster="test", cluster_hash="test", mesh=Mesh(dp=1),
                placement=(RankPlacement(rank=0, node=0, device=0),), global_batch=4,
                microbatch_size=4, num_microbatches=1)


def _mlp_capture():
    return capture(models.preset("mlp-tiny"), (torch.randn(4, 16),), with_loss=False)


def _breaks_at_second_linear(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    linears = 0
    for node in gm.graph.nodes:
        if node.target is aten.linear.default:
            linears += 1
            if linears == 2:
                torch.zeros(2) + torch.zeros(3)   # a torch error in the middle of a pass
    return gm


@pytest.mark.timeout(60)
def test_a_torch_error_inside_a_pass_names_the_pass_the_node_and_its_module() -> None:
    cap = _mlp_capture()
    second = [n for n in cap.gm.graph.nodes if n.target is aten.linear.default][1]
    ctx = PassContext(plan=_plan(), rank=0, coords=(0, 0, 0), graph_kind="forward")
    with pytest.raises(PassFailure) as info:
        run_passes(cap.gm, ctx, [("breaks", _breaks_at_second_linear)])
    err = info.value
    assert isinstance(err, ah.PlanError) and isinstance(err.__cause__, RuntimeError)
    assert err.pass_name == "breaks" and err.node == second.name
    message = str(err)
    assert f"node {second.name!r} (aten.linear.default) in module model." in message
    assert err.module and err.module.startswith("model.") and err.module in message
    assert "AUTOHYBRID_DISABLE_PASSES=breaks" in message
    assert "must match the size of tensor b" in message   # torch's own reason kept


@pytest.mark.timeout(60)
def test_a_torch_error_while_a_graph_runs_names_the_node_that_raised() -> None:
    cap = _mlp_capture()
    first = next(n for n in cap.gm.graph.nodes if n.target is aten.linear.default)
    first.meta["ah_pass"] = "tensor_parallel"   # as if a pass had made the node
    state = cap.default_state(models.preset("mlp-tiny"))
    with pytest.raises(RuntimeError) as info:
        cap.run(state, (torch.randn(4, 15),))   # a width the first linear cannot take
    err = StepFailure.of(info.value, "train_step", _plan())
    assert isinstance(err, ah.RuntimeFailure) and err.node == first.name
    message = str(err)
    assert message.startswith("train_step failed under plan pp1×dp1×tp1 at node "
                              f"{first.name!r} (aten.linear.default) in module model.")
    assert "inserted by pass 'tensor_parallel'" in message
    assert "AUTOHYBRID_DISABLE_PASSES=tensor_parallel" in message
