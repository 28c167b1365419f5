"""Where a tensor handed to a collective must live: `comm_device(group)`.

NCCL takes CUDA tensors only (a CPU tensor fails the collective, or the job), gloo takes
CPU tensors and, for some collectives, CUDA ones. The runtime's own small tensors (loss
counts, norms, flags, bucket counts) are made on `comm_device(group)`, never on the
default device: a rank that holds no gradients or no parameters would otherwise hand a
CPU tensor to NCCL. The device is the compiled model's (`bind`, called by compiled.py),
else cuda:current for an NCCL group, else CPU. Starts no process, calls no collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["bind", "comm_device"]

_BOUND: list[torch.device | None] = [None]


def bind(device: torch.device | str) -> None:
    """The compiled model's device: what this process's collectives take from now on."""
    _BOUND[0] = torch.device(device)


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device tensors for a collective on `group` (None: the default group) live on."""
    if _BOUND[0] is not None:
        return _BOUND[0]
    if dist.is_initialized():
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
