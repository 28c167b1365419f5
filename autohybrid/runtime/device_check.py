"""A check that every tensor handed to a collective is on the device the collective takes,
and contiguous.

NCCL takes CUDA tensors of the rank's own device only: a CPU tensor (a count, a norm, a
flag made without `device=`) fails the job on the first GPU run, and an object collective
or barrier runs on `torch.cuda.current_device()`, so a rank whose current device is not
its own blocks another rank's GPU. On CPU with gloo neither shows. Nor does a
non-contiguous tensor: gloo reduces its storage in memory order, so a gradient transposed
on one rank and row-major on another sums mismatched elements without a word (NCCL
refuses it: "Tensors must be contiguous"). `enable()` wraps the
`torch.distributed` functions autohybrid calls (its own modules look them up at each call:
`dist.all_reduce`, `ops.groups.all_gather_single`, torch's pipelining schedules' P2P
ops) with a check that raises `RuntimeFailure` naming the collective, the tensor's device
and the expected one (or its strides), before the collective runs:

    from autohybrid.runtime import device_check
    device_check.enable(torch.device("cuda", 0))   # or None: the compiled model's device
    ...                                            # (runtime/comm_device.py), per call
    device_check.calls()                           # collectives checked so far
    device_check.disable()                         # the originals back

`with device_check.checking(device):` does the same for a block. AUTOHYBRID_CHECK_COLLECTIVE_DEVICES=1
turns it on in every rank `ah.launch` starts and in every compiled model (`from_env`); the
test suite sets it for every multi-process test. Off, nothing is wrapped (no cost); on, a
call costs a walk over its arguments. Starts no process, calls no collective itself.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from .comm_device import comm_device

__all__ = ["ENV", "calls", "checking", "disable", "enable", "enabled", "from_env"]

ENV = "AUTOHYBRID_CHECK_COLLECTIVE_DEVICES"
#: collectives whose tensor arguments are checked (those torch has; both names of the
#: renamed tensor forms)
TENSOR_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
              "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
              "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
              "send", "recv", "isend", "irecv", "batch_isend_irecv")
#: collectives that take no tensor but run on the current CUDA device under NCCL
DEVICE_OPS = ("all_gather_object", "broadcast_object_list", "gather_object",
              "scatter_object_list", "barrier")

_STATE: dict[str, Any] = {"device": None, "on": False, "calls": 0, "originals": {}}


class _Checked:
    """A torch.distributed function with the device check in front. Equal to (and hashed
    as) the function it wraps: torch compares `P2POp.op` with `dist.isend`/`dist.irecv`
    (by equality when it makes the op, by identity in batch_isend_irecv, which therefore
    gets the ops with the originals back, its tensors checked)."""

    def __init__(self, name: str, original: Callable[..., Any], tensors: bool):
        functools.update_wrapper(self, original)
        self._name, self._original, self._tensors = name, original, tensors
        params = list(inspect.signature(original).parameters)
        self._group_at = params.index("group") if "group" in params else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _STATE["calls"] += 1
        group = kwargs.get("group")
        if group is None and self._group_at is not None and len(args) > self._group_at:
            group = args[self._group_at]
        expected = _expected(group)
        if self._tensors:
            for t in _tensors(args, kwargs):
                if not _same(t.device, expected):
                    raise RuntimeFailure(
                        f"torch.distributed.{self._name} was handed a tensor on {t.device} "
                        f"(shape {tuple(t.shape)}, {t.dtype}); this collective takes tensors "
                        f"on {expected}, the compiled model's device (NCCL fails on any "
                        "other). Make the tensor with device= (runtime/comm_device.py "
                        "comm_device(group)) or move it there before the collective")
                if not _dense(t):
                    raise RuntimeFailure(
                        f"torch.distributed.{self._name} was handed a non-contiguous tensor "
                        f"(shape {tuple(t.shape)}, strides {t.stride()}); gloo reads and "
                        "reduces its storage in memory order, so ranks whose tensors have "
                        "other strides combine different elements (a silently wrong sum), "
                        "and NCCL refuses it. Pass a contiguous tensor (.contiguous())")
        elif expected.type == "cuda" and _is_nccl(group):
            current = torch.device("cuda", torch.cuda.current_device())
            if not _same(current, expected):
                raise RuntimeFailure(
                    f"torch.distributed.{self._name} under NCCL runs on the current CUDA "
                    f"device, {current}, not on {expected}, the compiled model's device; "
                    f"call torch.cuda.set_device({expected}) before the first collective "
                    "(ah.launch and ah.compile do)")
        if self._name == "batch_isend_irecv":  # torch tells sends by `op.op is isend`:
            for op in (args[0] if args else kwargs.get("p2p_op_list", ())):  # the originals
                if isinstance(op.op, _Checked):
                    op.op = op.op._original
        return self._original(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return other is self or other is self._original

    def __hash__(self) -> int:
        return hash(self._original)


def _expected(group: Any) -> torch.device:
    device = _STATE["device"]
    device = comm_device(group) if device is None else device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _same(device: torch.device, expected: torch.device) -> bool:
    return device.type == expected.type and (expected.index is None
                                             or device.index == expected.index)


def _dense(t: torch.Tensor) -> bool:
    """Contiguous in its memory format (NCCL's test: row-major, or channels-last where
    the strides say so)."""
    return t.is_contiguous() or t.dim() == 4 and t.is_contiguous(
        memory_format=torch.channels_last) or t.dim() == 5 and t.is_contiguous(
        memory_format=torch.channels_last_3d)


def _is_nccl(group: Any) -> bool:
    try:
        return "nccl" in str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):   # no process group (the call itself will say)
        return False


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    yield item
                elif isinstance(getattr(item, "tensor", None), torch.Tensor):
                    yield item.tensor   # a dist.P2POp


def enable(device: torch.device | str | None = None) -> None:
    """Check every collective from now on against `device` (None: the compiled model's
    device, `comm_device(group)`, read at each call). Calling it again changes the device."""
    _STATE["device"] = None if device is None else torch.device(device)
    if _STATE["on"]:
        return
    for names, tensors in ((TENSOR_OPS, True), (DEVICE_OPS, False)):
        for name in names:
            original = getattr(dist, name, None)
            if original is None:
                continue
            _STATE["originals"][name] = original
            setattr(dist, name, _Checked(name, original, tensors))
    _STATE["on"] = True


def disable() -> None:
    """The original torch.distributed functions back."""
    for name, original in _STATE["originals"].items():
        setattr(dist, name, original)
    _STATE["originals"] = {}
    _STATE["on"] = False
    _STATE["device"] = None


def enabled() -> bool:
    return _STATE["on"]


def calls() -> int:
    """How many collectives were checked since this process first enabled the check."""
    return _STATE["calls"]


def from_env() -> bool:
    """Enable the check (device: the compiled model's) where AUTOHYBRID_CHECK_COLLECTIVE_DEVICES=1
    and a default process group exists (a rank; not a process that only fakes groups);
    whether it is on. An explicit `enable(device)` stays as it is."""
    if (os.environ.get(ENV, "0") not in ("", "0") and not _STATE["on"]
            and dist.is_initialized()):
        enable(None)
    return _STATE["on"]


@contextlib.contextmanager
def checking(device: torch.device | str | None = None) -> Iterator[None]:
    """The check on for a block (as it was before, after)."""
    was_on, was_device = _STATE["on"], _STATE["device"]
    enable(device)
    try:
        yield
    finally:
        if was_on:
            _STATE["device"] = was_device
        else:
            disable()
