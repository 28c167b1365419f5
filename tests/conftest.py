"""Test tiers and hang guards, for every test module.

Tiers. A test that starts processes (`ah.launch`, torchrun, a subprocess, a browser) is
marked `procs` (per test, or per module with `pytestmark`), one that is process-free but
takes seconds alone (GPT-3-scale models, brute force) `slow`. `make test-fast` runs the
rest with AUTOHYBRID_TEST_TIER=fast: capture, cost model, search and passes in one
process (a rank's program is rewritten on torch's fake process group). In that tier
starting a process anywhere (a test or a fixture of any scope) fails at once, naming the
test and the mark it lacks, so the tier stays process-free. `make test` runs everything
in two parts: AUTOHYBRID_TEST_TIER=free (every process-free test, `slow` included, on two
pytest-xdist workers: one test process per core, where a lone process would leave a core
idle; processes refused as in the fast tier) and then AUTOHYBRID_TEST_TIER=procs (the
tests marked `procs`, in one process, so their warm ranks and capture memo carry over).

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

TIER = os.environ.get("AUTOHYBRID_TEST_TIER", "")
if TIER not in ("", "fast", "free", "procs"):
    raise pytest.UsageError(f"AUTOHYBRID_TEST_TIER={TIER!r}: use fast, free, procs or unset")
FAST = TIER == "fast"
#: the tiers that refuse to start processes
PROCESS_FREE = TIER in ("fast", "free")


def _import_triton_for_its_interpreter() -> None:
    """Triton decides at import whether its library's @jit helpers (tl.sum's combine
    functions, ...) can run in its interpreter, from TRITON_INTERPRET. Imported here,
    before any test module imports it, with the variable set; then the variable is
    unset again, so that only the tests that ask for the interpreter (test_codegen's
    fixture, test_fusion) run kernels in it: left set for the whole run, every
    multi-process test ran its fused regions interpreted instead of eager
    (ops/fused.py reads the variable at each call)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:   # no Triton: its tests skip or fall back to eager
        pass
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_for_its_interpreter()

#: every tensor handed to a collective is checked to be on the compiled model's device
#: (autohybrid/runtime/device_check.py): in every rank of every multi-process test (the
#: warm ranks of tests/_pool.py and ah.launch's read the test process's environment at
#: each run; torchrun's inherit it too). Set it to 0 to run without.
os.environ.setdefault("AUTOHYBRID_CHECK_COLLECTIVE_DEVICES", "1")

#: the capture memo keeps 256 graphs instead of 16 (autohybrid/capture_cache.py): a warm
#: rank (tests/_pool.py) sees dozens of small models across the suite, and at 16 it
#: exported the ones it had dropped again (186 of the multi-process part's 701 CPU-seconds
#: of export on 2026-12-04). A test of the memo's own bound sets it itself.
os.environ.setdefault("AUTOHYBRID_CAPTURE_CACHE_SIZE", "256")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "procs: the test starts processes (not in make "
                                       "test-fast)")
    config.addinivalue_line("markers", "slow: process-free but seconds long (models at "
                                       "scale, brute force; not in make test-fast)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    default = float(config.getini("timeout") or 0)
    for item in items:
        mark = item.get_closest_marker("timeout")
        seconds = float(mark.args[0]) if mark and mark.args else \
            float(mark.kwargs.get("timeout", default)) if mark else default
        if seconds > 0:
            item.add_marker(pytest.mark.timeout(seconds * GUARD_SCALE), append=False)
    if FAST:
        skip = pytest.mark.skip(reason="starts processes or is slow: make test runs it")
        for item in items:
            if item.get_closest_marker("procs") or item.get_closest_marker("slow"):
                item.add_marker(skip)
    elif TIER in ("free", "procs"):   # make test's two parts: each runs what the other does not
        keep = [item for item in items
                if bool(item.get_closest_marker("procs")) == (TIER == "procs")]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep


_current = ["collection"]   # the test being set up, run or torn down (for the message)


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current[0] = item.nodeid


def _refuse_processes() -> None:
    """The fast tier: starting a process anywhere (a test, a fixture of any scope) fails."""
    def refuse(*args, **kwargs):
        pytest.fail(f"{_current[0]} starts a process: mark it @pytest.mark.procs "
                    "(tests/conftest.py), or keep it process-free")
    multiprocessing.process.BaseProcess.start = refuse
    subprocess.Popen.__init__ = refuse


def pytest_sessionstart(session: pytest.Session) -> None:
    # not in an xdist controller (`-n N`: it starts the workers, which run the tests
    # and refuse processes themselves)
    controller = (getattr(session.config.option, "numprocesses", None)
                  and "PYTEST_XDIST_WORKER" not in os.environ)
    if PROCESS_FREE and not controller:
        _warm_font_cache()
        _refuse_processes()


def _warm_font_cache() -> None:
    """matplotlib's first import on a machine builds its font cache by running `fc-list`:
    build it before processes are refused (the tests' plots then import it process-free)."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


@pytest.fixture(scope="session")
def two_nodes_logs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The two node logs of one `torchrun --nnodes 2` job of tests/scripts/two_nodes_train.py,
    which runs the checks of tests/test_multinode.py and tests/test_hierarchical.py in
    turn: each test reads its own lines (a failed job fails both, with both logs)."""
    from test_multinode import run_both_checks
    return run_both_checks(tmp_path_factory.mktemp("two_nodes"))
