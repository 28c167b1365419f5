"""Runs one rank's program: batch slicing, microbatches, gradient sync, optimizer step.

Each rank receives the same global batch, takes its data-parallel shard (dim 0, split as
`torch.tensor_split` does, so any batch of at least dp × microbatches samples works), runs
its microbatches through the rewritten training graph (or, with pipeline parallelism,
through its stages under the Plan's schedule: runtime/pipeline.py), and
backward-propagates the loss numerator (see passes/global_loss.py). The reducer all-reduces gradient buckets during
the last backward; gradients are then scaled by 1 / Σ denominators, which gives exactly
the gradients of eager's loss on the whole batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from ..capture import CapturedGraph
from ..errors import AutohybridError
from ..plan import Plan
from .reducer import GradReducer

if TYPE_CHECKING:  # pipeline.py imports this module's tree helper
    from .pipeline import PipelineRunner


@dataclass
class StepResult:
    loss: torch.Tensor
    numerator: torch.Tensor
    denominator: torch.Tensor


class Executor:
    """The per-rank runtime of a data-parallel plan over captured graphs."""

    def __init__(self, plan: Plan, rank: int, dp_rank: int, dp_group: dist.ProcessGroup | None,
                 state: dict[str, torch.Tensor], params: list[torch.nn.Parameter]):
        self.plan, self.rank, self.dp_rank, self.dp_group = plan, rank, dp_rank, dp_group
        self.state = state
        self.params = params
        self.reducer = GradReducer(params, dp_group, int(plan.bucket_mb * 2**20))
        self.last_backward_end: float | None = None

    @property
    def dp(self) -> int:
        return self.plan.mesh.dp

    # ------------------------------------------------------------------ batches
    def local_slice(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """This rank's data-parallel shard of each tensor (dim 0)."""
        return [_shard(t, self.dp, self.dp_rank, f"{what}[{i}]") for i, t in enumerate(tensors)]

    def microbatches(self, tensors: Sequence[torch.Tensor], what: str) -> list[list[torch.Tensor]]:
        count = self.plan.num_microbatches
        split = [torch.tensor_split(t, count) if t.shape[0] >= count else None for t in tensors]
        for i, parts in enumerate(split):
            if parts is None:
                raise AutohybridError(
                    f"{what}[{i}] has {tensors[i].shape[0]} samples on this rank, fewer than the "
                    f"plan's {count} microbatches; give at least {count * self.dp} samples")
        return [[parts[m] for parts in split] for m in range(count)]

    # ------------------------------------------------------------------ training
    def forward_backward(self, program: CapturedGraph, loss_kind: str,
                         inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                         local: bool, pipeline: PipelineRunner | None = None) -> StepResult:
        """Gradients of eager's loss on the global batch (summed over dp, scaled)."""
        if not local:
            inputs = self.local_slice(inputs, "inputs")
            targets = self.local_slice(targets, "targets")
        if pipeline is not None:
            numerator, denominator = pipeline.forward_backward(inputs, targets)
            # this rank's gradients are complete: sum them over dp while the pp ranks
            # still in the schedule's cool-down finish theirs
            self.reducer.launch_pending()
        else:
            numerator, denominator = self._microbatch_loop(program, inputs, targets)
        self.last_backward_end = time.perf_counter()
        totals = torch.stack([numerator.double(), denominator.double()])
        if pipeline is not None and pipeline.pp_group is not None:
            dist.all_reduce(totals, group=pipeline.pp_group)  # from the last stage
        if self.dp_group is not None and self.dp > 1:
            dist.all_reduce(totals, group=self.dp_group)
        if loss_kind == "mean":
            scale = 1.0 / totals[1]
            loss = totals[0] / totals[1]
        else:
            scale = torch.ones((), dtype=torch.float64)
            loss = totals[0]
        dtype = pipeline.loss_dtype if pipeline is not None else numerator.dtype
        self.reducer.finish(scale.to(dtype))
        if pipeline is not None:  # (sums commute: tied weights after the dp sum and scale)
            pipeline.sum_shared_grads()
        return StepResult(loss=loss.to(dtype), numerator=numerator, denominator=denominator)

    def _microbatch_loop(self, program: CapturedGraph, inputs: Sequence[torch.Tensor],
                         targets: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of each microbatch in turn; the dp reducer is armed for
        the last backward, so gradient buckets are summed while it runs."""
        micro_in = self.microbatches(inputs, "inputs")
        micro_tg = self.microbatches(targets, "targets")
        numerator = denominator = None
        count = len(micro_in)
        for m, (mb_in, mb_tg) in enumerate(zip(micro_in, micro_tg)):
            if m == count - 1:
                self.reducer.prepare()
            num, den = program.run(self.state, mb_in, mb_tg)
            num.backward()
            numerator = num.detach() if numerator is None else numerator + num.detach()
            denominator = den.detach() if denominator is None else denominator + den.detach()
        return numerator, denominator

    # ------------------------------------------------------------------ forward only
    def forward(self, program: CapturedGraph, inputs: Sequence[torch.Tensor],
                pipeline: PipelineRunner | None = None) -> Any:
        """Forward over the dp shards, outputs gathered back to the full batch."""
        batch = inputs[0].shape[0]
        if batch < self.dp:
            raise AutohybridError(f"compiled(inputs): a batch of {batch} samples is smaller than "
                                  f"dp={self.dp}; pass at least {self.dp} samples")
        local = self.local_slice(inputs, "inputs")
        out = (pipeline.forward(local) if pipeline is not None
               else program.run(self.state, local, ()))
        if self.dp == 1 or self.dp_group is None:
            return out
        sizes = [len(range(batch)[s]) for s in _shard_slices(batch, self.dp)]
        return tree_map(out, lambda t: gather_batch(t, sizes, self.dp_group))


def _shard_slices(n: int, parts: int) -> list[slice]:
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(slice(start, start + size))
        start += size
    return out


def _shard(t: torch.Tensor, parts: int, index: int, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        raise AutohybridError(f"{what} must be a tensor with a batch dim, got {type(t).__name__}")
    if t.shape[0] < parts:
        raise AutohybridError(f"{what} has {t.shape[0]} samples, fewer than the {parts} "
                              f"data-parallel ranks; give at least {parts}")
    return t[_shard_slices(t.shape[0], parts)[index]]


def gather_batch(t: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather dim-0 shards of (possibly) unequal `sizes` into the full tensor."""
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return t
    longest = max(sizes)
    padded = t.new_zeros((longest, *t.shape[1:]))
    padded[: t.shape[0]] = t.detach()
    out = t.new_empty((longest * len(sizes), *t.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, padded.contiguous(), group=group)
    return torch.cat([out[i * longest: i * longest + s] for i, s in enumerate(sizes)])


def tree_map(obj: Any, fn) -> Any:
    """`fn` applied to every tensor of nested tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(tree_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: tree_map(v, fn) for k, v in obj.items()}
    return obj


def check_same_plan(plan_hash: str, group: dist.ProcessGroup | None = None) -> None:
    """All ranks hold the same plan, or every rank raises naming the odd ones out."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    hashes: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, plan_hash, group=group)
    if len(set(hashes)) > 1:
        from ..errors import PlanError
        table = ", ".join(f"rank {r}: {h}" for r, h in enumerate(hashes))
        raise PlanError(f"ranks hold different plans ({table}); give every rank the same Plan "
                        "(or let each search with the same model, cluster and options)")
