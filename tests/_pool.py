"""Warm ranks for the multi-process tests: one set of forked rank processes, reused by
every test that launches ranks (as PyTorch's MultiProcContinuousTest reuses its ranks
across test methods). Process i serves rank i of every world of more than i ranks, so
the two processes every 2-rank test runs on are also ranks 0 and 1 of the 3-, 4- and
8-rank tests, and each graph they captured (autohybrid/capture_cache.py) is found again
whatever the world size. A process is forked when a world first needs it.

`launch(main, world, args=..., timeout_s=...)` behaves as `ah.launch(main,
ah.Cluster.local(world), ...)` for a test: `main(rank, *args)` runs on every rank with a
fresh default process group (gloo, its own store), and the results come back in rank
order; the first rank to raise makes it raise `ah.RankFailure` with that rank's
traceback, and a run past `timeout_s` raises `ah.RuntimeFailure`. What it saves is the
start of the ranks: the fork, the imports, torch.export's first-use costs, and every graph
a rank captured before, which later tests compiling the same model find in the memo.

Isolation: each run starts with the test process's environment as it is then (so
`monkeypatch.setenv` reaches the ranks) and its rank, world size and addresses set, its
own process group (destroyed after), and torch's default random generator reseeded as a
fresh process would be. A rank that fails or hangs ends every process of that run (a
peer may be waiting in a collective); the next run forks new ones in their places. So
does a run that changed autohybrid's code in a rank (a function or class replaced in an
autohybrid module, a method patched onto one of its classes, a custom op's autograd
registered again: what tests that inject a bug do), checked after every run: that
process is replaced before its next run, so no later test sees the change. A test that
changes other global state in its ranks uses `ah.launch`. `main` and `args` travel
pickled, so `main` must be a module-level function. `AUTOHYBRID_TEST_POOL=0` runs every
launch through `ah.launch` instead.
"""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import autohybrid as ah

ENABLED = os.environ.get("AUTOHYBRID_TEST_POOL", "1") != "0"


@dataclass
class _Rank:
    """One warm process: it serves rank `index` of every world of more than `index`."""
    proc: Any
    conn: Any
    dirty: bool = False   # a run changed autohybrid's code in it: replace before reuse

    def usable(self) -> bool:
        return not self.dirty and self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(5)
        self.conn.close()


_ranks: list[_Rank | None] = []


def launch(main: Callable[..., Any], world: int, *, args: tuple = (),
           timeout_s: float | None = None) -> list[Any]:
    """`ah.launch(main, ah.Cluster.local(world), args=args, timeout_s=timeout_s)` on warm
    ranks (see the module docstring)."""
    if not ENABLED:
        return ah.launch(main, ah.Cluster.local(world), args=args, timeout_s=timeout_s)
    ranks = _ready(world)
    store = tempfile.mkdtemp(prefix="autohybrid-pool-")
    try:
        task = pickle.dumps((main, args, world, dict(os.environ), os.path.join(store, "s")))
        for r in ranks:
            r.conn.send_bytes(task)
        return _collect(ranks, timeout_s)
    except BaseException:   # a rank failed or hung: its peers may wait in a collective
        for index in range(world):
            _drop(index)
        raise
    finally:
        shutil.rmtree(store, ignore_errors=True)


def pids() -> list[int]:
    """The warm ranks' process ids (tests that look for stray children skip them)."""
    return [r.proc.pid for r in _ranks if r is not None and r.proc.pid is not None]


def close_all() -> None:
    for index in range(len(_ranks)):
        _drop(index)
    _ranks.clear()


atexit.register(close_all)


def _drop(index: int) -> None:
    if index < len(_ranks) and _ranks[index] is not None:
        _ranks[index].kill()
        _ranks[index] = None


