"""Mesh axis name → process group, bound by the runtime on each rank.

Graph nodes carry an axis name; ops look the group up here when they run. The table is
per process (each rank binds its own groups from the same Plan).
"""
from __future__ import annotations

import torch.distributed as dist

from ..errors import RuntimeFailure


def all_gather_single(output, input, group=None, async_op=False):  # noqa: A002
    """`dist.all_gather_single` (torch 2.13's name; before: all_gather_into_tensor, which
    2.13 warns on), looked up at each call, as every collective of autohybrid is (so a
    wrapper over torch.distributed, runtime/device_check.py, sees it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output, input, group=None, async_op=False):  # noqa: A002
    """`dist.reduce_scatter_single` (torch 2.13; before: reduce_scatter_tensor), a sum,
    looked up at each call."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


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


def snapshot() -> dict[str, dist.ProcessGroup | None]:
    """The bindings now (a compiled model keeps its own: runtime/groups.build_mesh)."""
    return dict(_GROUPS)


def restore(bindings: dict[str, dist.ProcessGroup | None]) -> None:
    """Bind exactly `bindings` (a compiled model does before it runs its graphs, so that
    two models with different meshes in one process each use their own groups)."""
    _GROUPS.clear()
    _GROUPS.update(bindings)
