"""Process launcher: `launch` runs `main(rank, *args)` on every rank of a local cluster.

This module owns starting rank processes, wiring up the default process group, moving
results and tracebacks back to the parent, and cleaning up: no rank process (nor any
process it started in its process group) outlives `launch`, whatever happens.

- Local mode (default): one child process per rank (``fork`` on CPU clusters, ``spawn``
  on CUDA ones: runtime/spawn.py; `start_method` overrides), each in its own process
  group and with ``OMP_NUM_THREADS=1``; env RANK,
  LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
  ``AUTOHYBRID_LAUNCHED=1`` are set, the default group is initialized from a fresh
  ``file://`` store, and destroyed when `main` returns. Results come back in rank order.
  On CUDA each rank's device is ``cuda:LOCAL_RANK``, made current and passed as
  ``device_id`` to ``init_process_group`` under NCCL (runtime/placement.py).
- A rank that fails (raises, exits, is killed, or stops responding: its peers'
  collectives time out) makes `launch` end every rank (each one's process group) and
  raise `RankFailure` naming the rank that failed first in fact, not a neighbour that
  lost its connection to it (runtime/rank_watch.py, runtime/failures.py), with its last
  step. `max_restarts` starts the whole job again after a failure. A timeout raises
  `RuntimeFailure`.
- Under torchrun (``TORCHELASTIC_RUN_ID`` set, or RANK/WORLD_SIZE set by someone else)
  nothing is spawned: `main` runs in this process and `launch` returns ``[result]``, a
  one-element list holding only this rank's result.

Environment: ``AUTOHYBRID_COLLECTIVE_TIMEOUT_S`` (process-group timeout, default 40,
after the first step; ``AUTOHYBRID_FIRST_STEP_TIMEOUT_S`` until then: runtime/timeouts.py),
``AUTOHYBRID_RESTART_COUNT`` (set for `main`: the attempt, from 0),
``AUTOHYBRID_LAUNCH_TIMEOUT_S`` (overall timeout when `timeout_s` is None),
``AUTOHYBRID_INPROCESS=1`` (run a 1-rank world in this process instead of a child).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator, TypeVar

from autohybrid.errors import ClusterError, RankFailure, RuntimeFailure

from . import spawn
from .device_check import from_env as check_collective_devices
from .failures import PROGRESS_ENV, enable_stack_dump, is_peer_error
from .placement import process_group_device
from .rank_watch import RankWatch
from .timeouts import collective_timeout as _collective_timeout
from .timeouts import env_seconds as _env_float
from .timeouts import forget_groups, group_timeout, register_group

T = TypeVar("T")

__all__ = ["launch", "free_port"]

_KILL_GRACE_S = 3.0  # SIGTERM -> SIGKILL
RESTART_ENV = "AUTOHYBRID_RESTART_COUNT"
_log = logging.getLogger("autohybrid.runtime")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_info(cluster: Any) -> tuple[int, str, str, bool]:
    if isinstance(cluster, int) and not isinstance(cluster, bool):
        ws, device_type, backend, local = cluster, "cpu", "gloo", True
    else:
        ws = getattr(cluster, "world_size", None)
        device_type = getattr(cluster, "device_type", "cpu")
        backend = getattr(cluster, "backend", "nccl" if device_type == "cuda" else "gloo")
        local = bool(getattr(cluster, "is_local", True))
    if not isinstance(ws, int) or isinstance(ws, bool) or ws < 1:
        raise ClusterError(f"launch: world size must be an int >= 1, got {ws!r}; "
                           "pass a Cluster or a positive int")
    return ws, backend, device_type, local


def _under_torchrun() -> bool:
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return True
    return "RANK" in env and "WORLD_SIZE" in env and "AUTOHYBRID_LAUNCHED" not in env


@contextlib.contextmanager
def _temp_env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _rank_env(rank: int, ws: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ws),
            "LOCAL_WORLD_SIZE": str(ws), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "AUTOHYBRID_LAUNCHED": "1"}


def _run_in_this_process(main: Callable[..., T], rank: int, ws: int, backend: str,
                         device_type: str, init_method: str, args: tuple,
                         per_node: int | None = None) -> T:
    """Init the default group (if needed), run main, destroy the group if we made it.
    On CUDA the rank's device (cuda:LOCAL_RANK, checked) is made current first and
    bound to the group (`device_id`, NCCL)."""
    import torch.distributed as dist

    device_id = process_group_device(backend, device_type, per_node, rank)
    created = not dist.is_initialized()
    if created:
        bound = {} if device_id is None else {"device_id": device_id}
        store = _torchrun_attempt_store()
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=ws,
                                    timeout=group_timeout(), **bound)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank,
                                    world_size=ws, timeout=group_timeout(), **bound)
        register_group(dist.group.WORLD)  # the step bound after the first step
    check_collective_devices()  # AUTOHYBRID_CHECK_COLLECTIVE_DEVICES=1 (the suite sets it)
    try:
        return main(rank, *args)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()
            forget_groups()  # freed here, not in a child forked later


def _torchrun_attempt_store() -> Any:
    """Under torchrun: torchrun's store with a prefix naming this restart attempt, else
    None. The workers torchrun --max-restarts starts again find the first attempt's gloo
    addresses under env://'s keys (torch 2.13: their connectFullMesh is refused or hangs;
    seen with a plain torch script too), so each attempt keeps its keys apart."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if (attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ):
        return None  # (without the agent's store, env:// makes one: nothing is stale)
    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=_collective_timeout())
    return dist.PrefixStore(f"autohybrid/attempt_{attempt}", store)


