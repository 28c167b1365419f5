"""Measured and predicted per-rank timelines (runtime/profile.py, report/timeline.py).

One `ah.launch` of 2 ranks compiles gpt-tiny twice — dp 2 with small gradient buckets
and tp 2 — and profiles 2 training steps of each (`compiled.profile`); the tests read
the gathered timelines. The predicted timelines come from `ah.plan` alone (no processes).
"""
from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from autohybrid.report.timeline import (Interval, Timeline, predicted_timeline, subtract,
                                        total, union, write_chrome_trace)
from autohybrid.runtime.profile import timeline_from_events

LAUNCH_TIMEOUT_S = guard(240)  # below the measured tests' timeout: launch then says why
BUCKET_MB = 0.03        # gpt-tiny's ~116 KB of fp32 gradients in ≥ 2 buckets
DP = ah.Constraints(dp=2, tp=1, pp=1, zero=0, bucket_mb=BUCKET_MB)
TP = ah.Constraints(dp=1, tp=2, pp=1, zero=0)
PP = ah.Constraints(dp=1, tp=1, pp=2, zero=0, schedule="1f1b", num_microbatches=4)
TOL_S = 1e-6            # rounding of the profiler's microsecond timestamps


def _lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _batches(n: int = 2, batch: int = 8):
    return [ah.models.example_batch("gpt-tiny", batch, seed=100 + s) for s in range(n)]


@functools.lru_cache(maxsize=None)
def _plan(constraints: ah.Constraints) -> ah.Plan:
    """gpt-tiny planned for 2 local ranks (no processes; the model on the meta device)."""
    return ah.plan(ah.models.preset("gpt-tiny", device="meta"), ah.Cluster.local(2),
                   _batches(1)[0][0], constraints=constraints)


def _measure_rank(rank: int) -> dict:
    out = {}
    for name, constraints in (("dp", DP), ("tp", TP)):
        torch.manual_seed(0)
        batches = _batches()
        inputs, targets = batches[0]
        compiled = ah.compile(ah.models.preset("gpt-tiny"), ah.Cluster.local(2), inputs,
                              loss_fn=_lm_loss, example_targets=targets,
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                              constraints=constraints)
        timeline = compiled.profile(batches, steps=2, warmup=1)
        out[name] = (timeline, len(compiled.executor.reducer.buckets))
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    _plan(DP)  # captures once here, so the forked ranks start with torch.export warmed up
    results = ah.launch(_measure_rank, ah.Cluster.local(2), timeout_s=LAUNCH_TIMEOUT_S)
    return results[0]


def _check_well_formed(timeline: Timeline, world: int, steps: int) -> None:
    assert sorted(timeline.ranks) == list(range(world))
    for rank, intervals in timeline.ranks.items():
        spans = {iv.step: iv for iv in intervals if iv.kind == "step"}
        assert sorted(spans) == list(range(steps)), (rank, sorted(spans))
        for iv in intervals:
            assert iv.kind in ("step", "compute", "communication"), iv
            assert iv.start_s <= iv.end_s, iv
            span = spans[iv.step]
            assert span.start_s - TOL_S <= iv.start_s and iv.end_s <= span.end_s + TOL_S, \
                (rank, iv, span)
        for step in range(steps):
            s = timeline.summary(rank, step)
            assert s.comm_s > 0, s
            assert s.exposed_comm_s <= s.comm_s + TOL_S, s
            assert 0 < s.compute_s <= s.step_time_s + TOL_S, s


