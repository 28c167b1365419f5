"""The examples run, on tiny configurations, as a user would run them."""
from __future__ import annotations

import re

import pytest
from _scripts import run_script


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_demo_trains_and_matches_eager():
    out = run_script("examples/demo.py", "--steps", "3", "--world-size", "2", "--layers",
                     "1", "--hidden", "32", "--batch", "4", timeout_s=230)
    assert "mesh            pp1×dp2×tp1" in out
    assert "all 2 ranks report the same loss: True" in out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)", out, re.M)
    assert len(rows) == 3, out
    for _step, compiled, eager, _diff in rows:
        assert abs(float(compiled) - float(eager)) <= 1e-5 * abs(float(eager)), out
    largest = float(re.search(r"largest parameter difference from eager after 3 steps: "
                              r"([\d.e+-]+)", out).group(1))
    assert largest < 1e-3, out


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_cnn_spatial_example_tiles_under_its_memory_limit_and_matches_eager():
    """examples/cnn_spatial.py: below the memory every untiled plan needs, the planner
    tiles the volumes, and the compiled losses and parameters are eager's."""
    out = run_script("examples/cnn_spatial.py", "--steps", "2", "--size", "24",
                     "--channels", "4,8,8", timeout_s=230)
    assert re.search(r"no plan without tiles fits: the ranks get that limit", out), out
    mesh = re.search(r"^mesh (\S+); largest parameter difference from eager after 2 steps: "
                     r"([\d.e+-]+)", out, re.M)
    assert mesh and "spatial" in mesh.group(1), out
    assert float(mesh.group(2)) < 1e-12, out
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)", out, re.M)
    assert len(rows) == 2, out
    for _step, compiled, eager, _diff in rows:
        assert abs(float(compiled) - float(eager)) <= 1e-9 * abs(float(eager)), out
