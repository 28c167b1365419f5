"""report/breakdown.py: a step's time by part, from a measured timeline and profiler ops.

Process-free: a synthetic two-step timeline with known compute, communication and op
events, whose parts are worked out by hand below; the median over steps; the cost
model's parts; the printed table; op categories and self times.
"""
from __future__ import annotations

import types

import pytest

from autohybrid.report.breakdown import (StepBreakdown, _self_times, category,
                                         format_breakdown, median_breakdown, op_events,
                                         predicted_parts, step_breakdowns)
from autohybrid.report.timeline import Interval, Timeline

MS = 1e-3
MAIN, OTHER = 7, 9  # thread ids


def _step(k: int, shift_ms: float, slow_ms: float = 0.0):
    """Step k over [shift, shift + 10 + slow] ms: forward 0–3, backward 3–7, optimizer 8–9;
    an all-reduce 5–8.5 (hidden under backward 5–7 and the optimizer 8–8.5, exposed 7–8),
    the batch agreement 9.5–10 (exposed); `slow_ms` more blocked time at the end."""
    t = lambda ms: (shift_ms + ms) * MS  # noqa: E731
    end = 10 + slow_ms
    intervals = [
        Interval("step", f"step {k}", t(0), t(end), k),
        Interval("compute", "forward", t(0), t(3), k, "forward"),
        Interval("compute", "backward", t(3), t(7), k, "backward"),
        Interval("compute", "optimizer", t(8), t(9), k, "optimizer"),
        Interval("communication", "all_reduce", t(5), t(8.5), k),
        Interval("communication", "batch_agreement", t(9.5), t(10), k),
    ]
    us = lambda ms: (shift_ms + ms) * 1e3  # noqa: E731
    ops = [
        (f"ah::step{k}", MAIN, us(0), us(end)),
        ("aten::linear", MAIN, us(0), us(2)),          # self 0.2 ms
        ("aten::addmm", MAIN, us(0.1), us(1.9)),       # self 1.8 ms
        ("aten::add", MAIN, us(2), us(2.5)),           # other ops 0.5 ms
        ("aten::cat", MAIN, us(3), us(3.4)),           # copies 0.4 ms
        ("aten::_scaled_dot_product_flash_attention_for_cpu", MAIN, us(3.5), us(4.5)),
        ("Optimizer.step#SGD.step", MAIN, us(8), us(9)),
        ("aten::add_", MAIN, us(8.1), us(8.9)),        # the optimizer's: not counted
        ("aten::mm", OTHER, us(4), us(6)),             # another thread: not counted
        ("gloo:all_reduce", MAIN, us(5), us(5.1)),
    ]
    return intervals, ops


def _timeline():
    (a, ops_a), (b, ops_b) = _step(0, 0.0), _step(1, 20.0, slow_ms=2.0)
    return Timeline("measured", {0: a + b}, {"trace_start_s": 0.0}), ops_a + ops_b


def test_step_breakdown_parts_by_hand():
    timeline, ops = _timeline()
    first, second = step_breakdowns(timeline, ops, 0)
    assert first.step_s == pytest.approx(10 * MS) and second.step_s == pytest.approx(12 * MS)
    assert first.phases == pytest.approx({"forward": 3 * MS, "backward": 4 * MS,
                                          "optimizer": 1 * MS})
    assert first.compute_s == pytest.approx(8 * MS) and first.optimizer_s == pytest.approx(MS)
    assert first.waits_s == pytest.approx(2 * MS) and second.waits_s == pytest.approx(4 * MS)
    assert first.ops == pytest.approx({"matmul": 2 * MS, "attention": 1 * MS,
                                       "other ops": 0.5 * MS, "copies": 0.4 * MS,
                                       "framework": 3.1 * MS})  # 7 ms of work − 3.9 in ops
    assert first.comm["all_reduce"] == pytest.approx((3.5 * MS, 1 * MS))
    assert first.comm["batch_agreement"] == pytest.approx((0.5 * MS, 0.5 * MS))
    assert first.exposed_comm_s == pytest.approx(1.5 * MS) and first.comm_s == pytest.approx(4 * MS)
    assert StepBreakdown.from_dict(first.to_dict()) == first


def test_a_shifted_trace_start_moves_the_ops_with_the_timeline():
    """`ops` are µs from the trace start; the timeline's seconds carry its start."""
    (a, ops) = _step(0, 0.0)
    moved = [Interval(iv.kind, iv.name, iv.start_s + 100.0, iv.end_s + 100.0, iv.step,
                      iv.phase) for iv in a]
    (got,) = step_breakdowns(Timeline("measured", {0: moved}, {"trace_start_s": 100.0}),
                             ops, 0)
    assert got.ops["matmul"] == pytest.approx(2 * MS)
    assert got.ops["framework"] == pytest.approx(3.1 * MS)


def test_median_breakdown_is_the_median_step_whole():
    steps = [StepBreakdown(s, w, {"forward": f}, {"matmul": m}, comm)
             for s, w, f, m, comm in [(1.0, 0.1, 0.5, 0.2, {"all_reduce": (0.3, 0.1)}),
                                      (3.0, 0.3, 0.7, 0.4, {}),
                                      (2.0, 0.9, 0.6, 0.3, {"all_reduce": (0.5, 0.2)}),
                                      (4.0, 0.2, 3.9, 0.1, {})]]
    assert median_breakdown(steps) is steps[2]          # 2.0 of 1, 2, 3, 4: the shorter
    assert median_breakdown(steps[:3]) is steps[2]
    # one step's own parts: its compute lies within its duration
    assert median_breakdown(steps).compute_s <= median_breakdown(steps).step_s
    with pytest.raises(ValueError):
        median_breakdown([])


def test_predicted_parts():
    pred = types.SimpleNamespace(step_time_s=10.0, compute_s=6.0, exposed_comm_s=1.0,
                                 comm_s=3.0)
    assert predicted_parts(pred) == {"step_s": 10.0, "compute_s": 6.0, "exposed_comm_s": 1.0,
                                     "hidden_comm_s": 2.0, "optimizer_s": 3.0}


def test_format_breakdown_puts_variants_side_by_side():
    timeline, ops = _timeline()
    first, _ = step_breakdowns(timeline, ops, 0)
    no_agreement = StepBreakdown(first.step_s, first.waits_s, first.phases, first.ops,
                                 {"all_reduce": first.comm["all_reduce"]})
    table = format_breakdown([("autohybrid", first), ("DDP", no_agreement), ("x", None)],
                             {"step_s": 0.009, "compute_s": 0.007})
    lines = table.splitlines()
    assert lines[0].split() == ["ms", "autohybrid", "DDP", "predicted"]
    row = lambda label: next(l for l in lines if l.strip().startswith(label)).split()  # noqa: E731
    assert row("step")[-3:] == ["10.00", "10.00", "9.00"]
    assert row("compute (main thread)")[-3:] == ["7.00", "7.00", "7.00"]
    assert row("framework")[-2:] == ["3.10", "3.10"]
    assert row("all_reduce exposed/hidden")[-2:] == ["1.00/2.50", "1.00/2.50"]
    assert row("batch_agreement exposed/hidden")[-2:] == ["0.50/0.00", "—"]
    assert row("communication exposed")[-2:] == ["1.50", "1.00"]  # no prediction given
    assert lines[-1] == "no breakdown: x"
    assert "predicted" not in format_breakdown([("a", first)]).splitlines()[0]


def test_categories_and_self_times():
    assert category("aten::addmm") == category("aten::linear") == "matmul"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("aten::copy_") == category("aten::cat") == "copies"
    assert category("aten::gelu") == category("aten::mmx") == "other ops"
    # a ⊃ b ⊃ c, then d inside a: self = span minus direct children
    got = _self_times([("d", 0, 5.0, 6.0), ("a", 0, 0.0, 10.0), ("c", 0, 2.0, 3.0),
                       ("b", 0, 1.0, 4.0), ("e", 0, 10.0, 11.0)])
    assert got == [("a", 0.0, 6.0), ("b", 1.0, 2.0), ("c", 2.0, 1.0), ("d", 5.0, 1.0),
                   ("e", 10.0, 1.0)]
    events = [types.SimpleNamespace(name="aten::mm", thread=3, device_type="DeviceType.CPU",
                                    time_range=types.SimpleNamespace(start=1, end=4)),
              types.SimpleNamespace(name="kernel", thread=0, device_type="DeviceType.CUDA",
                                    time_range=types.SimpleNamespace(start=2, end=3))]
    assert op_events(events) == [("aten::mm", 3, 1.0, 4.0)]
