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

First steps: `AUTOHYBRID_FIRST_STEP_TIMEOUT_S` (default `DEFAULT_FIRST_STEP_TIMEOUT_S`)
bounds the collectives of the groups autohybrid makes from their creation until the
first `train_step` of each compiled model has completed on every rank. Ranks reach a
first step's collectives minutes apart (each compiles its fused kernels with Triton,
loads the captured graph, warms allocators), and on NCCL the group's timeout is the
watchdog that aborts the job, so the step bound would kill a healthy start. The groups
are made with the first-step bound (`group_timeout`, and `new_group` here) and
registered; `first_steps()` (a new compiled model: its compile and first step) sets
every registered group back to it, `step_bound()` (after that first step, once every
rank arrived: compiled.py) to the collective bound. Groups made with an explicit
`timeout` (the checkpoint's) keep theirs. On torch's side this is
`torch.distributed.distributed_c10d._set_pg_timeout`, which applies to the collectives
issued after it (NCCL and gloo alike).

This module owns reading the bounds from the environment and the groups' current
bound; it starts no process and calls no collective beyond group creation.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist

from ..errors import RuntimeFailure

__all__ = ["DEFAULT_COLLECTIVE_TIMEOUT_S", "DEFAULT_COMPILE_TIMEOUT_S",
           "DEFAULT_CHECKPOINT_TIMEOUT_S", "env_seconds", "collective_timeout",
           "compile_timeout", "checkpoint_timeout", "new_group",
           "DEFAULT_FIRST_STEP_TIMEOUT_S", "first_step_timeout", "group_timeout",
           "register_group", "first_steps", "step_bound", "in_first_steps", "forget_groups"]

#: seconds; with the launcher's few seconds to decide and end the ranks, a job whose rank
#: stops responding ends within a minute (README, Debugging)
DEFAULT_COLLECTIVE_TIMEOUT_S = 40.0
#: seconds: rank 0 captures and searches for every rank (GPT-3 175B on 1024 GPUs: ~12 s)
DEFAULT_COMPILE_TIMEOUT_S = 600.0
#: seconds: a rank writing or checking a large shard file on a slow disk
DEFAULT_CHECKPOINT_TIMEOUT_S = 600.0
#: seconds: the first step's collectives wait for the slowest rank's kernel compilation
DEFAULT_FIRST_STEP_TIMEOUT_S = 600.0


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


def first_step_timeout() -> timedelta:
    """The bound on collectives until the first train_step completed on every rank."""
    seconds = env_seconds("AUTOHYBRID_FIRST_STEP_TIMEOUT_S", DEFAULT_FIRST_STEP_TIMEOUT_S)
    return max(timedelta(seconds=seconds), collective_timeout())


#: [the world group the registry belongs to, its groups, in first steps]
_STATE: list = [None, [], True]
#: groups a forked child inherited: never freed there (a gloo group's destructor joins
#: threads that exist only in the parent, so dropping the last reference in the child
#: hangs it: seen after an in-process launch, then a forked one)
_INHERITED: list = []


def _after_fork_in_child() -> None:
    _INHERITED.extend([_STATE[0], *_STATE[1]])
    _STATE[:] = [None, [], True]


os.register_at_fork(after_in_child=_after_fork_in_child)


def forget_groups() -> None:
    """Drop the registry (call it where the groups were destroyed, in their process)."""
    _STATE[:] = [None, [], True]


def _registry() -> list:
    world = dist.group.WORLD if dist.is_initialized() else None
    if _STATE[0] is not world:  # a new job (or none): the old groups are gone
        _STATE[:] = [world, [], True]
    return _STATE[1]


def in_first_steps() -> bool:
    """True until `step_bound()`: autohybrid's groups wait `first_step_timeout`."""
    _registry()
    return bool(_STATE[2])


def group_timeout() -> timedelta:
    """The bound a group made now gets: the first-step bound until `step_bound()`."""
    return first_step_timeout() if in_first_steps() else collective_timeout()


def register_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """Have `first_steps` / `step_bound` set `group`'s bound (autohybrid made it)."""
    groups = _registry()
    if group is not None and all(g is not group for g in groups):
        groups.append(group)
    return group


def first_steps() -> None:
    """Every registered group back to the first-step bound (a new model compiles; every
    rank calls this at the same point)."""
    _registry()
    _STATE[2] = True
    _set_all(first_step_timeout())


def step_bound() -> None:
    """Every registered group to the collective bound: the first step is behind every
    rank (call it once every rank has completed it)."""
    _registry()
    _STATE[2] = False
    _set_all(collective_timeout())


def _set_all(timeout: timedelta) -> None:
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    groups = _registry()
    groups[:] = [g for g in groups if live is None or g in live]  # destroyed: dropped
    for group in groups:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def new_group(ranks: Sequence[int], timeout: timedelta | None = None) -> dist.ProcessGroup:
    """`dist.new_group(ranks)` with `timeout`, or else registered and with the current
    bound (`group_timeout`); every rank must call it, in the same order, as for torch's."""
    if timeout is not None:
        return dist.new_group(list(ranks), timeout=timeout)
    return register_group(dist.new_group(list(ranks), timeout=group_timeout()))
