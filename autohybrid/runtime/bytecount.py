"""A byte counter of live tensor memory, with an optional budget, on any device.

Why: CPU processes have no allocator statistics like `torch.cuda.max_memory_allocated`,
and address-space limits count far more than tensors. `ByteCounter` is a dispatch mode:
every tensor an op creates while it is active (parameters being materialized,
activations, gradients, optimizer state, collective buffers) is counted by its storage
until that storage is freed, so `current` and `peak` are the bytes of live tensors this
process allocated under it. With `budget`, the op that takes the count past it raises
`MemoryBudgetExceeded`: the structural proof that a rank never holds more (e.g. never the
whole model). Tensors that existed before it started are not counted; views and ops
that return their input share a storage and count once.

Example::

    with ByteCounter(budget=64 * 2**20) as counter:
        compiled = ah.compile(meta_model, cluster, inputs, init_seed=0, ...)
        compiled.train_step(inputs, targets)
    counter.peak
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import AutohybridError


class MemoryBudgetExceeded(AutohybridError):
    """Live tensor bytes went past a `ByteCounter`'s budget."""


class ByteCounter(TorchDispatchMode):
    def __init__(self, budget: int | None = None):
        super().__init__()
        self.budget = budget
        self.current = 0
        self.peak = 0
        self._live: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._count(t, func)
        return out

    def _count(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._live:
            return
        self.current += size

        def freed(_ref, key=key, size=size) -> None:
            self.current -= size
            self._live.pop(key, None)

        self._live[key] = weakref.ref(storage, freed)
        self.peak = max(self.peak, self.current)
        if self.budget is not None and self.current > self.budget:
            raise MemoryBudgetExceeded(
                f"{func}: live tensors reach {self.current:,} bytes, over the budget of "
                f"{self.budget:,} bytes (this allocation: {size:,} bytes)")
