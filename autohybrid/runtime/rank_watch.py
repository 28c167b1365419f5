"""The launching process's view of its ranks: their results, failures and exits, until
every rank has a result or the failed rank is known.

`RankWatch` reads each rank's pipe (("ok", result, when) or ("err", traceback, when,
peer)) and its exit (`multiprocessing` sentinels). At the first failure it does not
raise at once: the first failure to arrive is often a neighbour's communication error
(runtime/failures.py). It ends a rank that reported a communication error (its sockets
close, so the ranks waiting on it fail too, instead of waiting out their own
timeouts), and decides as soon as a rank failed of its own (an error, an exit, a
signal), no rank is left running, or `BLAME_WINDOW_S` passed; a rank still running
then is asked for its stack (SIGUSR1, failures.enable_stack_dump), and the one not
waiting in a collective is blamed for not responding.

This module owns reading and deciding; launch.py starts the ranks and ends them all.
"""
from __future__ import annotations

import contextlib
import multiprocessing.connection as mpc
import os
import pickle
import signal
import time
from typing import Any, Sequence

from ..errors import RankFailure, RankUnresponsive
from .failures import (PEER_MARKERS, Failure, culprit, in_collective, read_steps,
                       stack_path)

__all__ = ["RankWatch", "BLAME_WINDOW_S", "describe_exit"]

#: seconds after the first failure to wait for the failure it follows from
BLAME_WINDOW_S = 5.0
_EXIT_WAIT_S = 1.0  # how long to wait for a dead rank to be reaped, for its exit code
_STACK_WAIT_S = 1.0  # how long a running rank has to write its stack


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


class RankWatch:
    """Results and failures of the ranks `procs` (their pipes `readers`, in rank order);
    `records`: the launch's directory of progress records and stacks."""

    def __init__(self, procs: Sequence[Any], readers: Sequence[Any], records: str):
        self.procs, self.readers, self.records = list(procs), list(readers), records
        self.conns = {reader: rank for rank, reader in enumerate(readers)}
        self.sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
        self.results: dict[int, Any] = {}
        self.failures: list[Failure] = []
        self.first_failure_at: float | None = None  # time.monotonic()

    # ------------------------------------------------------------------ reading
    def poll(self, timeout: float | None) -> None:
        """Wait up to `timeout` s for a message or an exit, and take in what came."""
        ready = mpc.wait(list(self.conns) + list(self.sentinels), timeout=timeout)
        dead = [self.sentinels.pop(o) for o in ready if o in self.sentinels]
        for conn in [o for o in ready if o in self.conns]:
            self._read(conn)
        for rank in dead:
            reader = self.readers[rank]
            if reader in self.conns and reader.poll():
                self._read(reader)  # a report that raced with the exit
            if not self._settled(rank):
                self.procs[rank].join(_EXIT_WAIT_S)  # the sentinel fires before reaping
                self._fail(Failure(rank, time.time(), "died",
                                   f"rank {rank} {describe_exit(self.procs[rank].exitcode)} "
                                   "without reporting a result or an exception"))

    def _read(self, conn: Any) -> None:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            del self.conns[conn]
            return
        rank = self.conns[conn]
        if message[0] == "ok":
            self.results[rank] = message[1]
        else:
            _, text, when, peer = message
            self._fail(Failure(rank, when, "peer" if peer else "error", text))
            if peer:
                _end(self.procs[rank])  # its exit unblocks the ranks waiting on it

    def _fail(self, failure: Failure) -> None:
        self.failures.append(failure)
        if self.first_failure_at is None:
            self.first_failure_at = time.monotonic()

    def _settled(self, rank: int) -> bool:
        return rank in self.results or any(f.rank == rank for f in self.failures)

    def running(self) -> list[int]:
        """Ranks alive that reported neither a result nor a failure."""
        return [r for r, p in enumerate(self.procs)
                if not self._settled(r) and p.exitcode is None and p.is_alive()]

    # ------------------------------------------------------------------ deciding
    def wait_s(self) -> float | None:
        """How long the next poll may wait before a decision is due (None: no failure)."""
        if self.first_failure_at is None:
            return None
        return max(0.0, self.first_failure_at + BLAME_WINDOW_S - time.monotonic())

    def decided(self) -> bool:
        """Whether the failed rank is known (see the module docstring)."""
        if not self.failures:
            return False
        return (any(f.kind != "peer" for f in self.failures) or not self.running()
                or self.wait_s() == 0.0)

    def failure(self) -> RankFailure:
        """The error naming the rank that failed first in fact, with its last step."""
        steps = read_steps(self.records, len(self.procs))
        running = self.running()
        stacks = self._stacks(running)
        waiting = [r for r in running if in_collective(stacks.get(r, ""))]
        verdict = culprit(self.failures, running, steps, waiting)
        rank, last_step = verdict.rank, steps.get(verdict.rank)
        if verdict.unresponsive:
            return RankUnresponsive(rank, self._unresponsive_text(rank, stacks), None,
                                    last_step)
        self.procs[rank].join(_EXIT_WAIT_S)
        return RankFailure(rank, verdict.failure.text, self.procs[rank].exitcode, last_step)

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Every thread's stack of each of `ranks` (SIGUSR1; empty where none came)."""
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.procs[rank].pid, signal.SIGUSR1)
        deadline = time.monotonic() + _STACK_WAIT_S
        paths = {rank: stack_path(self.records, rank) for rank in ranks}
        while time.monotonic() < deadline and not all(_size(p) for p in paths.values()):
            time.sleep(0.05)
        time.sleep(0.1)  # the handler writes in one go; let the last lines land
        out: dict[int, str] = {}
        for rank, path in paths.items():
            with contextlib.suppress(OSError):
                out[rank] = path.read_text()
        return out

    def _unresponsive_text(self, rank: int, stacks: dict[int, str]) -> str:
        peers = sorted({f.rank for f in self.failures})
        first = min(self.failures, key=lambda f: f.when)
        last_line = _peer_line(first.text)
        stack = stacks.get(rank, "").strip() or "(no stack came back)"
        return (f"rank {rank} ran on without a result or an error while ranks {peers} "
                f"failed with communication errors waiting for it (rank {first.rank}: "
                f"{last_line}).\nWhere rank {rank} was (every thread's stack):\n{stack}\n"
                "If the rank was only slow, raise AUTOHYBRID_COLLECTIVE_TIMEOUT_S; else "
                "look where its stack above stopped.")


def _peer_line(text: str) -> str:
    """The line of a traceback that says what went wrong with the connection."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    marked = [line for line in lines if any(m in line.lower() for m in PEER_MARKERS)]
    return (marked or lines or [""])[-1]


def _size(path: Any) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _end(proc: Any) -> None:
    """SIGKILL a rank's process group now (it already reported its failure)."""
    with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
        os.killpg(proc.pid, signal.SIGKILL)
