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
    wrapper over torch.distributed, runtime/device_check.py, sees it). `input` may be
    this rank's row of `output` (an in-place gather).

    On gloo, a gather of `BROADCAST_GATHER_BYTES` or more per rank runs as one broadcast
    per rank of its row of `output` (`_gather_by_broadcast`): gloo's all-gather takes up
    to 5× its broadcasts of the same bytes. Measured on 2 CPU ranks (medians, per rank's
    bytes: all-gather / broadcasts): 4 KB 0.14 / 0.25 ms, 64 KB 0.20 / 0.28, 256 KB
    0.56 / 0.35, 1 MB 1.05 / 0.77, 4 MB 3.1 / 1.8; 4 ranks on 2 cores: 1 MB 4.0 / 3.2,
    4 MB 14.4 / 9.3; a 13 M-parameter GPT's parameters (52 MB in all) 61 / 13 ms on 2
    ranks and 94 / 27 ms on 4."""
    if dist.is_initialized() and group_backend(group) == "gloo":
        if input.numel() * input.element_size() >= BROADCAST_GATHER_BYTES:
            return _gather_by_broadcast(output, input, group, async_op)
        if _row_of(output, group).data_ptr() == input.data_ptr():
            input = input.clone()   # gloo copies the input into its row: not onto itself
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


#: gloo: gathers of at least this many bytes per rank run as broadcasts (all_gather_single)
BROADCAST_GATHER_BYTES = 256 * 1024

#: the profiler range around those broadcasts (runtime/profile.py names the collectives
#: issued inside it "all_gather", what they compute)
GATHER_RANGE = "ah::all_gather"


def _row_of(output, group):
    return output.view(dist.get_world_size(group), -1)[dist.get_rank(group)]


def _gather_by_broadcast(output, input, group, async_op):  # noqa: A002
    """Each rank's row of `output` broadcast from it (this rank's `input` copied into its
    row first, unless it is that row): the pending work (`async_op`) or None."""
    from torch.profiler import record_function
    ranks = dist.get_world_size(group)
    rows = output.view(ranks, -1)
    mine = rows[dist.get_rank(group)]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input.reshape(-1))
    with record_function(GATHER_RANGE):
        works = [dist.broadcast(rows[r], src=dist.get_global_rank(group, r) if group
                                is not None else r, group=group, async_op=async_op)
                 for r in range(ranks)]
    return _AllOf(works) if async_op else None


class _AllOf:
    """Several issued collectives waited for as one."""

    def __init__(self, works):
        self.works = works

    def wait(self, *args) -> bool:
        for work in self.works:
            work.wait(*args)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def reduce_scatter_single(output, input, group=None, async_op=False,  # noqa: A002
                          input_scratch=False):
    """`dist.reduce_scatter_single` (torch 2.13; before: reduce_scatter_tensor), a sum,
    looked up at each call.

    `input_scratch=True`: the caller reads `input` no more. On gloo the sum then runs as
    an all-reduce of `input` in place and this rank's slice is copied to `output` (at
    the wait when `async_op`): gloo's reduce-scatter takes about twice its all-reduce of
    the same input (2 CPU ranks, 1 / 4 / 16 MB: 2.7 / 4.8 / 17 ms against 0.7 / 2.5 /
    8.5), so the all-reduce is the faster way to the same sums there. Elsewhere (NCCL)
    the reduce-scatter, which moves half the bytes, runs as it is."""
    if input_scratch and sums_by_all_reduce(group):
        n = output.numel()
        rank = dist.get_rank(group)
        work = dist.all_reduce(input, group=group, async_op=async_op)
        mine = input.reshape(-1)[rank * n:(rank + 1) * n]
        if not async_op:
            output.reshape(-1).copy_(mine)
            return None
        return _ThenCopy(work, output, mine)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


class _ThenCopy:
    """An issued all-reduce whose wait also copies this rank's slice of the sums out (a
    reduce-scatter's work, as `reduce_scatter_single` runs it on gloo)."""

    def __init__(self, work, output, mine):
        self.work, self.output, self.mine = work, output, mine
        self.copied = False

    def wait(self, *args) -> bool:
        self.work.wait(*args)
        if not self.copied:
            self.output.reshape(-1).copy_(self.mine)
            self.copied = True
        return True

    def is_completed(self) -> bool:
        return self.copied


def sums_by_all_reduce(group=None) -> bool:
    """Whether a reduce-scatter over `group` is best run as an all-reduce of the whole
    input (gloo: see `reduce_scatter_single`); callers that own their input may then lay
    it out as they like, since every rank receives every sum."""
    return group_backend(group) == "gloo"


def group_backend(group=None) -> str:
    """The backend of `group` (the default group for None), lower case."""
    return str(dist.get_backend(group)).lower()


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


def peers(axis: str) -> dist.ProcessGroup | None:
    """The group of `axis`, or None when there is nobody to talk to (no axis, no group
    bound for a one-rank mesh, or a group of one)."""
    if not axis:
        return None
    group = get(axis)
    return group if group is not None and dist.get_world_size(group) > 1 else None


def all_reduce(t, axis: str):
    """Sum `t` in place over the ranks of `axis` (nothing to do on one rank); returns it."""
    group = peers(axis)
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


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
