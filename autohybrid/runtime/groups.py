"""Process groups of a Plan's mesh: a DeviceMesh with axes ("pp", "dp", "tp").

Built on every rank in the same order from the Plan's rank placement, and bound to the
axis names the graph ops use (`autohybrid.ops.groups`).
"""
from __future__ import annotations

import pickle
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import ops
from ..errors import AutohybridError, ClusterError
from ..plan import AXES, Plan


def ensure_initialized(world_size: int) -> None:
    """Check a default process group of `world_size` ranks exists (ah.launch/torchrun made it)."""
    if not dist.is_initialized():
        if world_size == 1:
            return
        raise ClusterError(
            f"the cluster has {world_size} ranks but torch.distributed is not initialized in "
            "this process: run the script through ah.launch(main, cluster) or torchrun")
    actual = dist.get_world_size()
    if actual != world_size:
        raise ClusterError(
            f"the cluster has world_size {world_size} but {actual} processes were launched; "
            f"use Cluster.local({actual}) or launch {world_size} processes")


def from_rank_zero(fn: Callable[[], Any]) -> Any:
    """`fn()` computed on rank 0 and handed to every rank (what it raised, raised on every
    rank). For a deterministic computation every rank would otherwise repeat, such as the
    plan search: the ranks then hold the same result by construction, and the others
    spend no CPU on it (on a machine where ranks share cores, that is the whole search
    once per extra rank). Without a process group, or on one rank, `fn()` itself."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = (True, fn())
        except Exception as exc:  # every rank raises it, not only rank 0
            payload[0] = (False, _portable(exc))
    dist.broadcast_object_list(payload, src=0)
    ok, value = payload[0]
    if not ok:
        raise value
    return value


def _portable(exc: Exception) -> Exception:
    """`exc` if it survives pickling (the other ranks raise the same type), else an
    AutohybridError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return AutohybridError(f"rank 0: {type(exc).__name__}: {exc}")


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh | None:
    """The mesh of `plan` (rank order from the placement table), groups bound by axis."""
    ops.groups.clear()
    if not dist.is_initialized():
        for axis in AXES:
            ops.groups.bind(axis, None)
        return None
    ranks = torch.tensor([p.rank for p in plan.placement]).reshape(
        plan.mesh.pp, plan.mesh.dp, plan.mesh.tp)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=AXES)
    for axis in AXES:
        ops.groups.bind(axis, mesh.get_group(axis))
    return mesh
