"""benchmarks/plan_choice.py on a tiny GPT (one step per plan, uncalibrated: its timings are
not checked): the planner's choice and its listed alternatives are made again from their
constraints with their own predictions, every one runs on 2 ranks, and all of them train
the same function (the same first loss)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

TINY = dict(layers=2, hidden=32, heads=2, vocab=128, seq=16)


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_plan_choice_runs_the_chosen_plan_and_its_alternatives(capsys):
    import plan_choice as pc

    case = dataclasses.replace(pc.CASES["gpt-2"], config=TINY, batch=8)
    cands = pc.candidates(case, None, max_plans=4)
    assert cands[0].label == "chosen" and len(cands) == 4
    for cand in cands[1:]:
        assert cand.plan is not None, cand.refused
        assert cand.plan.predicted.step_time_s == cand.predicted_s
        assert cand.plan.mesh.describe() in cand.summary
    assert len({c.summary for c in cands}) == 4
    pc.measure(case, cands, steps=1, rounds=1)
    out = pc.report(case, cands)
    assert out["plans"] == 4 and all(len(c.times) == 1 for c in cands)
    assert out["loss_diff"] < 1e-5, [c.first_loss for c in cands]
    assert -1.0 <= out["tau"] <= 1.0 and out["choice"] >= 1.0
    printed = capsys.readouterr().out
    assert "Kendall τ" in printed and "chosen / measured best" in printed
    assert all(c.summary in printed for c in cands)
