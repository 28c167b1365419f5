"""benchmarks/layouts.py on a tiny GPT (one step per variant; its timings are not
checked): each layout runs against the baseline baselines.py chooses for it, the plan
pinned to the layout, with losses equal to eager's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_layouts_run_against_their_baselines(capsys, tmp_path):
    import layouts

    out = tmp_path / "table.txt"
    results = layouts.main(["--model", "gpt-tiny?layers=2", "--worlds", "2",
                            "--layouts", "zero1", "tp", "--steps", "1", "--warmup", "0",
                            "--out", str(out), "--no-calibration"])
    assert [(r["layout"], r["baseline"]) for r in results] == [
        ("zero1", "DDP+ZeroRedundancyOpt"), ("tp", "DTensor")]
    assert [r["mesh"] for r in results] == ["pp1×dp2×tp1", "pp1×dp1×tp2"]
    for r in results:
        assert r["available"] and r["losses"] == "equal" and r["paired"] > 0
    printed = capsys.readouterr().out
    assert "DDP+ZeroRedundancyOpt" in printed and "paired" in printed
    assert out.read_text().count("\n") >= 4
    with pytest.raises(SystemExit):
        layouts.main(["--layouts", "zero4"])
