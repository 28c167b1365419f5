"""The overlap pass (passes/overlap.py): where it puts the issue of each split collective.

On gpt-tiny's ZeRO-3 graph (dp 2, each layer's gather its own: `gather_min_mb=0`), with
the budget of bytes in flight the pass is given: every issue stays before its wait and
after its inputs, issues keep their order, the bytes in flight never exceed the budget,
and with the default budget (the largest gather) each block's gather starts right after
the previous block's wait, that is while the previous block computes. A zero budget
moves nothing; an unbounded one starts every gather at the top. The order is the same on
every rank. Numerical equivalence with the pass on is the ZeRO-3 cases of
tests/test_zero.py and tests/test_matrix.py (the pass runs by default).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autohybrid as ah
from autohybrid.capture import capture
from autohybrid.graph import verify
from autohybrid.ops.zero import zero_gather_start_op, zero_gather_wait_op
from autohybrid.passes import PassContext, passes_for, run_passes
from autohybrid.passes.manager import copy_graph_module
from autohybrid.passes.overlap import default_budget, in_flight, issue_bytes, schedule_issues

from _equiv import lm_loss


def _zero3_graph(rank: int = 0, overlap: bool = False, **plan_fields):
    torch.manual_seed(0)
    model = ah.models.preset("gpt-tiny")
    inputs, targets = ah.models.example_batch("gpt-tiny", 4)
    cap = capture(model, inputs, lm_loss, targets)
    plan = ah.plan(model, ah.Cluster.local(2), inputs,
                   constraints=ah.Constraints(dp=2, tp=1, pp=1, zero=3))
    plan = dataclasses.replace(plan, gather_min_mb=0.0, **plan_fields)
    ctx = PassContext(plan=plan, rank=rank, coords=plan.mesh.coords(rank))
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    passes = [(n, fn) for n, fn in passes_for("train") if overlap or n != "overlap"]
    return run_passes(cap.gm, ctx, passes), ctx


@pytest.fixture(scope="module")
def unscheduled():
    gm, _ = _zero3_graph()
    return gm


def _order(gm) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _starts(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is zero_gather_start_op]


def _check_rules(gm, budget: int) -> None:
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    starts = _starts(gm)
    assert starts
    for start in starts:
        (wait,) = [u for u in start.users if u.target is zero_gather_wait_op]
        assert position[start] < position[wait]
        assert all(position[a] < position[start] for a in start.all_input_nodes)
    assert max(b for _, b in in_flight(gm)) <= budget
    verify(gm, "overlap")


@pytest.mark.timeout(120)
def test_default_budget_starts_each_gather_while_the_previous_layer_computes(unscheduled):
    gm = copy_graph_module(unscheduled)
    before = [n.args[1] for n in _starts(gm)]
    budget = default_budget(gm)
    assert budget == max(issue_bytes(n) for n in _starts(gm))
    moved = schedule_issues(gm, budget)
    assert moved > 0
    _check_rules(gm, budget)
    assert [n.args[1] for n in _starts(gm)] == before            # issues keep their order
    nodes = list(gm.graph.nodes)
    waits = [n for n in nodes if n.target is zero_gather_wait_op]
    starts = _starts(gm)
    # each block's gather (the two largest) starts right after the wait before it: the
    # previous layer's compute runs while it transfers
    big = sorted(starts, key=issue_bytes)[-2:]
    for start in big:
        previous_wait = max((w for w in waits if nodes.index(w) < nodes.index(start)),
                            key=nodes.index)
        assert nodes.index(start) == nodes.index(previous_wait) + 1, start.name
    # the second block's gather transfers while the whole first block computes
    (own_wait,) = [u for u in big[-1].users if u.target is zero_gather_wait_op]
    between = nodes[nodes.index(big[-1]) + 1: nodes.index(own_wait)]
    assert sum(n.op == "call_function" for n in between) > 20
    # the two largest are never in flight together
    flights = dict(in_flight(gm))
    assert all(b < sum(map(issue_bytes, big)) for b in flights.values())


@pytest.mark.timeout(120)
def test_budget_bounds_how_far_issues_move(unscheduled):
    none = copy_graph_module(unscheduled)
    assert schedule_issues(none, 0) == 0                        # nothing may be in flight
    assert _order(none) == _order(unscheduled)
    for start in _starts(none):                                 # issue right before wait
        assert start.next.target is zero_gather_wait_op and start.next.args[0] is start
    everything = copy_graph_module(unscheduled)
    total = sum(issue_bytes(n) for n in _starts(everything))
    schedule_issues(everything, total)
    _check_rules(everything, total)
    first_compute = next(n for n in everything.graph.nodes if n.op != "placeholder")
    starts = _starts(everything)
    nodes = list(everything.graph.nodes)
    assert nodes.index(starts[0]) == nodes.index(first_compute)   # all at the top
    assert [nodes.index(s) for s in starts] == list(range(nodes.index(starts[0]),
                                                          nodes.index(starts[0]) + len(starts)))
    # a budget between the two: in flight never above it
    middle = default_budget(unscheduled) + 1
    some = copy_graph_module(unscheduled)
    schedule_issues(some, middle)
    _check_rules(some, middle)


@pytest.mark.timeout(180)
def test_the_pass_gives_every_rank_the_same_order():
    gm0, ctx0 = _zero3_graph(rank=0, overlap=True)
    gm1, ctx1 = _zero3_graph(rank=1, overlap=True)
    assert ctx0.notes["overlap_moved"] > 0
    assert _order(gm0) == _order(gm1)
    assert [str(n.target) for n in gm0.graph.nodes] == [str(n.target) for n in gm1.graph.nodes]
    _check_rules(gm0, default_budget(gm0))
