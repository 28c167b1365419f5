"""ZeRO on the data-parallel axis: this rank's flat shards of what it trains.

Every parameter this rank trains (the model's own, or its tensor-parallel shard; with
pipeline parallelism those of its stages) gets a 1-D shard Parameter of `c = ceil(n/dp)`
elements (ops/zero.py's layout). The optimizer is built over the shards, so its state is
1/dp of the replicated one at every stage; elementwise optimizers (SGD, Adam, AdamW, …)
then compute exactly what they would on whole parameters.

    stage   gradient reduction (runtime/reducer.py)          parameters between steps
    1       whole gradients accumulate over microbatches;     whole, all-gathered after
            buckets reduce-scattered in the last backward     the optimizer step (one
    2       buckets reduce-scattered in every microbatch's    all-gather per bucket; a
            backward: only shard gradients outlive it         parameter of a bucket's
                                                              size or 1 MiB or more: its
                                                              own, straight into its
                                                              storage)
    3       reduce-scatter in backward, per layer            shards only: graphs gather
            (ops/zero.py's gather start/wait)                  each layer's parameters
                                                              before use (passes/zero.py)

Expert parallelism (`groups_of`): a MoE layer's expert slices are held alike by the dp/ep
ranks of their "edp" group, not by every dp rank, so their shards are cut over that group
(its size and this rank's index in it) and gathered over it; every other parameter's over
dp. Gradients are scaled by 1/Σ denominators like every other gradient
(passes/global_loss.py).
`full_value` / `full_grad` gather a parameter or its gradient back (for `full_state_dict`,
`full_grads`); `squared_grad_norms` gives each parameter's Σg² over the dp group for
clipping.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..ops import groups
from ..ops.zero import chunk, copy_gathered, gather, gather_start, shard_of


#: ZeRO-1/2 parameters of this many bytes or more are gathered in place, each on its own,
#: whatever the bucket size (`ZeroShards._pad_large`): on 2 CPU ranks 16 such gathers of a
#: 13 M-parameter GPT took 19 ms, one bucketed gather of the same bytes 13 ms plus ~12 ms
#: of copies into and out of its buffer
PAD_BYTES = 1 << 20


class ZeroShards:
    def __init__(self, stage: int, params: dict[str, nn.Parameter],
                 group: dist.ProcessGroup | None, dp: int, dp_rank: int, bucket_bytes: int,
                 values_of=None, groups_of: dict[str, tuple] | None = None):
        """`values_of(name)`: this rank's shard of a parameter left on the meta device
        (sharded materialization: runtime/materialize.py); `groups_of`: name → (group,
        size, index) of the parameters sharded over another group than dp's."""
        self.stage, self.group, self.dp, self.dp_rank = stage, group, dp, dp_rank
        #: name → (group, size, this rank's index) where not (group, dp, dp_rank)
        self.groups_of = dict(groups_of or {})
        self.params = dict(params)                       # name → the whole (tp-local) param
        self.numel = {name: p.numel() for name, p in params.items()}
        self.shape = {name: tuple(p.shape) for name, p in params.items()}
        self.bucket_bytes = bucket_bytes
        #: ZeRO-1/2: name → the padded flat storage of a parameter of a bucket's bytes or
        #: PAD_BYTES or more (`_gather_in_place`): its all-gather writes the whole value there
        self._padded = self._pad_large() if stage < 3 else {}
        self.shards = {name: nn.Parameter(self._row(name) if name in self._padded
                                          else values_of(name) if p.is_meta
                                          else shard_of(p, self.ways(name), self.index(name)),
                                          requires_grad=p.requires_grad)
                       for name, p in params.items()}
        self._by_id = {id(p): name for name, p in params.items()}

    def _pad_large(self) -> dict[str, torch.Tensor]:
        """Parameters of `bucket_bytes` (or `PAD_BYTES`, the smaller) or more become views
        of `ways · c` elements: the all-gather of their shards (rank-major, `c` each) lays
        the whole value out at the start of that buffer, so `gather_params` gathers them
        straight into the parameters, with no concatenation before and no copy after (on
        2 CPU ranks those
        two copies of a 13 M-parameter GPT took ~12 ms of a ~450 ms step, beside
        ZeroRedundancyOptimizer's in-place broadcasts). Their shards are this rank's row
        of the buffer (`_row`): the optimizer updates the whole parameter's slice in
        place, and the gather fills in the other rows. Smaller ones share buckets."""
        padded = {}
        for name, p in self.params.items():
            ways, n = self.ways(name), p.numel()
            if ways == 1 or p.is_meta or n * p.element_size() < min(self.bucket_bytes,
                                                                     PAD_BYTES):
                continue
            buffer = p.detach().new_zeros(chunk(n, ways) * ways)
            buffer[:n].copy_(p.detach().reshape(-1))
            p.data = buffer[:n].view(p.shape)   # the same Parameter object, new storage
            padded[name] = buffer
        return padded

    def ways(self, name: str) -> int:
        """Over how many ranks parameter `name` is sharded."""
        return self.groups_of[name][1] if name in self.groups_of else self.dp

    def index(self, name: str) -> int:
        """Which of its shards this rank holds."""
        return self.groups_of[name][2] if name in self.groups_of else self.dp_rank

    def _group_of(self, name: str) -> dist.ProcessGroup | None:
        group, size = (self.groups_of[name][:2] if name in self.groups_of
                       else (self.group, self.dp))
        return group if group is not None and size > 1 else None

    def shard_for(self, param: nn.Parameter) -> nn.Parameter:
        return self.shards[self._by_id[id(param)]]

    def optimizer_params(self) -> list[nn.Parameter]:
        return list(self.shards.values())

    # ------------------------------------------------------------------ gradients
    def scale_grads(self, scale: float | torch.Tensor) -> None:
        for s in self.shards.values():
            if s.grad is not None:
                s.grad.mul_(scale)

    def squared_grad_norms(self) -> dict[str, torch.Tensor]:
        """Σ g² of each parameter's whole gradient (this rank's shards summed over dp)."""
        out = {}
        for names in self._by_group([n for n, s in self.shards.items() if s.grad is not None]):
            local = torch.stack([self.shards[n].grad.detach().double().pow(2).sum()
                                 for n in names])
            group = self._group_of(names[0])
            if group is not None:
                dist.all_reduce(local, group=group)
            out.update(zip(names, local.unbind()))
        return out

    def _by_group(self, names: list[str]) -> list[list[str]]:
        """`names` grouped by the group they are sharded over (dp's first), in order."""
        parts: dict[bool, list[str]] = {}
        for n in names:
            parts.setdefault(n in self.groups_of, []).append(n)
        return [parts[k] for k in (False, True) if k in parts]

    # ------------------------------------------------------------------ parameters
    def gather_params(self) -> None:
        """ZeRO-1/2 after the optimizer step: every whole parameter from the shards, one
        all-gather per bucket; the next bucket's is in flight while one is copied into
        its parameters (two buckets of whole parameters at most besides them)."""
        buckets = self._buckets()
        with torch.no_grad():
            direct = [self._gather_in_place(name) for name in self._padded]
            issued = self._gather_start(buckets[0]) if buckets else None
            for i, names in enumerate(buckets):
                flat, work = issued
                issued = self._gather_start(buckets[i + 1]) if i + 1 < len(buckets) else None
                if work is not None:
                    work.wait()
                copy_gathered(flat, [self.shards[n].numel() for n in names],
                              [self.params[n] for n in names])
            for work in direct:
                if work is not None:
                    work.wait()

    def _row(self, name: str) -> torch.Tensor:
        """This rank's shard of a padded parameter: its row of the padded storage."""
        return self._padded[name].view(self.ways(name), -1)[self.index(name)]

    def _gather_in_place(self, name: str) -> object | None:
        """Issue the all-gather of parameter `name`'s shards into its padded storage."""
        group = self._group_of(name)   # (the shard is the row it gathers into)
        if group is None:
            return None
        return groups.all_gather_single(self._padded[name], self.shards[name].detach(),
                                        group=group, async_op=True)

    def _gather_start(self, names: list[str]) -> tuple[torch.Tensor, object | None]:
        return gather_start([self.shards[n].detach() for n in names],
                            self._group_of(names[0]), async_op=True)

    def full_value(self, name: str) -> torch.Tensor:
        """The whole (tp-local) parameter `name`, gathered from the shards under ZeRO-3."""
        if self.stage < 3:
            return self.params[name].detach()
        return gather([self.shards[name].detach()], [self.shape[name]],
                      self._group_of(name))[0]

    def full_grad(self, name: str) -> torch.Tensor | None:
        """The whole (tp-local) reduced gradient of `name` (None without one)."""
        grad = self.shards[name].grad  # None on every dp rank alike (the same graph)
        if grad is None:
            return None
        return gather([grad.detach()], [self.shape[name]], self._group_of(name))[0]

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and shards this object keeps (for the tests'
        byte counters and `explain`)."""
        shards = sum(s.numel() * s.element_size() for s in self.shards.values())
        shard_grads = sum(s.grad.numel() * s.grad.element_size()
                          for s in self.shards.values() if s.grad is not None)
        return {"shards": shards, "shard_grads": shard_grads}

    # ------------------------------------------------------------------ helpers
    def _buckets(self) -> list[list[str]]:
        """Names in gather buckets of about `bucket_bytes`, a bucket's all over one group."""
        out: list[list[str]] = []
        for names in self._by_group([n for n in self.shards if n not in self._padded]):
            out.append([])
            size = 0
            for name in names:
                out[-1].append(name)
                ways = self.ways(name)
                size += chunk(self.numel[name], ways) * ways * self.shards[name].element_size()
                if size >= self.bucket_bytes:
                    out.append([])
                    size = 0
        return [b for b in out if b]
