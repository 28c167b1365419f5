"""Hang guards for tests: limits sized for a loaded machine, never timings.

`guard(seconds)` scales a limit by GUARD_SCALE (AUTOHYBRID_TEST_GUARD_SCALE, default 3);
tests/conftest.py scales every pytest-timeout limit by the same factor, so a launch limit
stays below the limit of the test that launches.
"""
from __future__ import annotations

import os

GUARD_SCALE = float(os.environ.get("AUTOHYBRID_TEST_GUARD_SCALE", "3"))


def guard(seconds: float) -> float:
    """`seconds` (enough on an idle 2-core machine, with margin) as a hang guard."""
    return seconds * GUARD_SCALE
