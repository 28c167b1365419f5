"""benchmarks/cnn_strategies.py runs (a smoke test on a tiny CosmoFlow; its timings are
not checked): the seven strategies autohybrid executes train the serial run's losses,
the oracle prices all eight, and the two orders are compared."""
from __future__ import annotations

import re

import pytest

from _scripts import run_script


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_cnn_strategies_quick():
    out = run_script("benchmarks/cnn_strategies.py", "--steps", "2", "--warmup", "0",
                     "--size", "16", "--channels", "4,8", "--batch", "4", timeout_s=230)
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
