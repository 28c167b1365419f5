"""The overlap pass (passes/overlap.py): where it puts issues, waits and compute.

Hand-built graphs with a toy cost model (a dict of seconds per node, a fixed collective
time) check the exact order after `schedule`: a tp/sp collective is split into issue and
wait, the wait sinks to its first use, the issue rises to its inputs within the budget of
bytes in flight, and independent compute moves from after the wait to before it until it
covers the collective's time (and no further); a pair with nothing between is joined
back into the sync op. Nothing crosses another collective's issue or a random op, and the
peak of live bytes stays within the memory budget (a tight one moves less). On gpt-tiny's
tp = 2 sp graph, ranks 0 and 1 get the same order. Numerical equivalence with the pass on
is tests/test_async_tp_ops.py (the ops) and the tp+sp cases of tests/test_tp_equivalence.py.

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
import operator

import pytest
import torch
import torch.fx as fx

import autohybrid as ah
from autohybrid.capture import capture
from autohybrid.graph import AH_ROLE, VAL, verify
from autohybrid.ops.zero import zero_gather_start_op, zero_gather_wait_op
from autohybrid.passes import PassContext, passes_for, run_passes
from autohybrid.passes.manager import copy_graph_module
from autohybrid.passes.overlap import (default_budget, in_flight, is_issue, is_pure, is_wait,
                                       issue_bytes, peak_live_bytes, schedule, schedule_issues,
                                       split_collectives)

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


# ============================================================ hand-built graphs, toy costs
aten = torch.ops.aten
AH = torch.ops.autohybrid


class _Toy:
    """A hand-built graph: nodes named as given, meta-tensor values of given shapes."""

    def __init__(self) -> None:
        self.graph = fx.Graph()

    def input(self, name: str, *shape: int, role: str = "input") -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta[VAL] = torch.empty(shape, device="meta")
        node.meta[AH_ROLE] = role
        return node

    def call(self, name: str, target, *args, shape=None, val=None) -> fx.Node:
        node = self.graph.create_node("call_function", target, args, {}, name=name)
        node.meta[VAL] = val if val is not None else torch.empty(shape, device="meta")
        return node

    def done(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _labels(gm) -> list[str]:
    """The order of the compute nodes: an issue as `issue:<its wait>`, a wait as
    `wait:<name>` (the sync node's name), others by name."""
    out = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if is_issue(n):
            out.append(f"issue:{next(iter(n.users)).name}")
        else:
            out.append(f"wait:{n.name}" if is_wait(n) else n.name)
    return out


def _toy_cost(costs: dict[str, float]):
    return lambda node: costs.get(node.name, 0.0)


def _independent_compute_graph() -> fx.GraphModule:
    """a → tp_reduce r → d (reads r); b, c, f after d read nothing of r; e reads d and c."""
    t = _Toy()
    x, y = t.input("x", 4, 8), t.input("y", 4, 8)
    w = t.input("w", 8, 8, role="param")
    a = t.call("a", aten.mm.default, x, w, shape=(4, 8))
    r = t.call("r", AH.tp_reduce.default, a, "tp", shape=(4, 8))
    d = t.call("d", aten.add.Tensor, r, x, shape=(4, 8))
    b = t.call("b", aten.mm.default, y, w, shape=(4, 8))
    c = t.call("c", aten.relu.default, b, shape=(4, 8))
    e = t.call("e", aten.add.Tensor, d, c, shape=(4, 8))
    f = t.call("f", aten.mm.default, y, w, shape=(4, 8))
    return t.done(e, f)


COSTS = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 1.0, "e": 1.0, "f": 4.0, "m": 2.0}


@pytest.mark.parametrize("comm,order", [
    (2.5, ["a", "issue:r", "b", "wait:r", "d", "c", "e", "f"]),   # b alone covers 2.5 s
    (4.0, ["a", "issue:r", "b", "c", "wait:r", "d", "e", "f"]),   # b + c cover 4 s
    # everything independent: f too; e reads d (after the wait) and stays
    (100.0, ["a", "issue:r", "b", "c", "f", "wait:r", "d", "e"]),
    (0.0, ["a", "r", "d", "b", "c", "e", "f"]),                   # nothing to hide: joined
])
def test_compute_moves_between_issue_and_wait_until_it_covers_the_collective(comm, order):
    gm = _independent_compute_graph()
    schedule(gm, budget_bytes=10**6, cost=_toy_cost(COSTS), comm_time=lambda issue: comm)
    assert _labels(gm) == order
    r = next(n for n in gm.graph.nodes if n.name == "r")
    assert r.target is (AH.tp_reduce.default if comm == 0 else AH.tp_reduce_wait.default)
    verify(gm, "overlap")
    gm.recompile()


