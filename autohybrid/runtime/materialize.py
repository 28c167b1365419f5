"""Sharded materialization: a meta model's parameters, rank by rank, shard by shard.

`ah.compile(model_on_meta, ..., init_seed=s)` never builds the whole model: each rank
allocates only what its Plan gives it — the tensor-parallel shard of each split
parameter, the whole of each unsplit one, only for the parameters of its pipeline
stages, and under ZeRO-3 only its flat dp chunk of each — with the values that
`autohybrid.init.materialize(model, s)` gives the whole model (the seeded, slice-
addressable initialization of autohybrid/init.py; the eager reference uses it). A tp
shard is read slice by slice (`ShardSpec.local_from`); a ZeRO-3 chunk of an unsplit
parameter is read as a flat range; a chunk of a split one from its tp shard, made and
dropped one parameter at a time.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from ..errors import ModelError
from ..init import init_specs, materialize_buffers, replace_parameters, values
from ..ops.zero import chunk, shard_of
from ..program import ShardSpec


class Materializer:
    def __init__(self, model: nn.Module, seed: int, device: torch.device):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ModelError(f"init_seed must be an integer, got {seed!r}")
        self.seed, self.device = seed, device
        self.specs = init_specs(model)
        self.meta = {name: p for name, p in model.named_parameters()}
        materialize_buffers(model, device)

    def _values(self, name: str, **where) -> torch.Tensor:
        p = self.meta[name]
        return values(self.specs[name], p.shape, self.seed, name, dtype=p.dtype,
                      device=self.device, **where)

    def whole(self, name: str) -> torch.Tensor:
        return self._values(name)

    def tp_local(self, name: str, spec: ShardSpec) -> torch.Tensor:
        return spec.local_from(lambda index: self._values(name, index=index),
                               self.meta[name].dim())

    def zero_shard(self, name: str, dp: int, rank: int, spec: ShardSpec | None) -> torch.Tensor:
        """This dp rank's flat chunk of the (tp-local) parameter, zero-padded."""
        if spec is not None:
            return shard_of(self.tp_local(name, spec), dp, rank)
        n = self.meta[name].numel()
        c = chunk(n, dp)
        start, stop = min(rank * c, n), min((rank + 1) * c, n)
        out = torch.zeros(c, dtype=self.meta[name].dtype, device=self.device)
        out[: stop - start] = self._values(name, flat=(start, stop))
        return out

    def into_model(self, model: nn.Module, names: set[str]) -> None:
        """Give the model's own parameters `names` their values (ties stay one Parameter)."""
        replace_parameters(model, {
            id(self.meta[n]): nn.Parameter(self.whole(n), requires_grad=self.meta[n].requires_grad)
            for n in names})


def retarget_device(gm: fx.GraphModule, device: torch.device) -> None:
    """Point the graph's factory ops (`arange(..., device=meta)`) of a graph captured from
    a meta model at the device it runs on (submodules: recompute regions, included)."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            if node.op == "call_function" and isinstance(node.kwargs.get("device"),
                                                         torch.device) \
                    and node.kwargs["device"].type == "meta":
                node.kwargs = {**node.kwargs, "device": device}
                changed = True
        if changed:
            module.recompile()
