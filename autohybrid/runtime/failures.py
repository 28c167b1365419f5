"""Which rank of a failed job to blame, from what each rank reports about itself.

When one rank fails, its peers fail too: a rank that exits or is killed closes its
connections ("Connection reset by peer" on a neighbour), and a rank that stops
responding makes the peers waiting for it time out. The first failure to arrive is then
often a neighbour's. `culprit` picks the rank that failed first in fact:

1. a rank that raised an error of its own (not a communication error: `is_peer_error`),
   or that exited or was killed without reporting one (the launcher sees its exit code
   or signal) — the earliest of those;
2. else, when every failure is a communication error, a rank that was still running
   without failing: it stopped responding (preferring a rank whose stack is not inside
   a torch.distributed wait, then the fewest completed steps, then the lowest rank);
3. else the earliest failure (every rank timed out alike, e.g. collectives that do not
   match across ranks).

What a rank records for the launcher: its progress (`record_step`, the number of
`train_step`s completed, which `CompiledModel` writes after each step) in a file of the
launch's temporary directory (env `AUTOHYBRID_PROGRESS_DIR`), so a rank killed without
a word still has its last step on record; and, on SIGUSR1, every thread's stack
(`faulthandler`, in the same directory), which the launcher asks of a rank that
stopped responding before it ends it. Outside `ah.launch` (torchrun) nothing is recorded.

This module decides and records; it starts and ends no process (runtime/launch.py does).
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = ["Failure", "Verdict", "culprit", "is_peer_error", "record_step", "read_steps",
           "enable_stack_dump", "stack_path", "in_collective", "PROGRESS_ENV"]

PROGRESS_ENV = "AUTOHYBRID_PROGRESS_DIR"

#: what torch's backends say when a peer went away or did not answer in time
PEER_MARKERS = ("connection reset by peer", "connection closed by peer", "timed out",
                "timeout", "broken pipe", "connection refused", "econnreset", "epipe",
                "socket closed", "communicator was aborted", "watchdog")


def is_peer_error(exc: BaseException | None) -> bool:
    """Whether `exc` (or an exception it was raised from) is a communication error: a
    peer closed its connections or did not answer within the bound."""
    import torch.distributed as dist

    peer_types = tuple(t for t in (getattr(dist, n, None) for n in
                                   ("DistNetworkError", "DistStoreError", "DistBackendError"))
                       if isinstance(t, type))
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if isinstance(exc, peer_types) or any(m in text for m in PEER_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@dataclass(frozen=True)
class Failure:
    """One rank's failure as the launcher saw it: ``kind`` is "error" (an exception of
    its own), "peer" (a communication error) or "died" (exited or killed unreported)."""

    rank: int
    when: float
    kind: str
    text: str


@dataclass(frozen=True)
class Verdict:
    """The rank to blame; ``unresponsive`` when it is blamed for not answering."""

    rank: int
    unresponsive: bool
    failure: Failure | None  # its own failure (None when unresponsive)


def culprit(failures: Sequence[Failure], running: Sequence[int],
            steps: dict[int, int], waiting: Sequence[int] = ()) -> Verdict:
    """The rank that failed first in fact (module docstring). `running`: ranks alive
    that reported neither a result nor a failure; `steps`: completed steps by rank;
    `waiting`: running ranks seen waiting in a collective (`in_collective`)."""
    own = [f for f in failures if f.kind != "peer"]
    if own:
        first = min(own, key=lambda f: (f.when, f.rank))
        return Verdict(first.rank, False, first)
    if running:
        rank = min(running, key=lambda r: (r in waiting, steps.get(r, -1), r))
        return Verdict(rank, True, None)
    first = min(failures, key=lambda f: (f.when, f.rank))
    return Verdict(first.rank, False, first)


# ---------------------------------------------------------------------- records
def _record_dir() -> Path | None:
    value = os.environ.get(PROGRESS_ENV)
    return Path(value) if value else None


def record_step(step: int) -> None:
    """Record that this rank completed `step` train_steps (no-op outside ah.launch): one
    fixed-width write at the start of a file kept open (no temporary file and rename per
    step: this runs in every step), which `read_steps` parses whole."""
    where = _record_dir()
    if where is None:
        return
    path = where / f"step{os.environ.get('RANK', '0')}"
    with contextlib.suppress(OSError):  # a record is a hint: never fail a step for it
        if _RECORD[0] != path:  # a new launch (warm processes serve several)
            stale, _RECORD[:] = _RECORD[1], [None, None]
            if stale is not None:
                os.close(stale)
            _RECORD[:] = [path, os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)]
        os.pwrite(_RECORD[1], f"{int(step):020d}".encode(), 0)


#: the record file this process writes now and its open descriptor
_RECORD: list = [None, None]


def read_steps(where: str | os.PathLike, world_size: int) -> dict[int, int]:
    """The completed steps each rank recorded under `where` (ranks without a record are
    left out)."""
    out = {}
    for rank in range(world_size):
        with contextlib.suppress(OSError, ValueError):
            out[rank] = int(Path(where, f"step{rank}").read_text())
    return out


def in_collective(stack: str) -> bool:
    """Whether a rank's stack dump shows it waiting inside torch.distributed."""
    return "torch/distributed/" in stack.replace("\\", "/")


def stack_path(where: str | os.PathLike, rank: int) -> Path:
    return Path(where, f"stack{rank}.txt")


def enable_stack_dump(rank: int) -> None:
    """Have SIGUSR1 write every thread's Python stack to this rank's stack file (the
    handler runs even while the main thread sleeps or waits in C)."""
    where = _record_dir()
    if where is None:
        return
    with contextlib.suppress(OSError, RuntimeError, ValueError):
        stream = open(stack_path(where, rank), "w")  # noqa: SIM115 - kept for the handler
        faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)
