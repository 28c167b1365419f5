"""Point-to-point exchange of the per-stage self-check: values of any kind, by tag.

Owns the wire format only (runtime/selfcheck_stage.py decides what is sent where). A value
crossing stages in the captured graph is a tensor, a Python number (a size: the graph's
symbolic sizes are numbers once the batch is real) or None. Each goes as a fixed-length
int64 header (kind, dtype, requires_grad, shape) and, for a tensor, its data; the receiver
allocates from the header, so neither side needs shapes in advance. Sends are
non-blocking (`isend`, waited with `wait_all`) so that a rank hosting several stages
never blocks on itself; receives block. Messages of one (source, destination) pair and
tag arrive in the order they were sent.

    works = send_value(x, dst=1, tag=7, device=torch.device("cpu"))
    x = recv_value(src=0, tag=7, device=torch.device("cpu"))   # on rank 1
    wait_all(works)
"""
from __future__ import annotations

import struct
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutohybridError

#: header slots: kind, dtype index, requires_grad, ndim, then the sizes
_MAX_DIMS = 12
_HEADER = 4 + _MAX_DIMS
_TENSOR, _INT, _FLOAT, _BOOL, _NONE = range(5)
_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)


def _header(value: Any) -> torch.Tensor:
    head = torch.zeros(_HEADER, dtype=torch.int64)
    if isinstance(value, torch.Tensor):
        if value.dim() > _MAX_DIMS or value.dtype not in _DTYPES:
            raise AutohybridError(
                f"check='stage' cannot send a {value.dtype} tensor of {value.dim()} dims "
                f"between stages (at most {_MAX_DIMS} dims of {', '.join(map(str, _DTYPES))}); "
                "use check='whole' for this model")
        head[:4] = torch.tensor([_TENSOR, _DTYPES.index(value.dtype),
                                 int(value.requires_grad), value.dim()])
        head[4:4 + value.dim()] = torch.tensor(list(value.shape), dtype=torch.int64)
    elif isinstance(value, bool):
        head[0], head[4] = _BOOL, int(value)
    elif isinstance(value, int):
        head[0], head[4] = _INT, value
    elif isinstance(value, float):
        head[0] = _FLOAT
        head[4] = struct.unpack("<q", struct.pack("<d", value))[0]
    elif value is None:
        head[0] = _NONE
    else:
        raise AutohybridError(f"check='stage' cannot send a {type(value).__name__} between "
                              "stages (tensors, numbers and None only); use check='whole'")
    return head


def send_value(value: Any, dst: int, tag: int, device: torch.device) -> list[dist.Work]:
    """Start sending `value` to rank `dst` (its header from `device`, the device the
    backend sends from); the works to wait for."""
    works = [dist.isend(_header(value).to(device), dst, tag=tag)]
    if isinstance(value, torch.Tensor):
        works.append(dist.isend(value.detach().contiguous(), dst, tag=tag))
    return works


def recv_value(src: int, tag: int, device: torch.device) -> Any:
    """Receive one value from rank `src` (a tensor on `device`, a leaf that requires a
    gradient when the sent one did)."""
    head = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(head, src, tag=tag)
    head = head.cpu().tolist()
    kind = head[0]
    if kind == _TENSOR:
        shape = head[4:4 + head[3]]
        out = torch.empty(shape, dtype=_DTYPES[head[1]], device=device)
        dist.recv(out, src, tag=tag)
        return out.requires_grad_(bool(head[2]))
    if kind == _INT:
        return head[4]
    if kind == _BOOL:
        return bool(head[4])
    if kind == _FLOAT:
        return struct.unpack("<d", struct.pack("<q", head[4]))[0]
    return None


def send_tensor(value: torch.Tensor, dst: int, tag: int) -> list[dist.Work]:
    """Start sending a tensor whose shape and dtype the receiver knows (a gradient)."""
    return [dist.isend(value.detach().contiguous(), dst, tag=tag)]


def recv_like(like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
    """Receive a tensor shaped and typed like `like` (the gradient of a sent value)."""
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    dist.recv(out, src, tag=tag)
    return out


def wait_all(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()

