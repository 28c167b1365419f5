"""Process groups of a Plan's mesh: a DeviceMesh with axes ("pp", "dp", "tp").

Built on every rank in the same order from the Plan's rank placement, and bound to the
axis names the graph ops use (`autohybrid.ops.groups`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import ops
from ..errors import ClusterError
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