def _ready(world: int) -> list[_Rank]:
    """Processes 0 .. world-1, each alive and unchanged: the missing ones forked now."""
    _ranks.extend([None] * (world - len(_ranks)))
    for index in range(world):
        if _ranks[index] is not None and not _ranks[index].usable():
            _drop(index)   # it died, or a run patched autohybrid in it
    missing = [i for i in range(world) if _ranks[i] is None]
    if missing:
        ah.runtime.launch._import_compile_path()  # the ranks inherit the modules
        _import_all_autohybrid()                  # and the fingerprint covers them all
        ctx = mp.get_context("fork")
        with ah.runtime.launch.heap_frozen_for_fork("fork"):
            for index in missing:
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_worker, args=(index, child, os.getpid()),
                                name=f"autohybrid-test-rank{index}", daemon=True)
                p.start()
                child.close()
                _ranks[index] = _Rank(p, parent)
    return _ranks[:world]


def _collect(ranks: list[_Rank], timeout_s: float | None) -> list:
    world = len(ranks)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    results: dict[int, Any] = {}
    waiting = {r.conn: rank for rank, r in enumerate(ranks)}
    sentinels = {r.proc.sentinel: rank for rank, r in enumerate(ranks)}
    while waiting:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise ah.RuntimeFailure(
                f"launch timed out after {timeout_s:g} s; ranks {sorted(waiting.values())} "
                f"still running (of {world}, warm test ranks)")
        ready = mpc.wait(list(waiting) + list(sentinels), timeout=remaining)
        for obj in ready:
            if obj in sentinels:
                rank = sentinels[obj]
                if ranks[rank].conn in waiting and not ranks[rank].conn.poll():
                    raise ah.RankFailure(rank, f"rank {rank} (warm test rank) exited "
                                         "without reporting", ranks[rank].proc.exitcode)
                continue
            rank = waiting.pop(obj)
            kind, payload = pickle.loads(obj.recv_bytes())
            if kind == "err":
                raise ah.RankFailure(rank, payload, None)
            if kind == "changed":   # the run patched autohybrid here: replace it after
                ranks[rank].dirty = True
            results[rank] = payload
    return [results[r] for r in range(world)]


def _worker(index: int, conn: Any, parent_pid: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ah.runtime.launch._set_parent_death_signal()
    if os.getppid() != parent_pid:
        os._exit(1)
    code = _code_fingerprint()
    while True:
        try:
            main, args, world, env, store = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(ah.runtime.launch._rank_env(index, world, 0))
        torch.seed()  # a fresh process's unseeded generator
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=index,
                                    world_size=world,
                                    timeout=ah.runtime.launch._collective_timeout())
            ah.runtime.device_check.from_env()  # conftest sets it: on in every run
            try:
                result = main(index, *args)
            finally:
                ah.runtime.device_check.disable()  # the next run starts from its own env
                dist.destroy_process_group()
            conn.send_bytes(pickle.dumps(
                ("ok" if _code_fingerprint() == code else "changed", result)))
        except BaseException:  # noqa: BLE001 - the test process reports it
            conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
            os._exit(1)  # a failed rank may leave its peers in a collective: end the run
        finally:
            os.environ.clear()
            os.environ.update(saved)


def _import_all_autohybrid() -> None:
    """Every autohybrid module, so the code fingerprint covers each from the start."""
    import importlib
    import pkgutil

    for info in pkgutil.walk_packages(ah.__path__, "autohybrid."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)


def _code_fingerprint() -> tuple:
    """Identities of autohybrid's module-level functions and classes, of its classes'
    methods, and of its custom ops' autograd registrations."""
    import sys
    import types

    from torch._library.custom_ops import CustomOpDef

    out = []
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("autohybrid") or module is None:
            continue
        for attr, value in sorted(vars(module).items()):
            if isinstance(value, (types.FunctionType, type)):
                out.append((name, attr, id(value)))
                if isinstance(value, type):
                    out.extend((name, attr, k, id(v)) for k, v in vars(value).items()
                               if isinstance(v, (types.FunctionType, property,
                                                 staticmethod, classmethod)))
            elif isinstance(value, CustomOpDef):
                out.append((name, attr, id(value._backward_fn), id(value._setup_context_fn)))
    return tuple(out)
