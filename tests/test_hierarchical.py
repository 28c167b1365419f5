"""Hierarchical and segmented dp gradient all-reduce: cost model, choice, runtime.

Without processes: the α–β formulas of cost/comm.py, which subgroups a plan's dp groups
split into (runtime/collectives.subgroup_ranks), that the planner records the algorithm
the formulas make fastest (a non-flat one on several nodes with shared NICs, "flat" on
one node), that a pinned one is recorded and that ZeRO > 0 with a non-flat one is
refused. With processes: two `torchrun --nnodes 2 --nproc-per-node 2` on loopback run
tests/scripts/hierarchical_train.py (in the one job that also runs test_multinode's
check: tests/scripts/two_nodes_train.py, tests/conftest.py), which checks the
subgroups each rank gets, bit-for-bit equality with `dist.all_reduce`, and compiled
training with each algorithm against eager (SGD and AdamW).
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import autohybrid as ah
from autohybrid.cost import comm
from autohybrid.errors import PlanError
from autohybrid.plan import Mesh, Plan, RankPlacement
from autohybrid.runtime import collectives

from test_multinode import _readable

NODES, PER_NODE = 2, 2


# ============================================================================ cost model
def _cpu(nodes: int) -> ah.Cluster:
    return ah.Cluster.preset("cpu", nodes=nodes)  # 4 ranks and one NIC per node


@pytest.mark.timeout(30)
def test_formulas_fall_back_to_flat_and_follow_the_reference():
    c = ah.Cluster.preset("dgx-v100", nodes=4)  # 8 GPUs, 4 NICs per node
    n = 2.0**30
    one_node, one_per_node = list(range(8)), [0, 8, 16, 24]
    for ranks in (one_node, one_per_node, [0, 1, 8]):  # last: nodes with different counts
        flat = comm.all_reduce(c, ranks, n)
        assert comm.hierarchical_all_reduce(c, ranks, n) == flat
        assert comm.segmented_all_reduce(c, ranks, n) == flat
        assert not comm.hierarchy_applies(c, ranks)
    ranks = list(range(32))
    g, nodes = 8, 4
    a_i, b_i = c.intra_link.latency_s, 1 / c.intra_link.bandwidth
    a_e, b_e = c.inter_link.latency_s, 2 / c.inter_link.bandwidth  # 8 GPUs share 4 NICs
    expected = (2 * (g - 1) * a_i + 2 * (g - 1) / g * n * b_i
                + 2 * (nodes - 1) * a_e + 2 * (nodes - 1) / nodes * n / g * b_e)
    assert comm.hierarchical_all_reduce(c, ranks, n) == pytest.approx(expected)
    assert comm.segmented_all_reduce(c, ranks, n, segments=1) == pytest.approx(expected)
    s = comm.PIPELINE_SEGMENTS
    rs = (g - 1) * a_i + (g - 1) / g * n / s * b_i
    ar = 2 * (nodes - 1) * a_e + 2 * (nodes - 1) / nodes * n / (g * s) * b_e
    assert comm.segmented_all_reduce(c, ranks, n) == pytest.approx(
        2 * rs + ar + (s - 1) * max(2 * rs, ar))
    # large messages: the hierarchy beats the flat ring over shared NICs, and pipelining
    # beats the plain hierarchy; tiny ones pay the segments' latencies
    assert (comm.segmented_all_reduce(c, ranks, n) < comm.hierarchical_all_reduce(c, ranks, n)
            < comm.all_reduce(c, ranks, n))
    assert comm.segmented_all_reduce(c, ranks, 1e3) > comm.hierarchical_all_reduce(c, ranks, 1e3)
    for algorithm, fn in (("flat", comm.all_reduce), ("hierarchical",
                          comm.hierarchical_all_reduce), ("segmented", comm.segmented_all_reduce)):
        assert comm.dp_all_reduce(c, ranks, n, algorithm) == fn(c, ranks, n)


def _plan_on(cluster: ah.Cluster, mesh: Mesh) -> Plan:
    return Plan(model_hash="", cluster="", cluster_hash="", mesh=mesh,
                placement=tuple(RankPlacement(r, *cluster.rank_location(r))
                                for r in range(mesh.world_size)),
                global_batch=mesh.dp, microbatch_size=1, num_microbatches=1,
                collective_algorithm="hierarchical")


@pytest.mark.timeout(30)
def test_subgroups_of_the_dp_groups():
    c = _cpu(2)  # ranks 0-3 on node 0, 4-7 on node 1
    plan = _plan_on(c, Mesh(dp=8))
    assert collectives.subgroup_ranks(plan) == [
        (0, "intra", [0, 1, 2, 3]), (0, "intra", [4, 5, 6, 7]),
        (0, "inter", [0, 4]), (0, "inter", [1, 5]), (0, "inter", [2, 6]), (0, "inter", [3, 7])]
    plan = _plan_on(c, Mesh(dp=4, tp=2))  # dp groups [0, 2, 4, 6] and [1, 3, 5, 7]
    assert collectives.dp_group_ranks(plan) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert collectives.subgroup_ranks(plan) == [
        (0, "intra", [0, 2]), (0, "intra", [4, 6]), (0, "inter", [0, 4]), (0, "inter", [2, 6]),
        (1, "intra", [1, 3]), (1, "intra", [5, 7]), (1, "inter", [1, 5]), (1, "inter", [3, 7])]
    # one dp rank per node, or one node: nothing to split (the flat all-reduce runs)
    assert collectives.subgroup_ranks(_plan_on(c, Mesh(dp=2, tp=4))) == []
    assert collectives.subgroup_ranks(_plan_on(ah.Cluster.local(4), Mesh(dp=4))) == []
    assert collectives.gradient_all_reduce(_plan_on(c, Mesh(dp=2, tp=4)), None) is None


class _Work:
    def __init__(self, events: list, name: str):
        self.events, self.name = events, name

    def wait(self) -> bool:
        self.events.append(("wait", self.name))
        return True


@pytest.mark.timeout(30)
@pytest.mark.parametrize("segments", [1, 3, 4])
def test_segmented_issue_order_overlaps_segments(monkeypatch, segments):
    """The order the pipelined all-reduce issues and waits on its collectives (recorded
    with stand-ins, no processes): segment k's inter-node all-reduce is issued before
    segment k+1's reduce-scatter is waited on, and runs while it is in flight; every
    segment is reduce-scattered, all-reduced and all-gathered once, in that order."""
    events: list[tuple[str, str]] = []
    counts = {"rs": 0, "ar": 0, "ag": 0}

    def stand_in(kind: str):
        def op(*args, async_op: bool = False, **kwargs):
            name = f"{kind}{counts[kind]}"
            counts[kind] += 1
            events.append(("issue", name))
            return _Work(events, name) if async_op else None
        return op

    monkeypatch.setattr(collectives, "reduce_scatter_single", stand_in("rs"))
    monkeypatch.setattr(collectives, "all_gather_single", stand_in("ag"))
    monkeypatch.setattr(collectives.dist, "all_reduce", stand_in("ar"))
    h = collectives.Hierarchy(group=object(), intra=object(), inter=object(),
                              intra_ranks=(0, 1), inter_ranks=(0, 2))
    collectives.hierarchical_all_reduce(torch.zeros(101), h, segments)
    assert counts == {"rs": segments, "ar": segments, "ag": segments}
    at = {e: i for i, e in enumerate(events)}
    for k in range(segments):
        assert at[("issue", f"rs{k}")] < at[("issue", f"ar{k}")] < at[("issue", f"ag{k}")]
        if segments > 1:
            assert at[("wait", f"rs{k}")] < at[("issue", f"ar{k}")]
            assert at[("wait", f"ar{k}")] < at[("issue", f"ag{k}")]
        if k + 1 < segments:  # the overlap: ar k is in flight while rs k+1 runs
            assert at[("issue", f"ar{k}")] < at[("issue", f"rs{k + 1}")] \
                < at[("wait", f"ar{k}")]


@pytest.fixture(scope="module")
def gpt():
    """gpt-tiny on meta, captured once (forward graph: what planning prices)."""
    from autohybrid.capture import capture
    model = ah.models.preset("gpt-tiny", device="meta")
    (x,), _ = ah.models.example_batch("gpt-tiny", 16)
    return capture(model, (x,), with_loss=False), model, (x,)


def _gpt_plan(gpt, cluster: ah.Cluster, **pinned) -> Plan:
    from autohybrid.planning import make_plan
    forward, model, inputs = gpt
    return make_plan(forward, None, model, cluster, inputs, None, None,
                     ah.Constraints(**pinned), "adam", executable_only=False)


@pytest.mark.timeout(60)
def test_planner_picks_the_algorithm_the_model_prices_fastest(gpt):
    """2 nodes × 4 CPU ranks on one shared NIC: each algorithm pinned in turn, then free;
    the free choice is the fastest of the three, and it is not the flat ring."""
    cluster = _cpu(2)
    shape = dict(dp=8, tp=1, pp=1, zero=0, num_microbatches=1, recompute="none")
    steps = {a: _gpt_plan(gpt, cluster, **shape, collective_algorithm=a)
             for a in ("flat", "hierarchical", "segmented")}
    for algorithm, plan in steps.items():
        assert plan.collective_algorithm == algorithm and plan.executable
    chosen = _gpt_plan(gpt, cluster, **shape)
    fastest = min(steps, key=lambda a: steps[a].predicted.step_time_s)
    assert chosen.collective_algorithm == fastest != "flat"
    assert chosen.predicted.step_time_s == steps[fastest].predicted.step_time_s
    assert steps["flat"].predicted.step_time_s > chosen.predicted.step_time_s
    # unpinned but ZeRO: its gradients are reduce-scattered, "flat"
    assert _gpt_plan(gpt, cluster, dp=8, tp=1, pp=1, zero=1).collective_algorithm == "flat"
    # one node: nothing to gain, the flat ring is recorded
    assert _gpt_plan(gpt, ah.Cluster.local(4), dp=4, pp=1).collective_algorithm == "flat"
    # a dp group with one rank per node (tp fills each node): flat as well
    assert _gpt_plan(gpt, cluster, dp=2, tp=4, pp=1, zero=0).collective_algorithm == "flat"


@pytest.mark.timeout(60)
def test_pinned_algorithm_is_recorded_and_zero_keeps_flat(gpt):
    plan = _gpt_plan(gpt, ah.Cluster.local(2), collective_algorithm="segmented")
    assert plan.collective_algorithm == "segmented" and plan.zero == 0 and plan.executable
    assert Plan.from_json(plan.to_json()) == plan
    # ZeRO 1-3 reduce-scatter: a pinned non-flat algorithm with them is refused, naming both
    for zero in (1, 2, 3):
        with pytest.raises(PlanError, match=rf"collective_algorithm='hierarchical'.*zero={zero}"
                                            r".*zero=0.*'flat'"):
            ah.Constraints(zero=zero, collective_algorithm="hierarchical")
    with pytest.raises(PlanError, match=r"plan\.collective_algorithm='segmented' with "
                                        r"plan\.zero=2"):
        dataclasses.replace(plan, zero=2)
    assert ah.Constraints(zero=2, collective_algorithm="flat").zero == 2


# ============================================================================ two nodes
def _lines(log: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for m in re.finditer(r"^hierarchical rank (\d) node (\d) local (\d): (.*)$", log,
                         re.MULTILINE):
        out.setdefault(int(m.group(1)), []).append(m.group(4))
    return out


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_two_nodes_sum_bit_for_bit_and_train_like_eager(two_nodes_logs):
    """tests/scripts/hierarchical_train.py's lines, from the job that also runs
    test_multinode's check (tests/conftest.py `two_nodes_logs`)."""
    logs = two_nodes_logs
    for node, log in enumerate(logs):
        here = list(range(node * PER_NODE, (node + 1) * PER_NODE))
        ranks = _lines(log)
        assert sorted(ranks) == here, _readable(log)
        for rank, lines in ranks.items():
            text = "\n".join(lines)
            assert "MISMATCH" not in text and lines[-1] == "OK", _readable(log)
            assert f"intra {here}" in lines                     # its node's ranks
            assert f"inter {[rank % PER_NODE, rank % PER_NODE + PER_NODE]}" in lines
            assert any(re.fullmatch(r"sums \d+ tensors bit-for-bit", line) for line in lines)
            for case, algorithm in (("hier-sgd", "hierarchical"), ("hier-adamw", "hierarchical"),
                                    ("seg-sgd", "segmented"), ("seg-adamw", "segmented")):
                [line] = [line for line in lines if line.startswith(case + " ")]
                assert f"pp1×dp4×tp1 {algorithm}" in line and line.endswith(
                    f"intra{here} inter{[rank % PER_NODE, rank % PER_NODE + PER_NODE]}; "
                    "equal to eager"), line
            buckets = [int(re.search(r"(\d+) buckets", line).group(1)) for line in lines
                       if line.startswith(("hier-sgd ", "seg-adamw "))]
            assert min(buckets) > 1, lines  # several buckets in flight at once
