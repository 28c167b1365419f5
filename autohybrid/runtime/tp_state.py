"""This rank's shards of the parameters tensor and expert parallelism split, and their
gathering.

The tensor_parallel and expert_parallel passes say how each split parameter is cut
(`ShardSpec`, in `RankProgram.param_shards`, autohybrid/program.py), over which mesh axis
(`ShardSpec.axis`: "tp", or "ep" for a MoE layer's experts; `ShardSpec.inner`: cut again
over tp, expert tensor parallelism under ep). `ShardedParameters` makes
this rank's shard of each one a new Parameter (the optimizer steps these), puts it in the
program's state under the parameter's canonical name (tied parameters share the shard),
and gathers shards back over the axis's group into full tensors for `full_state_dict`,
`full_grads` and the global gradient norm. Parameters no axis splits stay the model's own.
"""
from __future__ import annotations

from .comm_device import comm_device
import torch
import torch.distributed as dist
from torch import nn

from ..errors import RuntimeFailure
from ..program import ShardSpec


class ShardedParameters:
    def __init__(self, model: nn.Module, specs: dict[str, ShardSpec],
                 groups: dict[str, tuple[dist.ProcessGroup | None, int]], materialize=None):
        """`groups`: mesh axis → (its group, its size) for every axis of `specs`;
        `materialize(name, spec)`: this rank's shard of a meta model's parameter
        (sharded materialization), or None to leave it unallocated (meta)."""
        self.specs, self.groups = dict(specs), dict(groups)
        self.local: dict[str, nn.Parameter] = {}
        canonical = {id(p): name for name, p in model.named_parameters()}
        self.alias = {key: canonical[id(p)]
                      for key, p in model.named_parameters(remove_duplicate=False)}
        for name, spec in specs.items():
            full = model.get_parameter(name)
            if full.is_meta:
                local = materialize(name, spec) if materialize is not None else None
                if local is None:
                    local = full.new_empty(spec.local_shape(full.shape))
            else:
                local = spec.local(full.detach())
            self.local[name] = nn.Parameter(local, requires_grad=full.requires_grad)

    def check_same(self, specs: dict[str, ShardSpec], what: str) -> None:
        """Graphs rewritten later (the training graph after a forward one) must cut the
        parameters the same way as the shards this rank holds."""
        if specs != self.specs:
            differ = sorted(set(specs.items()) ^ set(self.specs.items()))
            raise RuntimeFailure(
                f"the {what} graph splits parameters differently from the graph the shards "
                f"were made from (first difference: {differ[0][0]!r}); compile with "
                "example_targets so that one training graph is used throughout")

    def parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The model's parameters with each split one replaced by this rank's shard."""
        return [self.local.get(name, p) for name, p in model.named_parameters()]

    def into_state(self, state: dict[str, torch.Tensor]) -> None:
        state.update(self.local)

    # ------------------------------------------------------------------ gathering
    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole parameter (or gradient) `name` from every rank's `local` shard."""
        spec = self.specs[name]
        local = local.detach().contiguous()
        if spec.inner is not None:   # the inner axis's shards first: this rank's outer one
            local = self._gather(spec.inner, local).contiguous()
        return self._gather(spec, local)

    def _gather(self, spec: ShardSpec, local: torch.Tensor) -> torch.Tensor:
        group, size = self.groups[spec.axis]
        if group is None or size == 1:
            return spec.gather([local])
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=group)
        step = size // spec.ways  # ranks holding the same shard index (kv replicas)
        return spec.gather([parts[i * step] for i in range(spec.ways)])

    def full_state(self, model: nn.Module,
                   local: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Whole parameters and buffers; `local` overrides this rank's (tp-local) value of
        a parameter by canonical name (ZeRO gathers them from its dp shards)."""
        local = local or {}
        out = {}
        for key, value in model.state_dict(keep_vars=True).items():
            name = self.alias.get(key, key)
            mine = local.get(name, self.local.get(name))
            if name in self.local and mine.is_meta:
                # another pp stage's parameter of a meta model, never made here: meta on
                # the whole tp group alike (one stage), taken from its stage by the merge
                out[key] = mine.detach()
            elif name in self.local:
                out[key] = self.full(name, mine)
            else:
                out[key] = (mine if mine is not None else value).detach().clone()
        return out

    def full_grads(self, model: nn.Module, local: dict[str, torch.Tensor | None] | None = None
                   ) -> dict[str, torch.Tensor | None]:
        """Whole gradients; `local` overrides this rank's gradients by canonical name."""
        out = {}
        for key, p in model.named_parameters(remove_duplicate=False):
            name = self.alias.get(key, key)
            if local is not None and name in local:
                grad = local[name]
            else:
                grad = self.local[name].grad if name in self.local else p.grad
            if grad is None:
                out[key] = None
            else:
                out[key] = self.full(name, grad) if name in self.local else grad.detach().clone()
        return out

    def squared_norm(self, squares: dict[str, torch.Tensor],
                     weights: dict[str, float] | None = None) -> torch.Tensor:
        """Σ g² over the whole model from each parameter's local Σ g² (`squares`, by
        canonical name): shards summed over their axis's group (kv replicas counted
        once), the rest once (every rank of those axes holds the same); each term times
        `weights[name]` (default 1)."""
        weights = weights or {}
        device = comm_device(next(iter(self.groups.values()))[0] if self.groups else None)
        # one sum per combination of axes a tensor is cut over (a nested spec: both)
        keys = sorted({(axis,) for axis in self.groups}
                      | {spec.axes() for spec in self.specs.values()})
        split = {key: torch.zeros((), dtype=torch.float64, device=device) for key in keys}
        whole = torch.zeros((), dtype=torch.float64, device=device)
        for name, sq in squares.items():
            sq = sq * weights.get(name, 1.0)
            if name in self.specs:
                spec = key = self.specs[name]
                while spec is not None:   # (kv replicas counted once)
                    sq = sq * spec.ways / self.groups[spec.axis][1]
                    spec = spec.inner
                split[key.axes()] = split[key.axes()] + sq
            else:
                whole = whole + sq
        for key, part in split.items():   # every rank, in the same (sorted) order
            for axis in key:
                group, size = self.groups[axis]
                if group is not None and size > 1:
                    dist.all_reduce(part, group=group)
            whole = whole + part
        return whole
