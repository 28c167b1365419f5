"""This machine's CUDA devices (count, name, memory) without initializing CUDA here.

`Cluster.local` and `Cluster.from_env` describe the machine in the process that then
starts the ranks (`ah.launch`), and a process that has initialized CUDA cannot fork
ranks that use it. So the facts come, in order, from:

1. torch itself when CUDA is already initialized in this process, or the process is a
   rank (``AUTOHYBRID_LAUNCHED`` or torchrun's ``TORCHELASTIC_RUN_ID`` set: it starts no
   ranks of its own and uses CUDA anyway): nothing to protect;
2. NVML: the count from `torch.cuda._device_count_nvml()` (ctypes over libnvidia-ml,
   honouring CUDA_VISIBLE_DEVICES), name and memory from `pynvml` when it is importable;
3. otherwise a probe: a fresh Python process that imports torch and reads
   `torch.cuda.device_count()` / `get_device_name(0)` / `get_device_properties(0)`
   (the only process this module starts; once per process and CUDA_VISIBLE_DEVICES).

Never `torch.cuda.get_device_properties` (nor `torch._C._cuda_getDeviceCount`, which
initializes the driver) in this process before CUDA is initialized. A CPU build of torch
has no CUDA devices. This module imports nothing from autohybrid.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import NamedTuple

__all__ = ["CudaFacts", "cuda_facts"]

_PROBE_TIMEOUT_S = 180.0
_PROBE = """
import json, torch
n = torch.cuda.device_count()
p = torch.cuda.get_device_properties(0) if n else None
print(json.dumps({"count": n, "name": p.name if p else None,
                  "memory": int(p.total_memory) if p else 0}))
"""


class CudaFacts(NamedTuple):
    """CUDA devices this process can see; `name` / `memory_bytes` are device 0's.
    `how` says where the facts came from ("torch", "nvml", "probe", "none"), `note`
    why there are none when a probe failed."""

    count: int
    name: str | None
    memory_bytes: int
    how: str
    note: str = ""


_CACHE: dict[str | None, CudaFacts] = {}


def cuda_facts() -> CudaFacts:
    """The CUDA devices visible here (CUDA_VISIBLE_DEVICES applied), CUDA left
    uninitialized unless it already was; cached per CUDA_VISIBLE_DEVICES."""
    import torch

    if not torch.backends.cuda.is_built():
        return CudaFacts(0, None, 0, "none", "this torch is a CPU build")
    if torch.cuda.is_initialized() or _is_rank():
        count = torch.cuda.device_count()
        if not count:
            return CudaFacts(0, None, 0, "torch")
        props = torch.cuda.get_device_properties(0)
        return CudaFacts(count, props.name, int(props.total_memory), "torch")
    key = os.environ.get("CUDA_VISIBLE_DEVICES")
    if key not in _CACHE:
        _CACHE[key] = _uninitialized_facts()
    return _CACHE[key]


def _is_rank() -> bool:
    env = os.environ
    return env.get("AUTOHYBRID_LAUNCHED") == "1" or "TORCHELASTIC_RUN_ID" in env


def _uninitialized_facts() -> CudaFacts:
    count = _nvml_count()
    if count == 0:
        return CudaFacts(0, None, 0, "nvml")
    if count > 0:
        named = _pynvml_device0()
        if named is not None:
            return CudaFacts(count, named[0], named[1], "nvml")
    return _probe()


def _nvml_count() -> int:
    """The visible device count from NVML, 0 without an NVIDIA driver (no NVML library:
    no probe either), or -1 when NVML cannot tell."""
    import torch

    if not torch.version.hip and not _nvml_library():
        return 0

    counter = getattr(torch.cuda, "_device_count_nvml", None)
    if counter is None:
        return -1
    try:
        return int(counter())
    except Exception:  # noqa: BLE001 - no NVML library, driver mismatch: ask the probe
        return -1


def _nvml_library() -> bool:
    """True when the NVIDIA driver's NVML library loads (it comes with every driver)."""
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _pynvml_device0() -> tuple[str, int] | None:
    """(name, total memory) of visible device 0 from pynvml, or None without it."""
    try:
        import pynvml
    except ImportError:
        return None
    import torch

    try:
        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(0)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:  # noqa: BLE001 - an old pynvml or a MIG slice: ask the probe
        return None
    return (name.decode() if isinstance(name, bytes) else str(name)), memory


def _probe() -> CudaFacts:
    """The facts as a fresh process sees them (it initializes CUDA, this one does not)."""
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True,
                              text=True, timeout=_PROBE_TIMEOUT_S, env=dict(os.environ))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CudaFacts(0, None, 0, "probe", f"the CUDA probe process failed: {exc}")
    lines = done.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1])
        return CudaFacts(int(data["count"]), data["name"], int(data["memory"]), "probe")
    except (IndexError, ValueError, KeyError, TypeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return CudaFacts(0, None, 0, "probe",
                         f"the CUDA probe process failed (exit {done.returncode}): "
                         f"{' | '.join(tail) or 'no output'}")
