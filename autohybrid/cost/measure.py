"""Count the bytes a real training step holds, to check the memory model against.

`training_bytes` runs one eager step of a model (forward, backward, optimizer step) in
this process and counts, by tensor storage (views and tied weights once): parameters,
gradients, optimizer state, and the activations autograd saved for backward (through
`torch.autograd.graph.saved_tensors_hooks`, parameters and buffers excluded). The result
is a `MemoryBreakdown`, the same shape as a plan's prediction.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn

from ..plan import MemoryBreakdown


def _storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def training_bytes(model: nn.Module, loss_fn: Callable, inputs: Sequence[torch.Tensor],
                   targets: torch.Tensor,
                   optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
                   ) -> MemoryBreakdown:
    """Bytes of one eager training step of `model` on this batch, by kind of state."""
    params = list(model.parameters())
    resident = {t.untyped_storage().data_ptr() for t in [*params, *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in resident and t.numel():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    opt = optimizer(params)
    opt.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model(*inputs), targets)
    activations = sum(saved.values())
    loss.backward()
    opt.step()
    state = [v for s in opt.state.values() for v in s.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return MemoryBreakdown(params=_storage_bytes(params),
                           grads=_storage_bytes(p.grad for p in params),
                           optimizer=_storage_bytes(state), activations=activations)
