"""Test tiers and hang guards, for every test module.

Tiers. A test that starts processes (`ah.launch`, torchrun, a subprocess, a browser) is
marked `procs` (per test, or per module with `pytestmark`). `make test-fast` runs the rest
with AUTOHYBRID_TEST_TIER=fast: capture, cost model, search and passes in one process (a
rank's program is rewritten on torch's fake process group). In that tier a test that
starts a process anyway fails at once, naming the mark it lacks, so the tier stays
process-free. `make test` runs everything.

Hang guards. Time limits in tests are hang guards, never timings: every pytest-timeout
limit (the marks and pyproject's default) is multiplied by `GUARD_SCALE`
(AUTOHYBRID_TEST_GUARD_SCALE, default 3), as are the tests' `ah.launch` limits through
`_limits.guard`, so a loaded machine (a suite run beside other jobs) does not fail them
and a launch limit stays below its test's limit.
"""
from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import pytest

from _limits import GUARD_SCALE

FAST = os.environ.get("AUTOHYBRID_TEST_TIER") == "fast"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "procs: the test starts processes (not in make "
                                       "test-fast)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        seconds = float(mark.args[0]) if mark and mark.args else \
            float(mark.kwargs.get("timeout", default)) if mark else default
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(seconds * GUARD_SCALE), append=False)
    if FAST:
        skip = pytest.mark.skip(reason="starts processes: make test runs it")
        for item in items:
            if item.get_closest_marker("procs"):
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_processes_in_the_fast_tier(request: pytest.FixtureRequest, monkeypatch):
    """In the fast tier, starting a process fails the test (it lacks the procs mark)."""
    if FAST and not request.node.get_closest_marker("procs"):
        def refuse(*args, **kwargs):
            pytest.fail(f"{request.node.nodeid} starts a process: mark it "
                        "@pytest.mark.procs (tests/conftest.py), or keep it process-free")
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield
