"""Mesh axis name → process group, bound by the runtime on each rank.

Graph nodes carry an axis name; ops look the group up here when they run. The table is
per process (each rank binds its own groups from the same Plan).
"""
from __future__ import annotations

import torch.distributed as dist

from ..errors import RuntimeFailure

_GROUPS: dict[str, dist.ProcessGroup | None] = {}


def bind(axis: str, group: dist.ProcessGroup | None) -> None:
    """Make `axis` resolve to `group` for the ops of this process."""
    _GROUPS[axis] = group


def get(axis: str) -> dist.ProcessGroup | None:
    try:
        return _GROUPS[axis]
    except KeyError:
        raise RuntimeFailure(
            f"mesh axis {axis!r} has no process group bound in this process: graphs that "
            "use collectives must run through the compiled model (ah.compile), which binds "
            "the groups of its Plan") from None


def size(axis: str) -> int:
    group = get(axis)
    return 1 if group is None else dist.get_world_size(group)


def clear() -> None:
    _GROUPS.clear()
