"""`make test`'s parts (tests/conftest.py): the process-free part, on xdist workers,
refuses a process started by an unmarked test and leaves the `procs` tests to the other
part, which runs only them; so each test runs in exactly one part, and the process-free
part stays process-free under xdist (whose controller starts the workers itself)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _limits import guard

TESTS = Path(__file__).resolve().parent

MODULE = """
    import subprocess, sys
    import pytest

    def test_starts_a_process_unmarked():
        subprocess.run([sys.executable, "-c", "pass"], check=True)

    def test_process_free():
        pass

    @pytest.mark.procs
    def test_marked_procs():
        subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def _pytest(tmp_path: Path, tier: str, *args: str) -> str:
    (tmp_path / "test_tiered.py").write_text(textwrap.dedent(MODULE))
    env = {**os.environ, "AUTOHYBRID_TEST_TIER": tier, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "conftest", "-rA", *args, "test_tiered.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=guard(120))
    return proc.stdout + proc.stderr


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_the_two_parts_split_the_tests_and_the_free_part_refuses_processes(tmp_path):
    free = _pytest(tmp_path, "free", "-n", "2")
    assert "test_starts_a_process_unmarked starts a process: mark it" in free, free
    assert "PASSED test_tiered.py::test_process_free" in free, free
    assert "1 failed, 1 passed" in free and "test_marked_procs" not in free, free
    procs = _pytest(tmp_path, "procs")
    assert "PASSED test_tiered.py::test_marked_procs" in procs, procs
    assert "1 passed, 2 deselected" in procs, procs
