"""The dp/ZeRO rows of benchmarks/runtime_overhead.py and the plan rows of
benchmarks/cost_model_accuracy.py run (smoke tests on tiny models, 1–2 steps; their
timings are not checked): each ZeRO stage trains against its torch counterpart (DDP, DDP
+ ZeroRedundancyOptimizer, FSDP2) to the same losses, and the cost benchmark's pinned plans
(those with a code path of their own: ZeRO-2 with microbatches, ZeRO-3, tp + sp, pp, and
pp × dp on 4 ranks) compile as pinned, train and are priced."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

import autohybrid as ah
from _limits import guard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

TINY = dict(layers=2, hidden=32, heads=2, vocab=128, seq=16)
#: of cost_model_accuracy.PLANS (planning takes seconds each: not all of them)
PLAN_ROWS = ("dp2 zero3", "pp2 dp2 1f1b")


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_runtime_overhead_dp_rows():
    import runtime_overhead as ro

    results = ah.launch(ro.run_dp_rank, ah.Cluster.local(2), args=(2, TINY, 8, 1, 1),
                        timeout_s=guard(100))
    first = results[0]
    assert sorted(first["stages"]) == [0, 1, 2, 3]
    for stage, pair in first["stages"].items():
        assert f"dp2×tp1 microbatch 4×1 zero{stage} " in first["plans"][stage]
        assert len(pair["ah"]) == len(pair["dt"]) == len(pair["dt_cpu"]) == 1
        assert len(pair["ah_loss"]) == len(pair["dt_loss"]) == 2
        for a, d, e in zip(pair["ah_loss"], pair["dt_loss"], first["eager_loss"]):
            assert abs(a - d) < 1e-5 and abs(a - e) < 1e-5, (stage, pair, first["eager_loss"])
        row = ro.summarize([r["stages"][stage] for r in results], pair)
        assert row["ah_ms"] > 0 and row["dt_ms"] > 0 and row["diff"] < 1e-5


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_cost_model_accuracy_plan_rows(capsys):
    import cost_model_accuracy as cma

    rows = [dataclasses.replace(row, config=TINY, batch=8) for row in cma.PLANS
            if row.name in PLAN_ROWS]
    assert len(rows) == len(PLAN_ROWS)
    results = cma.measure(rows, steps=1, rounds=1, profile=None)
    for row, res in zip(rows, results):
        pinned = row.constraints.pinned()
        assert f"pp{pinned['pp']}×dp{pinned['dp']}×tp{pinned['tp']}" in res["plan"], (row, res)
        if "zero" in pinned:
            assert f" zero{pinned['zero']} " in res["plan"], (row, res)
        assert ("+sp" in res["plan"]) == bool(pinned.get("sp")), (row, res)
        assert res["predicted"] > 0 and len(res["times"]) == len(res["cpu"]) == 1
    cma.report("plans", rows, results)
    out = capsys.readouterr().out
    assert "Kendall τ" in out and "pp2 dp2 1f1b" in out


def test_kendall_tau():
    import cost_model_accuracy as cma

    assert cma.kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert cma.kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert cma.kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
