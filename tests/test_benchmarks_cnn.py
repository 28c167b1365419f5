"""benchmarks/cnn_strategies.py runs (a smoke test on a tiny CosmoFlow; its timings are
not checked): the seven strategies autohybrid executes train the serial run's losses,
the oracle prices all eight, and the two orders are compared."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _limits import guard

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_cnn_strategies_quick():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "benchmarks/cnn_strategies.py", "--steps", "2", "--warmup", "0",
         "--size", "16", "--channels", "4,8", "--batch", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=guard(230))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    rows = dict(re.findall(r"^(serial|data×spatial|data×filter|data|spatial|filter|channel|"
                           r"pipeline)\s+(.*)$", out, re.M))
    assert len(rows) == 8, out
    for name in ("serial", "data", "spatial", "filter", "pipeline", "data×filter",
                 "data×spatial"):
        predicted, measured = rows[name].split()[:2]
        assert float(predicted) > 0 and float(measured) > 0, out
    assert "not run alone" in rows["channel"], out
    tau = float(re.search(r"Kendall tau over 7 strategies: ([+-][\d.]+)", out).group(1))
    assert -1.0 <= tau <= 1.0, out
    diff = float(re.search(r"largest relative loss difference from serial over every "
                           r"step: ([\d.e+-]+)", out).group(1))
    assert diff < 1e-5, out