def _set_parent_death_signal() -> None:
    """Linux: have the kernel SIGKILL this child if the launching process dies."""
    with contextlib.suppress(Exception):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child(rank: int, ws: int, backend: str, device_type: str, port: int, store: str,
           main: Callable[..., Any], args: Any, conn: Any, parent_pid: int,
           env: dict[str, str], per_node: int | None = None) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)
    os.environ.update(_rank_env(rank, ws, port))
    os.environ.update(env)
    enable_stack_dump(rank)
    reported = False

    def report_error() -> None:  # before the group is destroyed: peers fail after us
        nonlocal reported
        if not reported:
            reported = True
            peer = is_peer_error(sys.exc_info()[1])
            with contextlib.suppress(Exception):
                _send(conn, ("err", traceback.format_exc(), time.time(), peer))

    def guarded_main(rank: int, *args: Any) -> Any:
        try:
            return main(rank, *args)
        except BaseException:
            report_error()
            raise

    try:
        main, args = spawn.resolve(main, args)  # spawned: the function, from its script
        result = _run_in_this_process(guarded_main, rank, ws, backend, device_type,
                                      f"file://{store}", args, per_node)
        _send(conn, ("ok", result, time.time()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        report_error()
        raise SystemExit(1)
    finally:
        conn.close()


def _send(conn: Any, message: tuple) -> None:
    """Send with the standard pickle: tensors travel as bytes. (multiprocessing's own
    pickler, with torch imported, sends a tensor as a handle to this process's shared
    memory, which is gone once the rank exits: the parent then got nothing.)"""
    conn.send_bytes(pickle.dumps(message))


def _signal_group(p: Any, sig: int) -> None:
    """Send sig to the child's process group (its grandchildren too), else to the child."""
    if p.pid is None:
        return
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p.pid, sig)


def _kill_all(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            _signal_group(p, signal.SIGKILL)
        p.join()
        _signal_group(p, signal.SIGKILL)  # leftover grandchildren in the child's group


def launch(main: Callable[..., T], cluster: Any, *, args: tuple = (),
           timeout_s: float | None = None, start_method: str | None = None,
           max_restarts: int = 0) -> list[T]:
    """Run ``main(rank, *args)`` on every rank of `cluster`; return results in rank order.

    `cluster` has ``world_size``, ``backend``, ``device_type`` and ``is_local`` (or is an
    int: that many gloo/CPU ranks). Results must be picklable. Under torchrun, runs
    `main` only for this process's rank and returns a one-element list ``[result]``
    (torchrun's ``--max-restarts`` restarts there). Raises `RankFailure` naming the rank
    that failed first (`RankUnresponsive` for one that stopped responding) once every
    rank has ended, `RuntimeFailure` when `timeout_s` (the whole launch, restarts
    included) runs out. With `max_restarts` = N, a failed job is ended and started
    again, fresh processes on a fresh rendezvous, up to N times; `main` sees env
    ``AUTOHYBRID_RESTART_COUNT`` (0 on the first attempt), and the last failure is
    raised when every attempt failed.

    `start_method` None: ``spawn`` on a CUDA cluster, ``fork`` on CPU. Under spawn,
    `main` must be a top-level function (of a module, or of the launching script above
    its `launch` call) and `args` picklable; refused before any process starts.
    """
    if spawn.loading_script():  # a spawned rank runs the script: it stops here
        raise spawn.StopAtLaunch()
    ws, backend, device_type, local = _cluster_info(cluster)
    per_node = getattr(cluster, "devices_per_node", None)
    if not isinstance(per_node, int) or isinstance(per_node, bool):
        per_node = None
    start_method = spawn.start_method_for(device_type, start_method)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ClusterError(f"launch: max_restarts must be an int >= 0, got {max_restarts!r}")
    if _under_torchrun():
        env_ws = int(os.environ.get("WORLD_SIZE", "-1"))
        if env_ws != ws:
            raise ClusterError(
                f"launch under torchrun: WORLD_SIZE={env_ws} from torchrun but the cluster "
                f"has world_size={ws}; start torchrun with {ws} processes in total "
                f"(e.g. --nproc-per-node {ws}) or describe a cluster of {env_ws} ranks")
        rank = int(os.environ["RANK"])
        os.environ.setdefault(RESTART_ENV, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return [_run_in_this_process(main, rank, ws, backend, device_type, "env://", args,
                                     per_node)]
    if not local:
        raise ClusterError(f"launch: the cluster spans several nodes ({ws} ranks) but "
                           "launch only starts local processes; run the script with "
                           "torchrun on every node instead")
    if timeout_s is None:
        timeout_s = _env_float("AUTOHYBRID_LAUNCH_TIMEOUT_S", None)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    if ws == 1 and os.environ.get("AUTOHYBRID_INPROCESS") == "1":
        return _launch_in_this_process(main, backend, device_type, args, per_node)
    if start_method != "fork":
        main, args = None, spawn.spawn_target(main, args)  # type: ignore[assignment]
    for attempt in range(max_restarts + 1):
        try:
            return _launch_once(main, ws, backend, device_type, args, deadline, timeout_s,
                                start_method, attempt, per_node)
        except RankFailure as failure:
            if attempt == max_restarts:
                if not max_restarts:
                    raise
                text = (f"{failure.traceback_text.rstrip()}\n(every attempt failed: "
                        f"{max_restarts + 1} runs, max_restarts={max_restarts}; this was "
                        "the last)")
                raise type(failure)(failure.rank, text, failure.exitcode,
                                    failure.last_step) from None
            _log.warning("rank %d failed on attempt %d of %d; restarting all ranks",
                         failure.rank, attempt + 1, max_restarts + 1)
    raise AssertionError("unreachable")


def _launch_in_this_process(main: Callable[..., T], backend: str, device_type: str,
                            args: tuple, per_node: int | None = None) -> list[T]:
    tmpdir = tempfile.mkdtemp(prefix="autohybrid-launch-")
    try:
        with _temp_env(_rank_env(0, 1, free_port())):
            return [_run_in_this_process(main, 0, 1, backend, device_type,
                                         f"file://{os.path.join(tmpdir, 'store')}", args,
                                         per_node)]
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _launch_once(main: Callable[..., T], ws: int, backend: str, device_type: str,
                 args: tuple, deadline: float | None, timeout_s: float | None,
                 start_method: str, attempt: int, per_node: int | None = None) -> list[T]:
    """One attempt: fresh ranks on a fresh port and store, all ended when it returns."""
    tmpdir = tempfile.mkdtemp(prefix="autohybrid-launch-")
    records = os.path.join(tmpdir, "records")
    os.mkdir(records)
    env = {PROGRESS_ENV: records, RESTART_ENV: str(attempt)}
    try:
        return _launch_children(main, ws, backend, device_type, free_port(),
                                os.path.join(tmpdir, "store"), args, deadline, timeout_s,
                                start_method, env, per_node)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


#: Modules every rank imports to compile (the package adds the compiled model's module,
#: which sits above the runtime): imported once in the launching process before it forks.
PRELOAD_MODULES: list[str] = ["torch.export", "torch.distributed.pipelining"]


def _import_compile_path() -> None:
    """Import PRELOAD_MODULES once in this process, so forked ranks inherit them instead
    of each importing them again (1-2 s per rank on a small machine). Imports only: no
    tensor op runs here, so no thread pool is started before the fork."""
    import importlib

    for name in PRELOAD_MODULES:
        importlib.import_module(name)


@contextlib.contextmanager
def heap_frozen_for_fork(start_method: str) -> Iterator[None]:
    """The parent's objects moved out of the garbage collector's reach while ranks fork
    (gc.freeze, as Python's docs advise before fork without exec): a forked rank's
    collections then never write to the objects it inherited, so their pages stay
    shared instead of being copied into every rank (a parent that has imported and
    captured much, such as a test run, otherwise costs each rank a copy of its heap and
    the time to make it). The parent's own collections resume after the forks."""
    if start_method != "fork":
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _launch_children(main: Callable[..., T], ws: int, backend: str, device_type: str,
                     port: int, store: str, args: tuple, deadline: float | None,
                     timeout_s: float | None, start_method: str,
                     env: dict[str, str], per_node: int | None = None) -> list[T]:
    if device_type == "cuda" and start_method == "fork":
        import torch
        if torch.cuda.is_initialized():
            raise RuntimeFailure("launch: CUDA is already initialized in this process, so "
                                 "forked ranks cannot use it; pass start_method='spawn'")
    if start_method == "fork":
        _import_compile_path()
    ctx = mp.get_context(start_method)
    procs: list[Any] = []
    readers: list[Any] = []
    try:
        hidden = (spawn.script_hidden() if start_method != "fork"
                  else contextlib.nullcontext())
        with heap_frozen_for_fork(start_method), hidden:
            for rank in range(ws):
                reader, writer = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_child, name=f"autohybrid-rank{rank}", daemon=False,
                                args=(rank, ws, backend, device_type, port, store, main,
                                      args, writer, os.getpid(), env, per_node))
                p.start()
                writer.close()
                with contextlib.suppress(OSError):
                    os.setpgid(p.pid, p.pid)  # also done by the child; closes the race
                procs.append(p)
                readers.append(reader)
        watch = RankWatch(procs, readers, env[PROGRESS_ENV])
        while len(watch.results) < ws:
            if watch.decided():
                raise watch.failure()  # `finally` ends every rank
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                running = [r for r in range(ws) if r not in watch.results]
                raise RuntimeFailure(
                    f"launch timed out after {timeout_s:g} s; ranks {running} still "
                    f"running (of {ws}); raise timeout_s or AUTOHYBRID_LAUNCH_TIMEOUT_S "
                    "if the job is just slow")
            waits = [w for w in (remaining, watch.wait_s()) if w is not None]
            watch.poll(min(waits) if waits else None)
        grace_end = time.monotonic() + _KILL_GRACE_S  # all reported: let them tear down
        for p in procs:
            p.join(max(0.0, grace_end - time.monotonic()))
        return [watch.results[r] for r in range(ws)]
    finally:
        _kill_all(procs)
        for c in readers:
            c.close()
