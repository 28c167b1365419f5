"""Warm ranks for the multi-process tests: one set of forked rank processes per world
size, reused by every test that launches that many ranks (as PyTorch's
MultiProcContinuousTest reuses its ranks across test methods).

`launch(main, world, args=..., timeout_s=...)` behaves as `ah.launch(main,
ah.Cluster.local(world), ...)` for a test: `main(rank, *args)` runs on every rank with a
fresh default process group (gloo, its own store), and the results come back in rank
order; the first rank to raise makes it raise `ah.RankFailure` with that rank's
traceback, and a run past `timeout_s` raises `ah.RuntimeFailure`. What it saves is the
start of the ranks: the fork, the imports, torch.export's first-use costs, and every graph
a rank captured before (autohybrid/capture_cache.py), which later tests compiling the
same model find in the memo.

Isolation: each run starts with the test process's environment as it is then (so
`monkeypatch.setenv` reaches the ranks), its own process group (destroyed after), and
torch's default random generator reseeded as a fresh process would be. A rank that
fails or hangs ends its pool: every worker is killed and the next run starts new ones.
So does a run that changed autohybrid's code in a rank (a function or class replaced in
an autohybrid module, a method patched onto one of its classes, a custom op's autograd
registered again: what tests that inject a bug do), checked after every run, so no later
test sees the change. A test that changes other global state in its ranks uses
`ah.launch`. `main` and `args` travel pickled, so `main` must be a module-level function.
`AUTOHYBRID_TEST_POOL=0` runs every launch through `ah.launch` instead.
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
from typing import Any, Callable

import autohybrid as ah

ENABLED = os.environ.get("AUTOHYBRID_TEST_POOL", "1") != "0"
_pools: dict[int, "_Pool"] = {}


def launch(main: Callable[..., Any], world: int, *, args: tuple = (),
           timeout_s: float | None = None) -> list[Any]:
    """`ah.launch(main, ah.Cluster.local(world), args=args, timeout_s=timeout_s)` on warm
    ranks (see the module docstring)."""
    if not ENABLED:
        return ah.launch(main, ah.Cluster.local(world), args=args, timeout_s=timeout_s)
    pool = _pools.get(world)
    if pool is None or not pool.alive():
        if pool is not None:   # a rank died, or a run patched autohybrid: end the rest
            pool.close()
        pool = _pools[world] = _Pool(world)
    try:
        return pool.run(main, args, timeout_s)
    except BaseException:
        pool.close()
        _pools.pop(world, None)
        raise


def pids() -> list[int]:
    """The warm ranks' process ids (tests that look for stray children skip them)."""
    return [p.pid for pool in _pools.values() for p in pool.procs if p.pid is not None]


def close_all() -> None:
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()


atexit.register(close_all)


class _Pool:
    def __init__(self, world: int):
        ah.runtime.launch._import_compile_path()  # the ranks inherit the modules
        _import_all_autohybrid()                  # and the fingerprint covers them all
        ctx = mp.get_context("fork")
        self.world, self.procs, self.conns, self.dirty = world, [], [], False
        with ah.runtime.launch.heap_frozen_for_fork("fork"):
            for rank in range(world):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_worker, args=(rank, world, child, os.getpid()),
                                name=f"autohybrid-test-rank{rank}", daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)

    def alive(self) -> bool:
        return not self.dirty and all(p.is_alive() for p in self.procs)

    def run(self, main: Callable[..., Any], args: tuple, timeout_s: float | None) -> list:
        store = tempfile.mkdtemp(prefix="autohybrid-pool-")
        try:
            task = pickle.dumps((main, args, dict(os.environ), os.path.join(store, "s")))
            for conn in self.conns:
                conn.send_bytes(task)
            return self._collect(timeout_s)
        finally:
            shutil.rmtree(store, ignore_errors=True)

    def _collect(self, timeout_s: float | None) -> list:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: dict[int, Any] = {}
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while waiting:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise ah.RuntimeFailure(
                    f"launch timed out after {timeout_s:g} s; ranks {sorted(waiting.values())} "
                    f"still running (of {self.world}, warm test ranks)")
            ready = mpc.wait(list(waiting) + list(sentinels), timeout=remaining)
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if self.conns[rank] in waiting and not self.conns[rank].poll():
                        raise ah.RankFailure(rank, f"rank {rank} (warm test rank) exited "
                                             "without reporting", self.procs[rank].exitcode)
                    continue
                rank = waiting.pop(obj)
                kind, payload = pickle.loads(obj.recv_bytes())
                if kind == "err":
                    raise ah.RankFailure(rank, payload, None)
                if kind == "changed":   # the run patched autohybrid: end this pool after it
                    self.dirty = True
                results[rank] = payload
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.join(5)
        for conn in self.conns:
            conn.close()


def _worker(rank: int, world: int, conn: Any, parent_pid: int) -> None:
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
            main, args, env, store = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        os.environ.update(ah.runtime.launch._rank_env(rank, world, 0))
        torch.seed()  # a fresh process's unseeded generator
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                    world_size=world,
                                    timeout=ah.runtime.launch._collective_timeout())
            ah.runtime.device_check.from_env()  # conftest sets it: on in every run
            try:
                result = main(rank, *args)
            finally:
                ah.runtime.device_check.disable()  # the next run starts from its own env
                dist.destroy_process_group()
            conn.send_bytes(pickle.dumps(
                ("ok" if _code_fingerprint() == code else "changed", result)))
        except BaseException:  # noqa: BLE001 - the test process reports it
            conn.send_bytes(pickle.dumps(("err", traceback.format_exc())))
            os._exit(1)  # a failed rank may leave its peers in a collective: end the pool
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
