"""benchmarks/checkpoint.py runs as a user runs it (a smoke test on a tiny GPT, one
repetition; its timings are not checked): every row of the table is printed with finite,
positive times and rates, the resharded loads give back the saved parameters, and the
temporary directory it wrote into is gone."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _limits import guard

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "128", "--seq", "16"]
ROWS = ("autohybrid save / load", "autohybrid load, resharded", "torch.save / torch.load",
        "DCP + get/set_state_dict")


@pytest.mark.procs
@pytest.mark.timeout(60)
def test_checkpoint_benchmark_prints_every_row(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "benchmarks/checkpoint.py", *TINY, "--reps", "1",
                           "--dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=guard(50))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    lines = {name: [ln for ln in out.splitlines() if ln.startswith(name)] for name in ROWS}
    assert [len(found) for found in lines.values()] == [1, 2, 1, 1], out
    for name, found in lines.items():
        for line in found:
            cells = line.split()[-7:]   # save s, GB/s, ×, load s, GB/s, ×, files MB
            numbers = [float(c) for c in cells if c != "—"]
            assert len(numbers) == (3 if "resharded" in name else 7), line
            assert all(math.isfinite(x) and x > 0 for x in numbers), line
            if "resharded" in name:
                assert "(same)" in line, line
    assert list(tmp_path.iterdir()) == [], "the benchmark left files behind"
