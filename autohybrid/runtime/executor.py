"""Runs one rank's program: batch slicing, microbatches, gradient sync, optimizer step.

Each rank receives the same global batch, takes its data-parallel shard (dim 0, split as
`torch.tensor_split` does, so any batch of at least dp × microbatches samples works), runs
its microbatches through the rewritten training graph (or, with pipeline parallelism,
through its stages under the Plan's schedule: runtime/pipeline.py), and
backward-propagates the loss numerator (see passes/global_loss.py). The reducer all-reduces
gradient buckets during the last backward — in a pipeline, as soon as each bucket's
gradients are final on this rank, while the schedule still runs the remaining backward
steps (runtime/reducer.py `arm_pipeline`; `AUTOHYBRID_DISABLE_PASSES=overlap`, read when
the executor is built, launches them after the schedule instead); gradients are then
scaled by 1 / Σ denominators, which gives exactly the gradients of eager's loss on the
whole batch.

With ZeRO (runtime/zero.py) the optimizer steps this rank's flat shards: ZeRO-1
reduce-scatters the buckets into them during the last backward (whole gradients
accumulate until then), ZeRO-2 during every microbatch's backward, ZeRO-3 graphs
reduce-scatter in backward and run forward with gathered parameters released for
backward (ops/zero.py); outside a pipeline those reduce-scatters are issued
asynchronously and overlap the rest of the backward (`deferred_reductions`).

Mixed precision (runtime/precision.py): the programs run under autocast themselves
(capture.py); with fp16 loss scaling the numerator is multiplied by the scale before
backward, the gradients divided by it with the 1/Σ denominators, and `StepResult.found_inf`
says whether any rank's gradients overflowed (the step is then skipped everywhere).
"""
from __future__ import annotations

from .comm_device import comm_device
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..capture import CapturedGraph
from ..errors import AutohybridError
from ..ops.groups import all_gather_single
from ..ops.zero import deferred_reductions, release_gathered
from ..passes.manager import disabled_passes
from ..plan import Plan
from .collectives import gradient_all_reduce
from .groups import all_ranks_arrived
from .pipeline import PipelineRunner, tree_map
from .precision import LossScaler, any_nonfinite
from . import whole_batch
from .reducer import GradReducer
from .zero import ZeroShards


@dataclass
class StepResult:
    loss: torch.Tensor
    numerator: torch.Tensor
    denominator: torch.Tensor
    found_inf: bool = False
    #: per-sample statistics (sample_stats.py) of the whole batch, in batch order, on
    #: every rank: when the program computes them, else None
    stats: torch.Tensor | None = None


