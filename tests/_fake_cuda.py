"""Pretend this machine has CUDA devices, the way autohybrid must read them: NVML only.

`fake_gpus(monkeypatch, name, count, memory)` makes torch a CUDA build whose NVML (torch's
own ctypes count, and a fake `pynvml`) reports `count` devices called `name`, and makes
every torch call that would initialize CUDA in this process (`get_device_properties`,
`get_device_name`, `torch._C._cuda_getDeviceCount`, `torch.cuda.init`) fail the test.
`device_facts`' cache is emptied, so each call describes the fake machine afresh.
"""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import torch

from autohybrid import device_facts


def _initializes(what: str):
    def fail(*_a, **_k):
        raise AssertionError(f"{what} would initialize CUDA in the launching process")
    return fail


def fake_gpus(monkeypatch, name: str, count: int, memory: int = 80 * 2**30) -> None:
    monkeypatch.setattr(device_facts, "_CACHE", {})
    for var in ("AUTOHYBRID_LAUNCHED", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(device_facts, "_nvml_library", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: count)
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda device: int(device))
    for attr in ("get_device_properties", "get_device_name", "init", "current_device"):
        monkeypatch.setattr(torch.cuda, attr, _initializes(f"torch.cuda.{attr}"))
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount",
                        _initializes("torch._C._cuda_getDeviceCount"), raising=False)
    nvml = types.ModuleType("pynvml")
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda index: ("handle", index)
    nvml.nvmlDeviceGetName = lambda handle: name
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: SimpleNamespace(total=memory)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
