"""Memory per rank: parameters, gradients, optimizer state and activations.

Bytes per parameter follow the mixed-precision Adam accounting of
`shared/reference/hardware_and_formulas.md` (16 bytes replicated; ZeRO-1 4 + 12/d,
ZeRO-2 2 + 14/d, ZeRO-3 16/d); in fp32 the same 16 bytes split 4/4/8. Activations are the
bytes autograd saves for one microbatch (from the graph, `cost.compute.saved_nodes`)
times the microbatches in flight. This module does not search; it prices one layout.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import MemoryBreakdown

#: Allocator fragmentation and workspace reserve (fraction of device memory kept free).
MEMORY_HEADROOM = 0.10

_DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    return _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter for each kind of training state, before sharding."""

    params: float
    grads: float
    optimizer: float


def state_bytes_per_param(dtype: str, optimizer: str) -> StateBytes:
    """Per-parameter bytes of weights, gradients and optimizer state."""
    width = dtype_bytes(dtype)
    mixed = width < 4
    master = 4.0 if mixed else 0.0
    moments = {"adam": 2, "sgd": 1, "none": 0}[optimizer] * (4.0 if mixed else float(width))
    return StateBytes(params=float(width), grads=float(width),
                      optimizer=master + moments if optimizer != "none" else 0.0)


def training_state(param_count: int, dtype: str, optimizer: str, zero: int, dp: int,
                   tp: int = 1, pp: int = 1) -> MemoryBreakdown:
    """Parameter, gradient and optimizer bytes on one rank (parameters split by tp·pp)."""
    per = state_bytes_per_param(dtype, optimizer)
    local = param_count / (tp * pp)
    params = local * per.params / (dp if zero >= 3 else 1)
    grads = local * per.grads / (dp if zero >= 2 else 1)
    optim = local * per.optimizer / (dp if zero >= 1 else 1)
    return MemoryBreakdown(params=int(params), grads=int(grads), optimizer=int(optim))


def usable_bytes(device_memory: int) -> int:
    return int(device_memory * (1.0 - MEMORY_HEADROOM))
