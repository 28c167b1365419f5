"""Which CUDA device this rank uses, made current, checked against the job around it.

A rank's device is ``cuda:LOCAL_RANK`` (torchrun and `ah.launch` set LOCAL_RANK; without
it, the rank's index on its node). `cuda_device` checks it against the devices this
process can see (CUDA_VISIBLE_DEVICES applied; `torch.cuda.device_count()`, NVML-based
where NVML answers: a rank process may initialize CUDA) and the cluster's devices per node, refuses a default
process group already bound to another device (``init_process_group(device_id=...)``),
and calls ``torch.cuda.set_device`` before anything touches the GPU: NCCL creates its
communicators on the current device, so without it every rank of a user's own torchrun
script would run its first collective on device 0.

One exception to LOCAL_RANK: when CUDA_VISIBLE_DEVICES leaves exactly one device to
the process (a scheduler that masks a GPU per task, e.g. ``srun --gpus-per-task=1``),
that device (``cuda:0``) is the rank's.

`process_group_device` is what `ah.launch` passes as ``device_id`` to
``init_process_group`` (NCCL only: it binds the group and creates its communicator
eagerly on that device). This module starts no process and calls no collective.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..errors import ClusterError

__all__ = ["local_cuda_index", "cuda_device", "process_group_device"]


def local_cuda_index(devices_per_node: int | None, rank: int | None = None) -> int:
    """This rank's CUDA device index (LOCAL_RANK, checked)."""
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        local = 0 if rank is None or not devices_per_node else rank % devices_per_node
    elif not raw.strip().isdigit():
        raise ClusterError(f"environment variable LOCAL_RANK={raw!r} is not an integer >= 0; "
                           "is this process started by torchrun?")
    else:
        local = int(raw)
    visible_env = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count()
    shown = f"CUDA_VISIBLE_DEVICES={visible_env!r}" if visible_env is not None else \
        "CUDA_VISIBLE_DEVICES unset"
    if count == 1 and visible_env is not None and visible_env.strip():
        return 0  # one device masked to this process: it is the rank's
    if local >= count:
        raise ClusterError(
            f"LOCAL_RANK={local} needs CUDA device {local} but this process sees {count} "
            f"CUDA device(s) ({shown}): start at most {count} processes per node "
            f"(torchrun --nproc-per-node {max(count, 1)}), or make more devices visible")
    if devices_per_node is not None and local >= devices_per_node:
        raise ClusterError(
            f"LOCAL_RANK={local} but the cluster has {devices_per_node} device(s) per "
            f"node: describe the machine torchrun runs on (ah.Cluster.from_env(), or a "
            f"preset with devices_per_node={local + 1} or more), or start "
            f"{devices_per_node} processes per node")
    return local


def cuda_device(devices_per_node: int | None, rank: int | None = None) -> torch.device:
    """This rank's CUDA device, made current (``torch.cuda.set_device``), after checking
    it against LOCAL_RANK's limits and the default group's bound device."""
    index = local_cuda_index(devices_per_node, rank)
    bound = _bound_device()
    if bound is not None and bound.type == "cuda" and bound.index != index:
        raise ClusterError(
            f"the default process group is bound to {bound} (init_process_group("
            f"device_id=...)) but this rank's device is cuda:{index} (LOCAL_RANK="
            f"{os.environ.get('LOCAL_RANK')!r}): autohybrid places rank r on "
            f"cuda:LOCAL_RANK; pass device_id=torch.device('cuda', LOCAL_RANK) to "
            f"init_process_group, or let ah.launch initialize the group")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def process_group_device(backend: str, device_type: str, devices_per_node: int | None,
                         rank: int) -> torch.device | None:
    """The ``device_id`` for ``init_process_group``: this rank's device under NCCL (made
    current first), None otherwise. With gloo on CUDA the device is made current only."""
    if device_type != "cuda":
        return None
    device = cuda_device(devices_per_node, rank)
    return device if backend == "nccl" else None


def _bound_device() -> torch.device | None:
    if not dist.is_initialized():
        return None
    return getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
