"""Process groups of a Plan's mesh: a DeviceMesh with axes ("pp", "dp", "tp").

Built on every rank in the same order from the Plan's rank placement, and bound to the
axis names the graph ops use (`autohybrid.ops.groups`). Every axis group carries the
collective bound (runtime/timeouts.py): DeviceMesh would make its sub-groups with torch's
default timeout (30 minutes for gloo), so a rank that stopped responding hung its peers
on any mesh with an axis smaller than the world; the groups are made here and handed
to `DeviceMesh.from_group`.
"""
from __future__ import annotations

import pickle
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .. import ops
from ..errors import AutohybridError, ClusterError
from ..plan import AXES, Plan, expert_groups, spatial_groups
from .timeouts import compile_timeout, new_group


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
    once per extra rank). Without a process group, or on one rank, `fn()` itself.

    The other ranks wait for rank 0 on the job's store, under `compile_timeout` (rank 0
    may capture or search for longer than the collective bound, which is sized to find
    a rank that stopped responding in a step), then receive its result."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    key = _rank_zero_key()
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = (True, fn())
        except Exception as exc:  # every rank raises it, not only rank 0
            payload[0] = (False, _portable(exc))
        _default_store().set(key, "done")
    else:
        _default_store().wait([key], compile_timeout())
    dist.broadcast_object_list(payload, src=0)
    ok, value = payload[0]
    if not ok:
        raise value
    return value


def all_ranks_arrived() -> None:
    """Wait, on the job's store and under `compile_timeout`, until every rank of the
    default group got here. Called before the compile's collectives that follow work
    whose length differs by rank (each rank loads a graph, rewrites its own program):
    on a loaded machine the ranks then meet on the store, not in a collective bounded
    by AUTOHYBRID_COLLECTIVE_TIMEOUT_S, which is sized for a step."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    key, store = _rank_zero_key(), _default_store()
    if store.add(key, 1) == dist.get_world_size():
        store.set(f"{key}/all", "arrived")
    store.wait([f"{key}/all"], compile_timeout())


_STORE_CALLS: list[Any] = [None, 0]  # [the world group counted, keys handed out]


def _rank_zero_key() -> str:
    """A store key for this from_rank_zero / all_ranks_arrived call: every rank makes the
    same calls in the same order, so a count per world group names it alike on every
    rank."""
    world = dist.group.WORLD
    if _STORE_CALLS[0] is not world:
        _STORE_CALLS[:] = [world, 0]
    _STORE_CALLS[1] += 1
    return f"autohybrid/compile/{_STORE_CALLS[1]}"


def _default_store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


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
    groups = [_axis_group(ranks, dim) for dim in range(len(AXES))]
    mesh = DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=AXES)
    for axis, group in zip(AXES, groups):
        ops.groups.bind(axis, group)
    flat = ranks.flatten().tolist()
    for axis, rows in {**spatial_groups(plan.mesh), **expert_groups(plan.mesh)}.items():
        ops.groups.bind(axis, row_group([[flat[r] for r in row] for row in rows], axis))
    return mesh


def row_group(rows: list[list[int]], axis: str) -> dist.ProcessGroup:
    """This rank's group among `rows` (every one created on every rank, in order), a
    group of its own even when a row spans the world (data/fit.py's exchange groups)."""
    me, mine = dist.get_rank(), None
    for row in rows:
        group = new_group(row)
        if me in row:
            mine = group
    if mine is None:
        raise ClusterError(f"rank {me} is in no group of mesh axis {axis!r} ({rows}): "
                           "the plan's placement does not hold this rank; compile with a "
                           "plan made for this world size")
    return mine


def _axis_group(ranks: torch.Tensor, dim: int) -> dist.ProcessGroup:
    """This rank's group along mesh dimension `dim`: every group of that dimension is
    created on every rank, in mesh order (torch requires it), with the collective bound;
    an axis spanning the whole world is the default group (which has the bound too)."""
    rows = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
    if len(rows) == 1 and len(rows[0]) == dist.get_world_size():
        return dist.group.WORLD
    me, mine = dist.get_rank(), None
    for row in rows:
        group = new_group(row)
        if me in row:
            mine = group
    if mine is None:
        raise ClusterError(f"rank {me} is in no group of mesh axis {AXES[dim]!r} "
                           f"(mesh {ranks.tolist()}): the plan's placement does not hold "
                           "this rank; compile with a plan made for this world size")
    return mine
