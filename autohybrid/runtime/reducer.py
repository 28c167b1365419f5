"""Bucketed data-parallel gradient reduction launched during backward.

Parameters are grouped into buckets in the reverse of their first use in the forward
graph (the order backward makes their gradients ready). A post-accumulate-grad hook
counts ready gradients; when a bucket is complete its flattened gradients are all-reduced
asynchronously while backward continues (flat over `group`, or with `all_reduce` given,
by the Plan's hierarchical or segmented algorithm: runtime/collectives.py). `finish`
waits, writes the sums back scaled by `1 / Σ denominators` (see passes/global_loss.py;
on one rank nothing is packed or summed: the gradients are scaled in place)
and records, per bucket, when it was launched and how many gradients were still
pending — the structural proof of overlap. A parameter without a gradient (frozen, or
not used by the loss) has none on every rank, since every rank runs the same graph, and
keeps none, as in eager (an optimizer must not see a zero gradient: weight decay would
still move it); its bucket carries zeros so that all ranks issue the same collectives.

Pipelines (`arm_pipeline`, runtime/pipeline.py): a rank's gradients are final at its
last accumulation into each parameter, which may come long before the schedule ends (a
later stage's parameters on a rank that still runs an earlier stage's backward, or the
first layers' parameters during the last backward). The reducer does not assume how many
accumulations complete a parameter: the first step of a schedule (per microbatch shape)
counts them per parameter with launching deferred to the schedule's end (as with overlap
off), together with the order in which the buckets completed; the counts and the order
are checked equal over the dp group (one small all-reduce; if they differ the schedule
keeps launching after the schedule). From the next step on, a bucket is launched as soon
as each of its parameters reached its count, and always in the recorded order (a bucket
complete early waits for the ones before it), so every dp rank issues the same
collectives in the same order. What is counted: each post-accumulate-grad hook firing,
and each weight-gradient step of the zero-bubble schedules, which accumulate with
`torch.autograd.grad` and `weight.grad += dw` (torch/distributed/pipelining/_backward.py
`stage_backward_weight`) and fire no hook: runtime/pipeline.py wraps those steps in
`weight_step(params)`, which mutes the hooks inside and reports each parameter of the
stage once after the step. A parameter that two stages of the rank read (tied weights of
a V-shaped schedule) simply has a larger count; a frozen one a count of 0. The events
record how many backward steps of the schedule were done and left at each launch
(`backward_left` 0: launched after the schedule). `AUTOHYBRID_DISABLE_PASSES=overlap`
makes the executor pass no key: the buckets are launched after the schedule.

With ZeRO-1/2 (`shards` given: runtime/zero.py) a bucket is reduce-scattered instead,
laid out as ops/zero.py's `(dp, Σc)` shards (on gloo, which sums faster by all-reduce,
all-reduced as the gradients lie and each rank's columns read out of the sums), the
whole gradients are dropped as soon as the bucket is launched, and `collect` adds each
rank's part to its shard parameters' gradients (scaled in the same pass at the end).
For ZeRO-2 the executor arms the reducer for every microbatch, so no whole gradient
outlives its microbatch's backward; ZeRO-1 accumulates whole gradients and
reduce-scatters in the last backward only (one collective per bucket per step). In a
pipeline both accumulate whole gradients over the schedule and reduce-scatter each
bucket once, when its counts are reached.
"""
from __future__ import annotations

from .comm_device import comm_device
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Iterator

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from ..ops.groups import reduce_scatter_single, sums_by_all_reduce
from ..ops.zero import chunk, scatter_layout

log = logging.getLogger(__name__)


#: `Bucket.flat` of a launched bucket on one rank: its gradients are not packed (a
#: sentinel compared by identity, never a tensor)
_IN_PLACE: Any = object()


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    ready: int = 0
    flat: torch.Tensor | None = None
    work: object | None = None
    has_grad: list[bool] = field(default_factory=list)
    #: ZeRO 0: the flat buffer kept across steps (`flat` while launched): packing into it
    #: allocates nothing (a fresh buffer per step costs its allocation and page faults)
    store: torch.Tensor | None = None
    #: ZeRO-1/2: `flat` holds the whole sums, the gradients concatenated (the group sums
    #: by all-reduce: gloo), not this rank's part of the `(dp, Σc)` layout
    whole: bool = False
    #: the group its gradients are summed over: the reducer's (`own`), or another one
    #: (`GradReducer.param_groups`: a MoE layer's expert slices, summed over "edp"; under
    #: ZeRO-1/2 their shards are that group's)
    group: Any = None
    own: bool = True