# ---------------------------------------------------------------------------- measured
@pytest.mark.procs
@pytest.mark.timeout(300)
def test_dp_buckets_all_reduce_during_backward(measured):
    """dp 2, ≥ 2 buckets: on every rank and step, gradient all-reduces are issued while
    the backward still computes (they end up in the communication lane inside the
    backward, from issue to completion on gloo's worker thread)."""
    timeline, buckets = measured["dp"]
    assert buckets >= 2
    _check_well_formed(timeline, 2, 2)
    for rank in timeline.ranks:
        for step in range(2):
            backward = timeline.intervals(rank, "compute", step, "backward")
            assert backward, f"rank {rank} step {step}: no backward compute found"
            backward_end = max(iv.end_s for iv in backward)
            reduces = [iv for iv in timeline.intervals(rank, "communication", step)
                       if iv.name == "all_reduce"]
            early = [iv for iv in reduces if iv.start_s < backward_end]
            # every bucket but possibly the last is launched before the backward ends
            assert len(early) >= buckets - 1, (rank, step, buckets, early)
            assert all(iv.phase == "backward" for iv in early), early
            assert any("gloo:" in iv.args.get("transfer", "") for iv in early), early
            # the loss totals' all-reduce comes after the backward
            assert len(reduces) >= buckets + 1


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_tp_collectives_between_forward_compute(measured):
    """tp 2: the forward's tensor-parallel all-reduces sit between forward compute."""
    timeline, _ = measured["tp"]
    _check_well_formed(timeline, 2, 2)
    for rank in timeline.ranks:
        for step in range(2):
            forward = timeline.intervals(rank, "compute", step, "forward")
            comm = timeline.intervals(rank, "communication", step, "forward")
            between = [c for c in comm
                       if any(f.end_s <= c.start_s + TOL_S for f in forward)
                       and any(f.start_s >= c.end_s - TOL_S for f in forward)]
            assert between, (rank, step, comm)
            assert {c.name for c in between} & {"all_reduce", "all_gather", "reduce_scatter"}


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_chrome_trace_files(measured, tmp_path):
    """Measured, predicted, and both side by side, written as Chrome trace JSON."""
    timeline, _ = measured["dp"]
    predicted = predicted_timeline(_plan(DP))
    for name, parts, processes in (("measured", (timeline,), 2), ("predicted", (predicted,), 2),
                                   ("both", (timeline, predicted), 4)):
        path = write_chrome_trace(tmp_path / f"{name}.json", *parts)
        trace = json.loads(path.read_text())
        events = trace["traceEvents"]
        assert events
        for e in events:
            assert {"ph", "pid", "tid", "ts", "dur", "name"} <= set(e), e
        complete = [e for e in events if e["ph"] == "X"]
        assert complete and all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
        names = {e["pid"]: e["args"]["name"] for e in events
                 if e["ph"] == "M" and e["name"] == "process_name"}
        assert len(names) == processes
        assert {e["pid"] for e in complete} == set(names)
        if name != "both":
            assert sorted(names) == [0, 1] and names[0] == "rank 0"
        # overlapping communication intervals never share a lane (tid)
        for pid in names:
            lanes: dict = {}
            for e in complete:
                if e["pid"] == pid and e["cat"] == "communication":
                    lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
            for spans in lanes.values():
                spans.sort()
                assert all(b[0] >= a[1] - 1e-3 for a, b in zip(spans, spans[1:]))


# ---------------------------------------------------------------------------- predicted


def _check_predicted_totals(plan: ah.Plan, timeline: Timeline) -> None:
    p = plan.predicted
    assert sorted(timeline.ranks) == list(range(plan.world_size))
    for rank in timeline.ranks:
        s = timeline.summary(rank, 0)
        assert s.step_time_s == pytest.approx(p.step_time_s, rel=1e-9, abs=1e-12)
        assert s.exposed_comm_s == pytest.approx(p.exposed_comm_s, rel=1e-9, abs=1e-12)
        assert s.comm_s == pytest.approx(p.comm_s, rel=1e-9, abs=1e-12)
        phases = {iv.phase for iv in timeline.intervals(rank, "compute")}
        assert {"forward", "backward"} <= phases


@pytest.mark.timeout(120)
def test_predicted_timeline_dp():
    plan = _plan(DP)
    p = plan.predicted
    assert p.comm_s > 0 and p.step_time_s > 0
    timeline = predicted_timeline(plan)
    _check_predicted_totals(plan, timeline)
    for rank in timeline.ranks:
        forward = timeline.intervals(rank, "compute", 0, "forward")
        backward = timeline.intervals(rank, "compute", 0, "backward")
        assert len(forward) == len(backward) == plan.num_microbatches
        # the hidden part of the gradient sync overlaps the (last) backward
        hidden = [iv for iv in timeline.intervals(rank, "communication")
                  if "hidden" in iv.name]
        if p.comm_s > p.exposed_comm_s:
            assert hidden and all(iv.end_s <= backward[-1].end_s + 1e-12 for iv in hidden)


@pytest.mark.timeout(120)
def test_predicted_timeline_pp2_1f1b():
    plan = _plan(PP)
    assert (plan.mesh.pp, plan.schedule, plan.num_microbatches) == (2, "1f1b", 4)
    timeline = predicted_timeline(plan)
    _check_predicted_totals(plan, timeline)
    assert timeline.meta["schedule_scale"] == pytest.approx(1.0)  # 1F1B: sim = formula
    first = {}
    for rank in timeline.ranks:
        compute = timeline.intervals(rank, "compute", 0)
        slots = [iv for iv in compute if iv.phase in ("forward", "backward")]
        assert [iv.phase for iv in slots].count("forward") == 4
        assert [iv.phase for iv in slots].count("backward") == 4
        assert all(a.end_s <= b.start_s + 1e-12 for a, b in zip(slots, slots[1:]))
        first[rank] = slots[0]
    # rank 1 starts when rank 0's first forward is done: the pipeline fills
    assert first[0].start_s == 0.0
    assert first[1].start_s == pytest.approx(first[0].end_s)
    # 1F1B on the last stage: forward, backward alternate from the start
    last = [iv.phase for iv in timeline.intervals(1, "compute", 0)][:4]
    assert last == ["forward", "backward", "forward", "backward"]


# ---------------------------------------------------------------------------- arithmetic
class _FakeEvent:
    def __init__(self, name, start, end, thread=1):
        self.name, self.thread = name, thread
        self.time_range = type("R", (), {"start": start, "end": end})()