def _hoist_graph() -> fx.GraphModule:
    """a is ready before b: the sp_gather of a can start while b computes."""
    t = _Toy()
    x, y = t.input("x", 4, 8), t.input("y", 8, 8)
    w = t.input("w", 8, 8, role="param")
    a = t.call("a", aten.mm.default, x, w, shape=(4, 8))
    b = t.call("b", aten.mm.default, y, w, shape=(8, 8))
    g = t.call("g", AH.sp_gather.default, a, 0, "tp", shape=(8, 8))
    d = t.call("d", aten.add.Tensor, g, b, shape=(8, 8))
    return t.done(d)


def test_issue_rises_to_its_input_within_the_bytes_in_flight():
    gm = _hoist_graph()
    split_collectives(gm)
    (issue,) = [n for n in gm.graph.nodes if is_issue(n)]
    assert issue.target is AH.sp_gather_start.default
    assert tuple(issue.meta[VAL].shape) == (8, 8) and issue_bytes(issue) == 256
    gm = _hoist_graph()
    schedule(gm, budget_bytes=256, cost=_toy_cost({"b": 3.0}), comm_time=lambda issue: 1.0)
    assert _labels(gm) == ["a", "issue:g", "b", "wait:g", "d"]
    assert max(bytes for _, bytes in in_flight(gm)) == 256
    gm = _hoist_graph()        # nothing may be in flight: no move, the pair joined back
    schedule(gm, budget_bytes=0, cost=_toy_cost({"b": 3.0}), comm_time=lambda issue: 1.0)
    assert _labels(gm) == ["a", "b", "g", "d"] and gm.graph.find_nodes(
        op="call_function", target=AH.sp_gather.default)


def test_issues_keep_their_order():
    """r2's input is ready first, yet its issue never rises above r1's."""
    t = _Toy()
    x, y = t.input("x", 4, 8), t.input("y", 4, 8)
    w = t.input("w", 8, 8, role="param")
    b = t.call("b", aten.mm.default, y, w, shape=(4, 8))
    a = t.call("a", aten.mm.default, x, w, shape=(4, 8))
    r1 = t.call("r1", AH.tp_reduce.default, a, "tp", shape=(4, 8))
    r2 = t.call("r2", AH.tp_reduce.default, b, "tp", shape=(4, 8))
    t.call("d", aten.add.Tensor, r1, r2, shape=(4, 8))
    gm = t.done(*[n for n in t.graph.nodes if n.name == "d"])
    schedule(gm, budget_bytes=10**6, cost=_toy_cost(COSTS), comm_time=lambda issue: 10.0)
    assert _labels(gm) == ["b", "a", "issue:r1", "issue:r2", "wait:r1", "wait:r2", "d"]


