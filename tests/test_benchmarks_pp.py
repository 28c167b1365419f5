"""The pipeline benchmarks run (smoke tests on tiny models; their figures are not checked):
benchmarks/pipeline_balance.py --quick as a user runs it, and the pp rows of
benchmarks/runtime_overhead.py on one step. Both compare autohybrid with hand-written
torch.distributed.pipelining runs of the same model, whose losses must agree."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import autohybrid as ah
from _limits import guard
from _scripts import run_script

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_pipeline_balance_quick():
    out = run_script("benchmarks/pipeline_balance.py", "--quick", timeout_s=110)
    assert re.search(r"boundaries: autohybrid \['model\.[\w.]+'\] .* pipeline\(\) equal "
                     r"\['model\.blocks\.2'\]", out), out
    diff = float(re.search(r"max \|difference\| over 3 steps ([\d.e+-]+)", out).group(1))
    assert diff < 1e-5, out
    row = re.search(r"^\s+2\s+4\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert row and all(float(x) > 0 for x in row.groups()), out


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_runtime_overhead_pp_rows():
    import runtime_overhead as ro

    config = dict(layers=2, hidden=32, heads=2, vocab=128, seq=16, tie_embeddings=False)
    results = ah.launch(ro.run_pp_rank, ah.Cluster.local(2), args=(2, config, 8, 1, 1),
                        timeout_s=guard(100))
    first, last = results
    assert first["boundaries"] == ("model.blocks.1",)
    assert len(first["ah"]) == len(first["dt"]) == 1
    assert len(last["ah_loss"]) == len(last["dt_loss"]) == 2
    for a, d, e in zip(last["ah_loss"], last["dt_loss"], first["eager_loss"]):
        assert abs(a - d) < 1e-5 and abs(a - e) < 1e-5, (last, first["eager_loss"])
