"""Bucketed data-parallel gradient reduction launched during backward.

Parameters are grouped into buckets in the reverse of their first use in the forward
graph (the order backward makes their gradients ready). A post-accumulate-grad hook
counts ready gradients; when a bucket is complete its flattened gradients are all-reduced
asynchronously while backward continues (flat over `group`, or with `all_reduce` given,
by the Plan's hierarchical or segmented algorithm: runtime/collectives.py). `finish`
waits, writes the sums back scaled by `1 / Σ denominators` (see passes/global_loss.py)
and records, per bucket, when it was launched and how many gradients were still
pending — the structural proof of overlap. A parameter without a gradient (frozen, or
not used by the loss) has none on every rank, since every rank runs the same graph, and
keeps none, as in eager (an optimizer must not see a zero gradient: weight decay would
still move it); its bucket carries zeros so that all ranks issue the same collectives.

With ZeRO-1/2 (`shards` given: runtime/zero.py) a bucket is reduce-scattered instead,
laid out as ops/zero.py's `(dp, Σc)` shards, the whole gradients are dropped as soon as
the bucket is launched, and `collect` adds each rank's part to its shard parameters'
gradients. For ZeRO-2 the executor arms the reducer for every microbatch, so no whole
gradient outlives its microbatch's backward; ZeRO-1 accumulates whole gradients and
reduce-scatters in the last backward only (one collective per bucket per step).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..ops.groups import reduce_scatter_single
from ..ops.zero import chunk, scatter_layout


@dataclass
class Bucket:
    params: list[torch.nn.Parameter]
    ready: int = 0
    flat: torch.Tensor | None = None
    work: object | None = None
    has_grad: list[bool] = field(default_factory=list)


@dataclass
class LaunchEvent:
    bucket: int
    time: float
    pending_grads: int       # gradients of the whole model not yet ready at launch


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

    def __post_init__(self) -> None:
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= self.bucket_bytes:
                self.buckets.append(Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(Bucket(current))
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params
                         if p.requires_grad]
        self._pending = 0

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def prepare(self) -> None:
        """Arm the hooks for the next backward (the one that completes the step's grads)."""
        for b in self.buckets:
            b.ready, b.flat, b.work = 0, None, None
        self.events.clear()
        self._pending = sum(1 for p in self.params if p.requires_grad)
        self.active = True

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self.active:
            return
        self._pending -= 1
        index = self._bucket_of[id(param)]
        bucket = self.buckets[index]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(index)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        bucket.has_grad = [p.grad is not None for p in bucket.params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        if self.reduce_dtype is not None:
            grads = [g.to(self.reduce_dtype) for g in grads]
        if self.shards is None:
            bucket.flat = torch.cat([g.reshape(-1) for g in grads])
            if self.world > 1:
                bucket.work = (self.all_reduce.start(bucket.flat) if self.all_reduce is not None
                               else dist.all_reduce(bucket.flat, group=self.group,
                                                    async_op=True))
        else:
            flat = scatter_layout(grads, self.world)
            bucket.flat = flat if self.world == 1 else flat.new_empty(flat.numel() // self.world)
            if self.world > 1:
                bucket.work = reduce_scatter_single(bucket.flat, flat, group=self.group,
                                                    async_op=True)
            for p in bucket.params:  # the bucket holds them now
                p.grad = None
        self.events.append(LaunchEvent(index, time.perf_counter(), self._pending))

    def launch_pending(self) -> None:
        """Launch every bucket not launched yet (gradients complete: a pipeline's step)."""
        for index, bucket in enumerate(self.buckets):
            if bucket.flat is None:
                self._launch(index)

    def finish(self, scale: float | torch.Tensor) -> None:
        """Launch buckets whose gradients never arrived, wait for all, write back × scale."""
        self.launch_pending()
        if self.shards is not None:
            self.collect()
            for p in self.params:
                shard = self.shards[id(p)]
                if shard.grad is not None:
                    shard.grad.mul_(scale)
            self.active = False
            return
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            offset = 0
            for p in bucket.params:
                n = p.numel()
                if p.grad is not None:  # frozen or unused: no gradient, as in eager
                    p.grad.copy_(bucket.flat[offset:offset + n].view_as(p).mul(scale))
                offset += n
            bucket.flat, bucket.work = None, None  # the next step starts from its own grads
        self.active = False

    def collect(self) -> None:
        """ZeRO-1/2: add the launched buckets' reduced parts to the shard gradients."""
        for bucket in self.buckets:
            if bucket.flat is None:
                continue
            if bucket.work is not None:
                bucket.work.wait()
            sizes = [chunk(p.numel(), self.world) for p in bucket.params]
            for p, has, part in zip(bucket.params, bucket.has_grad, bucket.flat.split(sizes)):
                shard = self.shards[id(p)]
                if not has:  # frozen or unused: no gradient, as in eager
                    continue
                if shard.grad is None:
                    shard.grad = part.to(shard.dtype, copy=True)
                else:
                    shard.grad.add_(part)
            bucket.flat, bucket.work = None, None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
