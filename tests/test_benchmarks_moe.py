"""benchmarks/moe.py on a tiny Mixtral-shaped model (one step per plan; its timings are
not checked): dp only and ep=2 on 2 ranks, their losses equal, the all-to-all measured
in the steps and alone, and predicted."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

TINY = ("mixtral-8x7b?layers=2&hidden=32&heads=4&kv_heads=2&vocab=64&experts=4&top_k=2"
        "&expert_hidden=32&seq=16&batch=4")


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_moe_benchmark_runs_ep_beside_dp(capsys, tmp_path):
    import moe

    out = tmp_path / "moe.txt"
    rows = moe.main(["--model", TINY, "--worlds", "2", "--steps", "1", "--warmup", "0",
                     "--no-calibration", "--chunks", "3", "--out", str(out)])
    assert [(r["world"], r["ep"], r["pinned"]) for r in rows] == [
        (2, 1, False), (2, 2, False), (2, 2, True)]
    dp, ep, chunked = rows
    assert chunked["chunks"] == 3 and chunked["losses"] == "equal"
    assert all(r["losses"] == "equal" and r["step_s"] > 0 for r in rows)
    assert dp["a2a_s"] == dp["predicted_a2a_s"] == 0.0
    assert ep["a2a_s"] > 0 and ep["alone_s"] > 0 and ep["predicted_a2a_s"] > 0
    assert ep["chunks"] >= 1 and dp["chunks"] == 1
    assert "ep=2 (dp=2)" in capsys.readouterr().out and "a2a alone" in out.read_text()