class Executor:
    """The per-rank runtime of a data-parallel plan over captured graphs."""

    def __init__(self, plan: Plan, rank: int, dp_rank: int, dp_group: dist.ProcessGroup | None,
                 state: dict[str, torch.Tensor], params: list[torch.nn.Parameter],
                 zero: ZeroShards | None = None, scaler: LossScaler | None = None,
                 param_groups: dict[int, dist.ProcessGroup | None] | None = None):
        self.plan, self.rank, self.dp_rank, self.dp_group = plan, rank, dp_rank, dp_group
        self.state = state
        self.params = params
        self.zero = zero
        self.scaler = scaler  # fp16 loss scaling
        stage = self.zero_stage
        shards = ({id(p): zero.shard_for(p) for p in params} if stage in (1, 2) else None)
        # ZeRO-3 gradients arrive reduced (the graphs' gathers reduce-scatter them)
        reduce_dtype = getattr(torch, plan.grad_reduce_dtype) if plan.grad_reduce_dtype else None
        self.reducer = GradReducer(params if stage < 3 else [], dp_group,
                                   int(plan.bucket_mb * 2**20), shards=shards,
                                   reduce_dtype=reduce_dtype,
                                   all_reduce=gradient_all_reduce(plan, dp_group)
                                   if stage == 0 else None, param_groups=param_groups)
        #: pipelines: launch dp buckets while the schedule runs (off: after it)
        self.pipeline_overlap = "overlap" not in disabled_passes()
        self.last_backward_end: float | None = None
        #: called as `hook(m)` after microbatch m's backward (and its ZeRO-2 gradient
        #: collection) when no pipeline runs: what tests inspect between microbatches
        self.microbatch_hooks: list = []

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage this rank runs (0 without dp shards)."""
        return self.zero.stage if self.zero is not None else 0

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
                         local: bool, pipeline: PipelineRunner | None = None,
                         before_backward: Callable[[], None] | None = None) -> StepResult:
        """Gradients of eager's loss on the global batch (summed over dp, scaled).
        `before_backward()` runs after the first microbatch's forward, before its
        backward (the deferred batch check: runtime/batch_agreement.py); not with a
        pipeline."""
        if before_backward is not None and pipeline is not None:
            raise AutohybridError("a deferred batch check needs the step's forward to issue "
                                  "no collective; a pipeline's does")
        loss_scale = None
        if self.scaler is not None:  # eager back-propagates scale × (numerator / count)
            loss_scale = self.scaler.scale / self._global_count(targets or inputs, local,
                                                                loss_kind)
        if not local:
            inputs = self.local_slice(inputs, "inputs")
            targets = self.local_slice(targets, "targets")
        if pipeline is not None:
            # buckets launch as their gradients become final on this rank, during the
            # schedule (from its second step under a schedule: the first counts)
            key = pipeline.schedule_key(inputs, targets) if self.pipeline_overlap else None
            self.reducer.arm_pipeline(key, lambda: pipeline.backward_done)
            pipeline.grad_listener = self.reducer
            try:
                numerator, denominator = pipeline.forward_backward(inputs, targets, loss_scale)
            finally:
                pipeline.grad_listener = None
            stats = pipeline.sample_stats((inputs or targets)[0].shape[0])
            # the rest (all, with overlap off or while counting): this rank's gradients
            # are complete; sum them over dp while the pp ranks still in the schedule's
            # cool-down finish theirs
            self.reducer.schedule_done()
        else:
            numerator, denominator, stats = self._microbatch_loop(program, inputs, targets,
                                                                  loss_scale, before_backward)
        self.last_backward_end = time.perf_counter()
        if stats is not None:
            stats = self._gather_stats(stats)
        totals = torch.stack([numerator.double(), denominator.double()])
        if pipeline is not None and pipeline.pp_group is not None:
            dist.all_reduce(totals, group=pipeline.pp_group)  # from the last stage
        if self.dp_group is not None and self.dp > 1:
            dist.all_reduce(totals, group=self.dp_group)
        if loss_kind == "mean":
            scale = 1.0 / totals[1]
            loss = totals[0] / totals[1]
        else:
            scale = totals.new_ones(())
            loss = totals[0]
        dtype = pipeline.loss_dtype if pipeline is not None else numerator.dtype
        grad_scale = (scale / loss_scale if loss_scale is not None else scale).to(dtype)
        self.reducer.finish(grad_scale)
        stage = self.zero_stage
        if stage == 3:
            self.zero.scale_grads(grad_scale)
        if pipeline is not None:  # (sums commute: tied weights after the dp sum and scale)
            pipeline.sum_shared_grads(self.zero.shards if stage else None)
        found_inf = False
        if self.scaler is not None:
            holders = self.zero.optimizer_params() if self.zero is not None else self.params
            found_inf = any_nonfinite(p.grad for p in holders)
        return StepResult(loss=loss.to(dtype), numerator=numerator, denominator=denominator,
                          found_inf=found_inf, stats=stats)

    def _gather_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """This rank's per-sample statistics joined with the other dp ranks', in the
        order of the global batch (with `local`, the ranks' batches one after another)."""
        if self.dp_group is None or self.dp == 1:
            return stats
        mine = torch.tensor([stats.shape[0]], dtype=torch.long, device=stats.device)
        every = mine.new_empty(self.dp)
        all_gather_single(every, mine, group=self.dp_group)   # shards of unequal sizes
        return gather_batch(stats, every.tolist(), self.dp_group)

    def _global_count(self, tensors: Sequence[torch.Tensor], local: bool,
                      loss_kind: str) -> float:
        """For a mean loss, the elements of the global batch's first target (eager's
        denominator without ignored entries): fp16 loss scaling back-propagates the
        numerator over it, so gradients have eager's magnitudes (and overflow as eager's
        do); the same number on every rank."""
        if loss_kind != "mean":
            return 1.0
        count = torch.tensor(float(tensors[0].numel()), dtype=torch.float64,
                             device=comm_device(self.dp_group))
        if local and self.dp_group is not None and self.dp > 1:
            dist.all_reduce(count, group=self.dp_group)
        return max(float(count), 1.0)

    def _microbatch_loop(self, program: CapturedGraph, inputs: Sequence[torch.Tensor],
                         targets: Sequence[torch.Tensor], loss_scale: float | None = None,
                         before_backward: Callable[[], None] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward and backward of each microbatch in turn; the dp reducer is armed for
        the last backward, so gradient buckets are summed while it runs. Returns the
        summed numerators and denominators, and the microbatches' per-sample statistics
        joined (None when the program has none). `before_backward()`: after the first
        forward. A loss term over the whole batch's statistics has them added up over
        the microbatches first (runtime/whole_batch.py)."""
        micro_in = self.microbatches(inputs, "inputs")
        micro_tg = self.microbatches(targets, "targets")
        count = len(micro_in)
        stage = self.zero_stage
        sums = None   # a loss term's whole-batch sums, added up first (whole_batch.py)
        if count > 1 and whole_batch.has_batch_sums([program.gm]):
            def forward_all() -> torch.Tensor:
                total = None
                for m in range(count):
                    with release_gathered(stage == 3):
                        den = program.run(self.state, micro_in[m], micro_tg[m])[-1]
                    total = den if total is None else total + den
                    if m == 0 and before_backward is not None:
                        before_backward()   # (before the sums' all-reduce)
                return total
            sums = whole_batch.sums_first(forward_all, count)
            before_backward = None
        with whole_batch.step(sums, count):
            return self._microbatches_run(program, micro_in, micro_tg, loss_scale,
                                          before_backward)

    def _microbatches_run(self, program: CapturedGraph, micro_in: list, micro_tg: list,
                          loss_scale: float | None,
                          before_backward: Callable[[], None] | None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        numerator = denominator = None
        stats: list[torch.Tensor] = []
        count = len(micro_in)
        stage = self.zero_stage
        for m, (mb_in, mb_tg) in enumerate(zip(micro_in, micro_tg)):
            if m == count - 1 or stage == 2:
                self.reducer.prepare()
            with release_gathered(stage == 3):
                outs = program.run(self.state, mb_in, mb_tg)
            if m == 0 and before_backward is not None:
                before_backward()
            num, den = outs[0], outs[-1]
            if len(outs) == 3:   # (numerator, per-sample statistics, denominator)
                stats.append(outs[1].detach())
            with deferred_reductions(stage == 3):   # ZeRO-3: sums overlap the backward
                (num if loss_scale is None else num * loss_scale).backward()
            if stage == 2 and m < count - 1:
                self.reducer.collect()
            for hook in self.microbatch_hooks:
                hook(m)
            numerator = num.detach() if numerator is None else numerator + num.detach()
            denominator = den.detach() if denominator is None else denominator + den.detach()
        return numerator, denominator, torch.cat(stats) if stats else None

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
    all_gather_single(out, padded.contiguous(), group=group)
    return torch.cat([out[i * longest: i * longest + s] for i, s in enumerate(sizes)])


def check_same_plan(plan_hash: str, group: dist.ProcessGroup | None = None) -> None:
    """All ranks hold the same plan, or every rank raises naming the odd ones out."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    hashes: list[Any] = [None] * dist.get_world_size(group)
    if group is None:
        all_ranks_arrived()  # each rank rewrote its own program: meet under the compile bound
    dist.all_gather_object(hashes, plan_hash, group=group)
    if len(set(hashes)) > 1:
        from ..errors import PlanError
        table = ", ".join(f"rank {r}: {h}" for r, h in enumerate(hashes))
        raise PlanError(f"ranks hold different plans ({table}); give every rank the same Plan "
                        "(or let each search with the same model, cluster and options)")
