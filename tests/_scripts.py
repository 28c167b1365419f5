"""Run one of the repository's scripts (examples/, benchmarks/) as a user would: a fresh
Python with the checkout importable and one thread per process; its stdout, once it
exited 0 (else the assertion shows the end of its stderr)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from _limits import guard

ROOT = Path(__file__).resolve().parents[1]


def run_script(path: str, *args: str, timeout_s: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, path, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=guard(timeout_s))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
