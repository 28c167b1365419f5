"""Every rank passes the same global batch: checked with one tiny collective per step.

`train_step(x, y)` expects the same global batch on every rank (each takes its own
slice): ranks that pass different ones would train on a mix whose loss matches neither.
`start_agreement(tensors, problem, ...)` fingerprints the batch — per tensor its shape and
three integer sums of its bits (plain, weighted by sample and by position in a sample;
integer arithmetic, so the same bytes give the same fingerprint whatever the threads or
reduction order) folded into 7 int64 — and all-gathers every rank's fingerprint with a
flag saying whether the rank refused its batch (`problem`, from batch_spec.py), 8 int64
per rank. Every rank reads the same gathered table, so all raise together or none does:
ranks differ (the table names which hold alike batches), or a rank refused its batch.
`train_step(..., local=True)`, where each rank passes its own shard by design, skips it.
No other state; collectives on the default group.

Deferred (`start_agreement(..., defer=True)`): the all-gather is issued asynchronously
and `Agreement.settle()` waits for it and raises as above. The compiled model defers it
where the step's forward issues no collective (dp alone below ZeRO-3: compiled.py
`_deferrable`), and the executor settles it after the first microbatch's forward,
before any collective of the step (its gradient buckets): the check then costs no time
of its own, it runs while the forward computes. A rank that refuses its batch settles
at once (it runs nothing); its peers learn it when they settle, before their backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import fx
from torch.profiler import record_function

from ..errors import InputError
from ..graph import op_name
from ..ops.groups import all_gather_single

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


@dataclass
class Agreement:
    """An issued check: `settle()` waits for it and raises on every rank alike."""
    problem: str | None
    step: int
    table: torch.Tensor          # (world, 8): every rank's fingerprint and refusal flag
    work: object | None
    settled: bool = False

    def settle(self) -> None:
        if self.settled:
            return
        self.settled = True
        if self.work is not None:
            self.work.wait()
        table = self.table.cpu().view(-1, _WIDTH + 1)
        if self.problem:
            raise InputError(self.problem)
        if table[:, -1].any():
            raise InputError(f"train_step {self.step}: another rank refused its batch (its "
                             "error says why); every rank passes the same global batch")
        prints = table[:, :_WIDTH]
        if bool((prints == prints[0]).all()):
            return
        groups: dict[tuple, list[int]] = {}
        for rank, fp in enumerate(prints.tolist()):
            groups.setdefault(tuple(fp), []).append(rank)
        described = "; ".join("ranks " + ", ".join(map(str, r)) for r in groups.values())
        raise InputError(
            f"train_step {self.step}: the ranks passed different batches (alike: "
            f"{described}). Every rank passes the same global batch and takes its own "
            "slice; a loader that reads each rank's own shard passes it with "
            "train_step(inputs, targets, local=True) (compiled.local_slice(batch) cuts a "
            "rank's shard from the global batch)")


def start_agreement(tensors: Sequence[torch.Tensor], problem: str | None, step: int,
                    device: torch.device | str = "cpu", defer: bool = False
                    ) -> Agreement | None:
    """Issue the check (module docstring); None when alone. Settled before returning
    unless `defer` (a rank with a `problem` always settles: it runs nothing)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if problem:
            raise InputError(problem)
        return None
    mine = torch.cat([fingerprint(tensors),
                      torch.tensor([1 if problem else 0], dtype=torch.int64)]).to(device)
    table = mine.new_empty(dist.get_world_size() * mine.numel())
    asynchronous = defer and not problem
    with record_function(AGREEMENT_RANGE):  # named apart in measured timelines
        work = all_gather_single(table, mine, async_op=asynchronous)
    agreement = Agreement(problem, step, table, work if asynchronous else None)
    if not asynchronous:
        agreement.settle()
    return agreement


#: autohybrid ops that issue no collective: a graph holding only these (and ATen ops)
#: lets the check run during its forward
_LOCAL_OPS = ("autohybrid.fused_region",)


def runs_no_collective(graphs: Iterable[fx.GraphModule]) -> bool:
    """Whether `graphs` (and the graph modules inside them: recomputed regions) call no
    autohybrid op that may communicate."""
    for top in graphs:
        for sub in top.modules():
            if not isinstance(sub, fx.GraphModule):
                continue
            for node in sub.graph.nodes:
                if node.op != "call_function":
                    continue
                if not isinstance(node.target, torch._ops.OpOverload):
                    module = getattr(node.target, "__module__", None) or ""
                    if module.startswith(("autohybrid", "torch.distributed")):
                        return False   # a Python function of ours: it may communicate
                    continue
                name = op_name(node)
                if name.startswith("autohybrid.") and not name.startswith(_LOCAL_OPS):
                    return False
                if name.startswith(("_c10d_functional.", "c10d.", "_dtensor.")):
                    return False
    return True
