"""The time bounds of a job, and the one way autohybrid makes a process group.

`AUTOHYBRID_COLLECTIVE_TIMEOUT_S` (default `DEFAULT_COLLECTIVE_TIMEOUT_S`) bounds every
collective and point-to-point transfer of every process group autohybrid creates: the
default group `ah.launch` initializes, the mesh axes' groups (runtime/groups.py), the
hierarchical all-reduce's subgroups (runtime/collectives.py) and the groups of the
tied weights summed across pipeline stages (runtime/pipeline.py); the pipeline's
send/recv run on the pp axis' group. A rank that stops responding then makes its peers
raise within that bound instead of waiting torch's default (30 minutes for gloo), and a
group made with `torch.distributed.new_group` directly would escape it: make groups with
`new_group` here.

`AUTOHYBRID_COMPILE_TIMEOUT_S` (default `DEFAULT_COMPILE_TIMEOUT_S`) bounds how long the
other ranks wait for rank 0's capture and plan search (runtime/groups.from_rank_zero),
which may take longer than a collective should. `AUTOHYBRID_CHECKPOINT_TIMEOUT_S` (default
`DEFAULT_CHECKPOINT_TIMEOUT_S`) bounds the collectives of a checkpoint save or load
(runtime/checkpoint.py, on a group of its own): ranks write and hash files of different
sizes, for longer than a step's collective should wait.

This module owns reading the bounds from the environment; it starts no process and
calls no collective beyond group creation.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from ..errors import RuntimeFailure

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "DEFAULT_COMPILE_TIMEOUT_S",
           "DEFAULT_CHECKPOINT_TIMEOUT_S", "env_seconds", "collective_timeout",
           "compile_timeout", "checkpoint_timeout", "new_group"]

#: seconds; with the launcher's few seconds to decide and end the ranks, a job whose rank
#: stops responding ends within a minute (README, Debugging)
DEFAULT_COLLECTIVE_TIMEOUT_S = 40.0
#: seconds: rank 0 captures and searches for every rank (GPT-3 175B on 1024 GPUs: ~12 s)
DEFAULT_COMPILE_TIMEOUT_S = 600.0
#: seconds: a rank writing or checking a large shard file on a slow disk
DEFAULT_CHECKPOINT_TIMEOUT_S = 600.0


def env_seconds(name: str, default: float | None) -> float | None:
    """Env `name` as seconds (`default` when unset or empty); a bad value is refused."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise RuntimeFailure(f"env {name}={raw!r} is not a positive number of seconds; "
                             f"set it to e.g. {default or 60:g} or unset it")
    return value


def collective_timeout() -> timedelta:
    """The bound on every collective of autohybrid's process groups."""
    return timedelta(seconds=env_seconds("AUTOHYBRID_COLLECTIVE_TIMEOUT_S",
                                         DEFAULT_COLLECTIVE_TIMEOUT_S))


def compile_timeout() -> timedelta:
    """The bound on waiting for rank 0's compile-time work (capture, plan search)."""
    return timedelta(seconds=env_seconds("AUTOHYBRID_COMPILE_TIMEOUT_S",
                                         DEFAULT_COMPILE_TIMEOUT_S))


def checkpoint_timeout() -> timedelta:
    """The bound on a checkpoint save's or load's collectives."""
    return timedelta(seconds=env_seconds("AUTOHYBRID_CHECKPOINT_TIMEOUT_S",
                                         DEFAULT_CHECKPOINT_TIMEOUT_S))


def new_group(ranks: Sequence[int], timeout: timedelta | None = None) -> dist.ProcessGroup:
    """`dist.new_group(ranks)` with the collective bound, or `timeout` (every rank must
    call it, in the same order, as for torch's)."""
    return dist.new_group(list(ranks), timeout=timeout or collective_timeout())
