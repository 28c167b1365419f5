"""Local launch and device placement on GPU machines, with CUDA faked (process-free).

- `Cluster.local` on a machine whose NVML reports GPUs describes them without
  initializing CUDA in this process (tests/_fake_cuda.py fails any call that would), or
  from a probe process when NVML cannot name them (the probe faked here);
- `ah.launch` starts CUDA ranks with spawn (fork stays for CPU), refuses before any
  process starts a rank function a new process cannot import (naming it), and a spawned
  rank loads the launching script only up to its `ah.launch` call (runtime/spawn.py);
- a rank's device is cuda:LOCAL_RANK, made current with `torch.cuda.set_device`,
  checked against the visible devices, the cluster's devices per node and a default
  group bound elsewhere; `ah.launch` passes it as `device_id` to `init_process_group`
  under NCCL; the compiled model takes its device from there;
- the groups autohybrid makes wait the first-step bound until `step_bound()`, then
  the collective bound (a real one-rank gloo group in this process).
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
import threading
import types
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _fake_cuda import fake_gpus

import autohybrid as ah
from autohybrid import device_facts
from autohybrid.compiled import CompiledModel
from autohybrid.errors import ClusterError
from autohybrid.runtime import launch as launch_mod
from autohybrid.runtime import placement, spawn, timeouts


# ------------------------------------------------------------------ device facts, launch
def test_local_cluster_on_gpus_reads_nvml_and_leaves_cuda_uninitialized(monkeypatch):
    fake_gpus(monkeypatch, "NVIDIA H100 80GB HBM3", 8)
    cluster = ah.Cluster.local(4)
    assert (cluster.backend, cluster.device_type, cluster.device.name) == ("nccl", "cuda",
                                                                           "H100")
    assert device_facts.cuda_facts().how == "nvml"
    assert not torch.cuda.is_initialized()


def test_device_facts_from_a_probe_when_nvml_cannot_tell(monkeypatch):
    fake_gpus(monkeypatch, "unused", 2)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    runs = []

    def fake_run(cmd, **kw):
        runs.append(cmd)
        out = '{"count": 2, "name": "NVIDIA H200", "memory": 150000000000}\n'
        return subprocess.CompletedProcess(cmd, 0, out, "")
    monkeypatch.setattr(device_facts.subprocess, "run", fake_run)
    assert ah.Cluster.local(2).device.name == "H200"
    assert ah.Cluster.local(2).device.name == "H200" and len(runs) == 1  # cached
    monkeypatch.setattr(device_facts, "_CACHE", {})
    monkeypatch.setattr(device_facts.subprocess, "run", lambda cmd, **kw:
                        subprocess.CompletedProcess(cmd, 1, "", "RuntimeError: no driver"))
    assert ah.Cluster.local(2).device_type == "cpu"
    with pytest.raises(ClusterError, match="0 are visible.*no driver"):
        ah.Cluster.local(2, device_type="cuda")
    monkeypatch.setattr(device_facts, "_CACHE", {})
    monkeypatch.setattr(device_facts, "_nvml_library", lambda: False)  # no NVIDIA driver
    monkeypatch.setattr(device_facts.subprocess, "run", _no_process)
    assert device_facts.cuda_facts().count == 0  # and no probe


def _no_process(*_a, **_k):
    raise AssertionError("no NVIDIA driver: no probe process either")


def _record_launches(monkeypatch) -> list:
    calls = []

    def fake_once(main, ws, backend, device_type, args, deadline, timeout_s, start_method,
                  attempt, per_node=None):
        calls.append((start_method, main, args, per_node))
        return list(range(ws))
    monkeypatch.setattr(launch_mod, "_launch_once", fake_once)
    for var in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "AUTOHYBRID_INPROCESS"):
        monkeypatch.delenv(var, raising=False)
    return calls


def _rank_fn(rank: int, scale: int) -> int:
    return rank * scale


def test_launch_spawns_on_cuda_and_forks_on_cpu(monkeypatch):
    fake_gpus(monkeypatch, "NVIDIA H100 80GB HBM3", 4)
    calls = _record_launches(monkeypatch)
    ah.launch(_rank_fn, ah.Cluster.local(4), args=(3,))
    method, main, args, per_node = calls[-1]
    assert (method, main, per_node) == ("spawn", None, 4)
    assert isinstance(args, spawn.Pickled) and args.main is _rank_fn
    assert spawn.resolve(None, args) == (_rank_fn, (3,))
    ah.launch(_rank_fn, ah.Cluster.local(2, device_type="cpu"), args=(3,))
    assert calls[-1][:3] == ("fork", _rank_fn, (3,))
    ah.launch(_rank_fn, ah.Cluster.local(4), args=(3,), start_method="fork")
    assert calls[-1][0] == "fork"
    assert not torch.cuda.is_initialized()


def test_spawn_refuses_what_a_new_process_cannot_import(monkeypatch):
    fake_gpus(monkeypatch, "NVIDIA H100 80GB HBM3", 2)
    calls = _record_launches(monkeypatch)
    cluster = ah.Cluster.local(2)
    with pytest.raises(ClusterError, match="<lambda>.*lambda or a nested function"):
        ah.launch(lambda rank: rank, cluster)

    def nested(rank):
        return rank
    with pytest.raises(ClusterError, match="nested.*lambda or a nested function"):
        ah.launch(nested, cluster)
    with pytest.raises(ClusterError, match="args for .*_rank_fn cannot be pickled"):
        ah.launch(_rank_fn, cluster, args=(threading.Lock(),))
    session = types.ModuleType("__main__")  # an interactive session: no file
    exec("def train(rank):\n    return rank\n", session.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", session)
    with pytest.raises(ClusterError, match="__main__.train is defined in an interactive"):
        ah.launch(session.train, cluster)
    assert calls == []  # refused before any rank started


def test_spawned_rank_loads_the_script_up_to_its_launch(tmp_path, monkeypatch):
    script = tmp_path / "job.py"
    marker = tmp_path / "after"
    script.write_text(textwrap.dedent(f"""
        import autohybrid as ah
        class Config:
            size = 7
        def main(rank, config):
            return rank + config.size
        ah.launch(main, ah.Cluster.local(2, device_type="cpu"))
        open({str(marker)!r}, "w").close()  # after the launch: never in a rank
        if __name__ == "__main__":
            def guarded(rank):
                return rank
    """))
    loaded = types.ModuleType("__main__")
    loaded.__file__ = str(script)
    exec(compile(script.read_text().split("ah.launch")[0], str(script), "exec"),
         loaded.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", loaded)
    monkeypatch.setitem(sys.modules, "__mp_main__", loaded)
    target = spawn.spawn_target(loaded.main, (loaded.Config(),))
    assert target.main is None and target.script.qualname == "main"
    with spawn.script_hidden():  # what multiprocessing sees while ranks start
        assert getattr(sys.modules["__main__"], "__file__", None) is None
    assert sys.modules["__main__"] is loaded
    main, args = spawn.resolve(None, pickle.loads(pickle.dumps(target)))
    assert main(1, *args) == 8 and sys.modules["__main__"].__name__ == "__mp_main__"
    assert not marker.exists() and not spawn.loading_script()
    guarded = spawn.Pickled(None, pickle.dumps(()),
                            spawn.ScriptRef(str(script), None, "guarded"))
    with pytest.raises(ClusterError, match="'guarded' is not defined in .*before its "
                                           "ah.launch call"):
        spawn.resolve(None, guarded)


# ------------------------------------------------------------------ device placement
@pytest.fixture
def gpus(monkeypatch):
    """4 visible CUDA devices; torch.cuda.set_device records its calls."""
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(int(index)))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return calls


def test_device_from_local_rank_is_made_current(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert placement.cuda_device(4, rank=6) == torch.device("cuda", 2)
    assert gpus == [2]
    monkeypatch.delenv("LOCAL_RANK")
    assert placement.cuda_device(4, rank=7) == torch.device("cuda", 3)  # rank % per node


def test_local_rank_beyond_the_devices_is_refused(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(ClusterError, match=r"LOCAL_RANK=4 .* sees 4 CUDA device.*"
                                           r"CUDA_VISIBLE_DEVICES='0,1,2,3'"):
        placement.cuda_device(8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ClusterError, match="LOCAL_RANK=3 but the cluster has 2 device"):
        placement.cuda_device(2)
    assert gpus == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # one GPU masked to this task
    assert placement.cuda_device(8) == torch.device("cuda", 0) and gpus == [0]


def test_a_group_bound_to_another_device_is_refused(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group",
                        lambda: SimpleNamespace(bound_device_id=torch.device("cuda", 0)))
    with pytest.raises(ClusterError, match="bound to cuda:0 .* cuda:2 .*device_id="):
        placement.cuda_device(4)
    assert gpus == []


def test_launch_passes_device_id_to_init_process_group(gpus, monkeypatch):
    inits = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: inits.append(kw))
    monkeypatch.setenv("LOCAL_RANK", "1")
    out = launch_mod._run_in_this_process(_rank_fn, 1, 2, "nccl", "cuda", "env://", (5,), 2)
    assert out == 5 and inits[0]["device_id"] == torch.device("cuda", 1) and gpus == [1]
    assert inits[0]["timeout"] == timeouts.first_step_timeout()
    launch_mod._run_in_this_process(_rank_fn, 1, 2, "gloo", "cuda", "env://", (5,), 2)
    assert "device_id" not in inits[1] and gpus == [1, 1]  # gloo: current device only


def test_compiled_model_device_is_local_rank(gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    fake = SimpleNamespace(cluster=ah.Cluster.preset("dgx-h100"), rank=11,
                           model=nn.Linear(2, 2, device="meta"))
    CompiledModel._move_to_device(fake)
    assert fake.device == torch.device("cuda", 3) and gpus == [3]


# ------------------------------------------------------------------ first-step bound
def _bound(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_groups_wait_the_first_step_bound_until_step_bound(monkeypatch):
    monkeypatch.setenv("AUTOHYBRID_COLLECTIVE_TIMEOUT_S", "7")
    monkeypatch.setenv("AUTOHYBRID_FIRST_STEP_TIMEOUT_S", "300")
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeouts.group_timeout())
    try:
        world = timeouts.register_group(dist.group.WORLD)
        axis = timeouts.new_group([0])
        own = timeouts.new_group([0], timeout=timedelta(seconds=99))
        assert timeouts.in_first_steps()
        assert _bound(world) == _bound(axis) == timedelta(seconds=300)
        timeouts.step_bound()  # the first step is behind every rank
        assert _bound(world) == _bound(axis) == timedelta(seconds=7)
        assert _bound(own) == timedelta(seconds=99)  # an explicit bound is its own
        assert _bound(timeouts.new_group([0])) == timedelta(seconds=7)
        timeouts.first_steps()  # a new model compiles
        assert _bound(world) == _bound(axis) == timedelta(seconds=300)
    finally:
        dist.destroy_process_group()
    assert timeouts.in_first_steps()  # the next job starts with the first-step bound