@pytest.mark.timeout(30)
def test_exposed_communication_from_events():
    """Synthetic profiler events (µs): forward 0–30, an async bucket all-reduce issued at
    40 inside the backward (40–60) that completes on a worker thread at 75 while the main
    thread waits from 60 (wait ends when the next op starts, at 76), then a synchronous
    all-reduce 80–82 completing at 90, optimizer 92–100."""
    events = [
        _FakeEvent("ah::step0", 0, 100),
        _FakeEvent("aten::linear", 1, 30),
        _FakeEvent("autograd::engine::evaluate_function: AddmmBackward0", 31, 45),
        _FakeEvent("aten::mm", 32, 39),
        _FakeEvent("c10d::allreduce_", 40, 42),
        _FakeEvent("gloo:all_reduce", 41, 75, thread=2),
        _FakeEvent("autograd::engine::evaluate_function: AddmmBackward0", 45, 60),
        _FakeEvent("aten::mm", 45, 60),
        _FakeEvent("aten::mul", 76, 79),
        _FakeEvent("c10d::allreduce_", 80, 82),
        _FakeEvent("gloo:all_reduce", 81, 90, thread=2),
        _FakeEvent("Optimizer.step#SGD.step", 92, 100),
        _FakeEvent("aten::add_", 92, 100),
    ]
    timeline = timeline_from_events(events, rank=0, trace_start_s=0.0)
    comm = timeline.intervals(0, "communication")
    assert [(round(c.start_s * 1e6), round(c.end_s * 1e6), c.phase) for c in comm] == \
        [(40, 75, "backward"), (80, 90, "after-backward")]
    s = timeline.summary(0, 0)
    # exposed: the bucket's issue call (40–42), its wait (60–76, clipped to 75), the
    # synchronous all-reduce's call and wait (80–90; gap 82–92 holds its completion)
    assert s.exposed_comm_s * 1e6 == pytest.approx(2 + 15 + 10)
    assert s.comm_s * 1e6 == pytest.approx(35 + 10)
    phases = [(iv.phase, round(iv.start_s * 1e6), round(iv.end_s * 1e6))
              for iv in timeline.intervals(0, "compute")]
    assert phases[0] == ("forward", 0, 31)
    assert ("optimizer", 92, 100) in phases
    assert any(p == "backward" for p, _, _ in phases)


def test_interval_arithmetic():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert total(subtract([(0, 10), (20, 30)], [(8, 22)])) == 16
    iv = Interval("compute", "forward", 1.0, 2.5, 0, "forward")
    assert iv.duration_s == 1.5


# ---------------------------------------------------------------------------- CNN hybrids
def _cnn_rank(rank: int) -> dict:
    """A small 3-D CNN under spatial 2 and under filter/channel (tp 2), 2 measured steps
    each (after 1 warm-up), and the predicted timeline of each plan."""
    out = {}
    for name, constraints in (("spatial", ah.Constraints(tp=2, pp=1, spatial=(2,))),
                              ("filter", ah.Constraints(tp=2, dp=1, pp=1, sp=False))):
        torch.manual_seed(0)
        model = ah.models.cosmoflow(channels=[4, 8], in_channels=2, image_size=8, hidden=8,
                                    outputs=4)
        g = torch.Generator().manual_seed(3)
        batches = [((torch.randn(2, 2, 8, 8, 8, generator=g),), torch.randn(2, 4, generator=g))
                   for _ in range(3)]
        compiled = ah.compile(model, ah.Cluster.local(2), batches[0][0],
                              loss_fn=torch.nn.functional.mse_loss,
                              example_targets=batches[0][1],
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                              constraints=constraints)
        out[name] = (compiled.profile(batches, steps=2, warmup=1),
                     predicted_timeline(compiled.plan), compiled.plan)
    return out


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_cnn_hybrids_show_their_halo_exchanges_and_channel_sums():
    """Spatial 2: the halo exchanges (all_to_all) sit in the forward and the backward of
    every step; filter/channel (tp 2): the channel-split convs' all-reduces in the
    forward. The predicted timelines of both plans add up to their predictions."""
    measured = ah.launch(_cnn_rank, ah.Cluster.local(2), timeout_s=LAUNCH_TIMEOUT_S)[0]
    spatial, predicted, plan = measured["spatial"]
    _check_well_formed(spatial, 2, 2)
    _check_predicted_totals(plan, predicted)
    for rank in spatial.ranks:
        for step in range(2):
            halos = [iv for iv in spatial.intervals(rank, "communication", step)
                     if iv.name == "all_to_all"]
            assert {iv.phase for iv in halos} >= {"forward", "backward"}, (rank, step, halos)
    filtered, predicted, plan = measured["filter"]
    _check_well_formed(filtered, 2, 2)
    _check_predicted_totals(plan, predicted)
    for rank in filtered.ranks:
        for step in range(2):
            sums = [iv for iv in filtered.intervals(rank, "communication", step, "forward")
                    if iv.name == "all_reduce"]
            assert sums, (rank, step, filtered.intervals(rank, "communication", step))