def _dropout_graph() -> fx.GraphModule:
    """Random ops before the collective and after its use: they stay where they are."""
    t = _Toy()
    x, y = t.input("x", 4, 8), t.input("y", 4, 8)
    w = t.input("w", 8, 8, role="param")
    a = t.call("a", aten.mm.default, x, w, shape=(4, 8))
    pair = (torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta", dtype=torch.bool))
    drop = t.call("drop", aten.native_dropout.default, y, 0.5, True, val=pair)
    kept = t.call("kept", operator.getitem, drop, 0, shape=(4, 8))
    m = t.call("m", aten.mm.default, y, w, shape=(4, 8))
    r = t.call("r", AH.tp_reduce.default, a, "tp", shape=(4, 8))
    d = t.call("d", aten.add.Tensor, r, x, shape=(4, 8))
    drop2 = t.call("drop2", aten.native_dropout.default, x, 0.5, True, val=pair)
    kept2 = t.call("kept2", operator.getitem, drop2, 0, shape=(4, 8))
    b = t.call("b", aten.mm.default, y, w, shape=(4, 8))
    e = t.call("e", aten.add.Tensor, d, b, shape=(4, 8))
    return t.done(e, kept, m, kept2)


def test_nothing_crosses_a_random_op():
    gm = _dropout_graph()
    assert not is_pure(next(n for n in gm.graph.nodes if n.name == "drop"))
    schedule(gm, budget_bytes=10**6, cost=_toy_cost(COSTS), comm_time=lambda issue: 100.0)
    # the issue rises over kept and m, not over the dropout; b stays after the second
    assert _labels(gm) == ["a", "drop", "issue:r", "kept", "m", "wait:r", "d", "drop2",
                           "kept2", "b", "e"]


def test_sdpa_is_random_only_with_dropout():
    t = _Toy()
    q = t.input("q", 2, 4, 8)
    plain = t.call("plain", aten.scaled_dot_product_attention.default, q, q, q,
                   shape=(2, 4, 8))
    dropped = t.call("dropped", aten.scaled_dot_product_attention.default, q, q, q, None,
                     0.1, shape=(2, 4, 8))
    assert is_pure(plain) and not is_pure(dropped)


def _memory_graph() -> fx.GraphModule:
    """b1 (4000 bytes, independent of r) moved before r's wait would live alongside r's
    buffer and input: the peak grows from 4132 to 4260 bytes."""
    t = _Toy()
    x, y = t.input("x", 4, 8), t.input("y", 1000)
    w = t.input("w", 8, 8, role="param")
    a = t.call("a", aten.mm.default, x, w, shape=(4, 8))
    r = t.call("r", AH.tp_reduce.default, a, "tp", shape=(4, 8))
    d = t.call("d", aten.add.Tensor, r, x, shape=(4, 8))
    b1 = t.call("b1", aten.mul.Tensor, y, 2.0, shape=(1000,))
    b2 = t.call("b2", aten.sum.default, b1, shape=())
    e = t.call("e", aten.add.Tensor, d, b2, shape=(4, 8))
    return t.done(e)


@pytest.mark.parametrize("memory,order", [
    (4132, ["a", "r", "d", "b1", "b2", "e"]),                       # tight: nothing moves
    (4200, ["a", "r", "d", "b1", "b2", "e"]),
    (4260, ["a", "issue:r", "b1", "b2", "wait:r", "d", "e"]),
    (None, ["a", "issue:r", "b1", "b2", "wait:r", "d", "e"]),       # peak + bytes in flight
    (10**9, ["a", "issue:r", "b1", "b2", "wait:r", "d", "e"]),
])
def test_the_peak_of_live_bytes_stays_within_the_memory_budget(memory, order):
    unsplit = _memory_graph()
    assert peak_live_bytes(unsplit) == 4132
    split = _memory_graph()
    split_collectives(split)
    assert peak_live_bytes(split) == 4132       # r's buffer is alive at r's wait only
    gm = _memory_graph()
    schedule(gm, budget_bytes=128, memory_bytes=memory,
             cost=_toy_cost({"a": 1.0, "b1": 3.0, "b2": 1.0}), comm_time=lambda issue: 10.0)
    assert _labels(gm) == order
    assert peak_live_bytes(gm) <= (4132 + 128 if memory is None else max(memory, 4132))


# ============================================================ gpt-tiny, tp = 2 with sp

def _sp_graphs(ranks=(0, 1)):
    """gpt-tiny's train graph with tp = 2 and sp for each of `ranks` (under a fake
    process group, as the dry run makes them), with the overlap pass, and rank 0's
    without it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autohybrid.ops import groups
    from autohybrid.runtime.groups import build_mesh

    torch.manual_seed(0)
    model = ah.models.preset("gpt-tiny")
    inputs, targets = ah.models.example_batch("gpt-tiny", 4)
    cap = capture(model, inputs, lm_loss, targets)
    plan = ah.plan(model, ah.Cluster.local(2), inputs,
                   constraints=ah.Constraints(dp=1, tp=2, pp=1, sp=True))
    out = {}
    for rank, with_overlap in [(r, True) for r in ranks] + [(0, False)]:
        dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
        try:
            build_mesh(plan, "cpu")
            ctx = PassContext(plan=plan, rank=rank, coords=plan.mesh.coords(rank))
            ctx.notes["loss_output_index"] = cap.user_outputs[0]
            passes = [(n, fn) for n, fn in passes_for("train") if with_overlap or n != "overlap"]
            out[rank, with_overlap] = run_passes(cap.gm, ctx, passes), ctx
        finally:
            groups.clear()
            dist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_tp_sp_graph_has_the_same_order_on_both_ranks():
    graphs = _sp_graphs()
    (gm0, ctx0), (gm1, _), (plain, _) = graphs[0, True], graphs[1, True], graphs[0, False]
    assert _order(gm0) == _order(gm1)
    assert [str(n.target) for n in gm0.graph.nodes] == [str(n.target) for n in gm1.graph.nodes]
    assert ctx0.notes["overlap_split"] > 0 and ctx0.notes["overlap_moved"] > 0
    # every collective of the plain graph is still there, issued in the same order
    collectives = {f"autohybrid.{op}.default" for op in
                   ("sp_gather", "sp_reduce_scatter", "tp_reduce", "tp_gather")}
    issued = [n.name for n in plain.graph.nodes if str(n.target) in collectives]
    now = [next(iter(n.users)).name if is_issue(n) else n.name for n in gm0.graph.nodes
           if is_issue(n) or str(n.target) in collectives]
    assert now == issued
    position = {n: i for i, n in enumerate(gm0.graph.nodes)}
    hidden = 0
    for issue in [n for n in gm0.graph.nodes if is_issue(n)]:
        (wait,) = issue.users
        assert position[issue] < position[wait]
        assert all(position[a] < position[issue] for a in issue.all_input_nodes)
        hidden += position[wait] - position[issue] - 1
    assert hidden > 0                      # compute runs while something transfers
    verify(gm0, "overlap")