@dataclass
class LaunchEvent:
    bucket: int
    time: float
    pending_grads: int       # gradients (pipelines: accumulations) of this rank not yet ready
    #: pipelines: backward steps (full, input- or weight-gradient) of this rank's schedule
    #: finished at the launch, and not finished (the one running included; 0: launched
    #: after the schedule). None without a pipeline.
    backward_done: int | None = None
    backward_left: int | None = None


@dataclass
class PipelineCounts:
    """What one schedule step accumulates on this rank (recorded in its first step)."""
    counts: dict[int, int]   # id(param) → accumulations (hooks + weight steps) per step
    order: list[int]         # bucket indices in the order they are launched


@dataclass
class GradReducer:
    params: list[torch.nn.Parameter]
    group: dist.ProcessGroup | None
    bucket_bytes: int
    shards: dict[int, torch.nn.Parameter] | None = None   # ZeRO-1/2: id(param) → shard
    reduce_dtype: torch.dtype | None = None   # cast buckets to it for the collective
    #: ZeRO 0: starts a bucket's sum, `.start(flat)` → work (runtime/collectives.AllReduce);
    #: None: `dist.all_reduce` over `group`
    all_reduce: object | None = None
    buckets: list[Bucket] = field(default_factory=list)
    events: list[LaunchEvent] = field(default_factory=list)
    active: bool = False
    #: per pipeline schedule key: the counts (None: they differed over dp, no overlap)
    pipeline_counts: dict[Hashable, PipelineCounts | None] = field(default_factory=dict)
    #: id(param) → the group its gradient is summed over instead of `group` (expert
    #: parallelism: the ranks holding the same experts); such parameters get buckets of
    #: their own
    param_groups: dict[int, dist.ProcessGroup | None] | None = None

    def __post_init__(self) -> None:
        others = self.param_groups or {}
        current: dict[int | None, list[torch.nn.Parameter]] = {}
        size: dict[int | None, int] = {}
        for p in reversed(self.params):
            key = id(others[id(p)]) if id(p) in others else None
            current.setdefault(key, []).append(p)
            size[key] = size.get(key, 0) + p.numel() * p.element_size()
            if size[key] >= self.bucket_bytes:
                self.buckets.append(self._bucket(current.pop(key)))
                size[key] = 0
        for rest in current.values():
            self.buckets.append(self._bucket(rest))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params
                         if p.requires_grad]
        self._pending = 0
        # "last": launch a bucket when its grads are ready (the last microbatch's backward);
        # "count": a pipeline's first step, counting; "counts": launching by the counts;
        # "after": a pipeline launching after its schedule (hooks ignored)
        self._mode = "last"
        self._muted = 0
        self._progress: Callable[[], int] | None = None
        self._key: Hashable = None
        self._fired: dict[int, int] = {}
        self._last_seen: dict[int, int] = {}
        self._remaining: dict[int, int] = {}
        self._complete: list[bool] = []
        self._order: list[int] = []
        self._next = 0

    def _bucket(self, params: list[torch.nn.Parameter]) -> Bucket:
        others = self.param_groups or {}
        if id(params[0]) in others:
            return Bucket(params, group=others[id(params[0])], own=False)
        return Bucket(params, group=self.group)

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def _reset(self) -> None:
        for b in self.buckets:
            b.ready, b.flat, b.work = 0, None, None
        self.events.clear()
        self._order, self._next = [], 0
        self._complete = [False] * len(self.buckets)

    def prepare(self) -> None:
        """Arm the hooks for the next backward (the one that completes the step's grads)."""
        self._reset()
        self._mode = "last"
        self._pending = sum(1 for p in self.params if p.requires_grad)
        self.active = True

    def arm_pipeline(self, key: Hashable | None, progress: Callable[[], int] | None = None
                     ) -> None:
        """Arm for one pipeline schedule step. `key` names the schedule (the same on every
        dp rank); None: overlap off, every bucket is launched after the schedule.
        `progress()`: how many backward steps the schedule has finished (for the events)."""
        self._reset()
        self._progress = progress
        self.active = True
        self._pending = 0
        if key is None or not self.buckets or self.pipeline_counts.get(key, 0) is None:
            self._mode = "after"
        elif key not in self.pipeline_counts:
            self._mode, self._key = "count", key
            self._fired, self._last_seen, self._seq = {}, {}, 0
        else:
            plan = self.pipeline_counts[key]
            self._mode = "counts"
            self._remaining = dict(plan.counts)
            self._pending = sum(plan.counts.values())
            self._order = list(plan.order)
            for i, b in enumerate(self.buckets):
                b.ready = sum(1 for p in b.params if plan.counts.get(id(p), 0) == 0)
                self._complete[i] = b.ready == len(b.params)
            self._launch_ready()  # buckets without gradients whose turn it is

    @contextmanager
    def weight_step(self, params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
        """Around a pipeline weight-gradient step (which accumulates without firing the
        hooks, or with them in torch's first-stage case): hooks muted inside, each of
        `params` reported once after it."""
        params = list(params)
        self._muted += 1
        try:
            yield
        finally:
            self._muted -= 1
        if not self._muted:
            for p in params:
                if p.requires_grad:
                    self._on_grad(p)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.active or self._muted:
            return
        index = self._bucket_of.get(id(param))
        if index is None:
            return
        bucket = self.buckets[index]
        if self._mode == "last":
            self._pending -= 1
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(index)
        elif self._mode == "count":
            self._fired[id(param)] = self._fired.get(id(param), 0) + 1
            self._last_seen[index] = self._seq
            self._seq += 1
        elif self._mode == "counts":
            self._pending -= 1
            left = self._remaining.get(id(param), 0) - 1
            self._remaining[id(param)] = left
            if left == 0:
                bucket.ready += 1
                if bucket.ready == len(bucket.params):
                    self._complete[index] = True
                    self._launch_ready()
            elif left < 0:
                raise RuntimeFailure(
                    f"a parameter's gradient (shape {tuple(param.shape)}) was accumulated more "
                    f"often in this pipeline step than in the step that counted its "
                    f"accumulations; its dp bucket was already launched. Set "
                    f"AUTOHYBRID_DISABLE_PASSES=overlap to launch after the schedule")

    def _launch_ready(self) -> None:
        """Launch, in the recorded order, every complete bucket whose turn it is."""
        while self._next < len(self._order) and self._complete[self._order[self._next]]:
            index = self._order[self._next]
            self._next += 1
            if self.buckets[index].flat is None:
                self._launch(index)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        bucket.has_grad = [p.grad is not None for p in bucket.params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        if self.reduce_dtype is not None:
            grads = [g.to(self.reduce_dtype) for g in grads]
        world = 1 if bucket.group is None else dist.get_world_size(bucket.group)
        if self.shards is None and world == 1 and self.reduce_dtype is None:
            bucket.flat = _IN_PLACE   # nothing to sum: `finish` scales the grads in place
        elif self.shards is None:
            flat = [g.reshape(-1) for g in grads]
            numel = sum(g.numel() for g in flat)
            store = bucket.store
            if store is None or store.numel() != numel or store.dtype != flat[0].dtype \
                    or store.device != flat[0].device:
                store = bucket.store = flat[0].new_empty(numel)
            bucket.flat = torch.cat(flat, out=store)
            if world > 1:
                bucket.work = (self.all_reduce.start(bucket.flat)
                               if self.all_reduce is not None and bucket.own
                               else dist.all_reduce(bucket.flat, group=bucket.group,
                                                    async_op=True))
        # ZeRO-1/2 (below): a fresh buffer, no whole-gradient bytes kept between steps
        elif world > 1 and sums_by_all_reduce(bucket.group):
            # every rank receives every sum: the gradients as they are, and `collect`
            # reads this rank's columns out of them (no scatter layout, no slice copy)
            bucket.flat = torch.cat([g.reshape(-1) for g in grads])
            bucket.whole = True
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        else:
            flat = scatter_layout(grads, world)
            bucket.flat = flat if world == 1 else flat.new_empty(flat.numel() // world)
            bucket.whole = False
            if world > 1:
                bucket.work = reduce_scatter_single(bucket.flat, flat, group=bucket.group,
                                                    async_op=True, input_scratch=True)
        if self.shards is not None:
            for p in bucket.params:  # the bucket holds them now
                p.grad = None
        done = self._progress() if self._mode != "last" and self._progress else None
        self.events.append(LaunchEvent(index, time.perf_counter(), self._pending, done))

    def schedule_done(self) -> None:
        """After a pipeline's schedule: record the counts if this step counted them, launch
        every bucket not launched yet, and complete the events' `backward_left`."""
        if self._mode == "count":
            self._record_counts()
        self.launch_pending()
        total = self._progress() if self._progress else None
        for event in self.events:
            if event.backward_done is not None and total is not None:
                event.backward_left = total - event.backward_done

    def _record_counts(self) -> None:
        counts = [self._fired.get(id(p), 0) for p in self.params]
        seen = [self._last_seen.get(i, -1) for i in range(len(self.buckets))]
        order = sorted(range(len(self.buckets)), key=lambda i: (seen[i] < 0, seen[i], i))
        agreed = True
        if self.world > 1:  # the same on every dp rank, or no rank launches early
            position = [0] * len(order)
            for k, i in enumerate(order):
                position[i] = k
            mine = torch.tensor(counts + position, dtype=torch.int64,
                                device=comm_device(self.group))
            both = torch.cat([mine, -mine])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
            agreed = torch.equal(both[:len(mine)], -both[len(mine):])
            if not agreed:
                log.warning("pipeline gradient accumulations differ over the dp group: "
                            "dp buckets are launched after the schedule")
        self.pipeline_counts[self._key] = (
            PipelineCounts({id(p): c for p, c in zip(self.params, counts)}, order)
            if agreed else None)

    def launch_pending(self) -> None:
        """Launch every bucket not launched yet (in the recorded order, then by index)."""
        for index in [*self._order[self._next:], *range(len(self.buckets))]:
            if self.buckets[index].flat is None:
                self._launch(index)
        self._next = len(self._order)

    def finish(self, scale: float | torch.Tensor) -> None:
        """Launch buckets whose gradients never arrived, wait for all, write back × scale."""
        self.launch_pending()
        if self.shards is not None:
            self.collect(scale)
            self.active = False
            return
        for bucket in self.buckets:
            if bucket.flat is _IN_PLACE:  # one rank: the gradients are the sums
                for p in bucket.params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
                bucket.flat = None
                continue
            if bucket.work is not None:
                bucket.work.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                if p.grad is not None:  # frozen or unused: no gradient, as in eager
                    part = bucket.flat[offset:offset + n].view_as(p)
                    if p.grad.dtype == part.dtype and p.grad.is_contiguous():
                        torch.mul(part, scale, out=p.grad)  # one pass, no temporary
                    else:
                        p.grad.copy_(part.mul(scale))
                offset += n
            bucket.flat, bucket.work = None, None  # the next step starts from its own grads
        self.active = False

    def collect(self, scale: float | torch.Tensor | None = None) -> None:
        """ZeRO-1/2: add the launched buckets' reduced parts to the shard gradients, then
        (`scale` given: the step's last collect) multiply every shard gradient by it."""
        for bucket in self.buckets:
            if bucket.flat is None:
                continue
            if bucket.work is not None:
                bucket.work.wait()
            world = 1 if bucket.group is None else dist.get_world_size(bucket.group)
            rank = dist.get_rank(bucket.group) if world > 1 else 0
            offset = 0
            for p, has in zip(bucket.params, bucket.has_grad):
                shard = self.shards[id(p)]
                n, c = p.numel(), chunk(p.numel(), world)
                if bucket.whole:    # this rank's columns of the whole sums (maybe short)
                    lo, hi = min(n, rank * c), min(n, (rank + 1) * c)
                    part, offset = bucket.flat[offset + lo: offset + hi], offset + n
                else:
                    part, offset = bucket.flat[offset: offset + c], offset + c
                if not has:  # frozen or unused: no gradient, as in eager; one from
                    # earlier microbatches only (ZeRO-2) is scaled with the rest
                    if scale is not None and shard.grad is not None:
                        shard.grad.mul_(scale)
                    continue
                if shard.grad is None:   # one pass: the part, scaled; zero padding
                    grad = shard.new_empty(c)
                    k = part.numel()
                    if scale is not None and grad.dtype == part.dtype:
                        torch.mul(part, scale, out=grad[:k])
                    else:   # cast first: the scale multiplies in the shard's dtype
                        grad[:k].copy_(part)
                        if scale is not None:
                            grad[:k].mul_(scale)
                    grad[k:].zero_()
                    shard.grad = grad
                    continue
                shard.grad[:part.numel()].add_(part)
                if scale is not None:
                    shard.grad.mul_(scale)
            bucket.flat, bucket.work = None, None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
