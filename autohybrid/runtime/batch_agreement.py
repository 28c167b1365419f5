"""Every rank passes the same global batch: checked with one tiny collective per step.

`train_step(x, y)` expects the same global batch on every rank (each takes its own
slice): ranks that pass different ones would train on a mix whose loss matches neither.
`agree_on_batch(tensors, problem)` fingerprints the batch — per tensor its shape and
three integer sums of its bits (plain, weighted by sample and by position in a sample;
integer arithmetic, so the same bytes give the same fingerprint whatever the threads or
reduction order) folded into 7 int64 — and all-reduces (MAX) the fingerprint, its
negation and a flag saying whether this rank refused its batch (`problem`, from
batch_spec.py), 15 int64 in all. Every rank reads the same reduced buffer, so all raise
together or none does: ranks differ (then the fingerprints are gathered to name them),
or a rank refused its batch. `train_step(..., local=True)`, where each rank passes its
own shard by design, skips it. No other state; collectives on the default group.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.profiler import record_function

from ..errors import InputError

#: the profiler range of the check (runtime/profile.py names its collective apart)
AGREEMENT_RANGE = "ah::batch_agreement"

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDTH = 7


def fingerprint(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """7 int64 that differ between batches that differ (in shape or any element, almost
    surely), equal for equal bytes on any rank."""
    total = torch.zeros(_WIDTH, dtype=torch.int64)
    total[0] = len(tensors)
    for i, t in enumerate(tensors):
        total += (i + 1) * _one(t)
    return total


def _one(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    size = flat.element_size()
    if size not in _BITS:  # complex128: as pairs of int64
        flat, size = flat.view(torch.float64), 8
    bits = flat.view(_BITS[size]).to(torch.int64)  # on the batch's device: only the
    rows = t.shape[0] if t.dim() >= 1 and t.shape[0] > 0 else 1  # sums leave it
    grid = bits.reshape(rows, -1) if bits.numel() else bits.reshape(1, 0)
    per_row = grid.sum(1)
    per_col = grid.sum(0)
    shape = 0
    for d in t.shape:
        shape = (shape * 1000003 + int(d)) % (1 << 61)
    row_w = torch.arange(1, per_row.numel() + 1, dtype=torch.int64, device=bits.device)
    col_w = torch.arange(per_col.numel(), dtype=torch.int64, device=bits.device) % 1021 + 1
    sums = torch.stack([per_row.sum(), (per_row * row_w).sum(), (per_col * col_w).sum()]).cpu()
    return torch.cat([torch.tensor([t.dim(), shape]), sums,
                      torch.tensor([t.element_size(), int(t.is_floating_point())])])


def agree_on_batch(tensors: Sequence[torch.Tensor], problem: str | None, step: int,
                   device: torch.device | str = "cpu") -> None:
    """Raise InputError on every rank unless every rank passed the same batch and none
    refused it (`problem`: this rank's reason); alone, raise `problem` if any."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if problem:
            raise InputError(problem)
        return
    mine = fingerprint(tensors)
    flag = torch.tensor([1 if problem else 0], dtype=torch.int64)
    buffer = torch.cat([mine, -mine, flag]).to(device)
    with record_function(AGREEMENT_RANGE):  # named apart in measured timelines
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    buffer = buffer.cpu()
    if problem:
        raise InputError(problem)
    if buffer[-1] > 0:
        raise InputError(f"train_step {step}: another rank refused its batch (its error says "
                         "why); every rank passes the same global batch")
    if torch.equal(buffer[:_WIDTH], -buffer[_WIDTH:2 * _WIDTH]):
        return
    gathered = [torch.empty_like(mine).to(device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine.to(device))
    groups: dict[tuple, list[int]] = {}
    for rank, fp in enumerate(gathered):
        groups.setdefault(tuple(fp.cpu().tolist()), []).append(rank)
    described = "; ".join("ranks " + ", ".join(map(str, ranks)) for ranks in groups.values())
    raise InputError(
        f"train_step {step}: the ranks passed different batches (alike: {described}). Every "
        "rank passes the same global batch and takes its own slice; a loader that reads each "
        "rank's own shard passes it with train_step(inputs, targets, local=True) "
        "(compiled.local_slice(batch) cuts a rank's shard from the global batch)")
