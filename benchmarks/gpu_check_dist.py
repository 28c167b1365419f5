"""benchmarks/gpu_check.py's dist section: two processes on one GPU, gloo bound to CUDA
tensors: dp 2, dp 2 ZeRO-3 and tp 2 + sp of a small GPT, 3 SGD steps against eager.

NCCL refuses two ranks on one device, so both ranks use gloo, which takes CUDA tensors for
the collectives autohybrid calls, with every tensor handed to a collective checked to be
on the compiled model's device (`enable_device_check`): a CPU tensor raises as NCCL would.
Both ranks place their model on cuda:0 through a cluster of two one-GPU "nodes"
(`two_ranks_one_gpu`). With `--cpu`: gloo on CPU, tensors checked to be CPU tensors.

`enable_device_check` is the one place to point at autohybrid's own collective device
check once it exists (autohybrid/runtime/device_check.py `enable(device)`, env
AUTOHYBRID_CHECK_COLLECTIVE_DEVICES=1): it uses that module where importable, else the
wrapper here over the `torch.distributed` functions the runtime calls.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

CASES = {"tp+sp": dict(dp=1, tp=2, pp=1, sp=True), "dp": dict(dp=2, tp=1, pp=1, zero=0),
         "zero3": dict(dp=2, tp=1, pp=1, zero=3)}
CONFIG = dict(layers=2, hidden=32, heads=4, vocab=96, seq=16)  # gpt-tiny
BATCH, STEPS, RTOL = 4, 3, 1e-4
#: the torch.distributed functions whose tensors are checked
CHECKED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
           "reduce_scatter_tensor", "broadcast", "send", "recv", "isend", "irecv",
           "all_to_all_single", "all_to_all", "reduce", "gather", "scatter",
           "batch_isend_irecv")


# ------------------------------------------------------------------ the section (parent)
def run(out: Path, cpu: bool, env: dict[str, str], timeout_s: float = 80.0) -> dict[str, Any]:
    port = _free_port()
    for r in range(2):
        (out / f"dist_rank{r}.json").unlink(missing_ok=True)
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--port", str(port),
                               "--out", str(out)] + (["--cpu"] if cpu else []),
                              env=dict(env, AUTOHYBRID_CHECK_COLLECTIVE_DEVICES="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    deadline, logs = time.monotonic() + timeout_s, []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"the two ranks did not finish in {timeout_s:.0f} s")
    ranks = []
    for r, p in enumerate(procs):
        path = out / f"dist_rank{r}.json"
        if p.returncode != 0 or not path.exists():
            raise RuntimeError(f"rank {r} exited {p.returncode}:\n{logs[r][-3000:]}")
        ranks.append(json.loads(path.read_text()))
    eager = ranks[0]["eager"]
    cases = {}
    for name in CASES:
        per = [rk["cases"][name] for rk in ranks]
        errors = [c["error"] for c in per if "error" in c]
        if errors:
            cases[name] = {"ok": False, "error": errors[0]}
            continue
        losses = per[0]["losses"]
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, eager))
        same = all(c["losses"] == losses for c in per)
        cases[name] = {"ok": diff <= RTOL and same, "losses": losses, "rel_diff": diff,
                       "ranks_agree": same, "plan": per[0]["plan"],
                       "collective_calls_checked": [c["checked"] for c in per]}
    return {"device": "cpu" if cpu else "cuda", "backend": "gloo", "config": CONFIG,
            "eager_losses": eager, "device_check": ranks[0]["device_check"], "cases": cases,
            "checks_ok": all(c["ok"] for c in cases.values())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the device check
class DeviceCheck:
    """Counts the collectives checked; raises on a tensor on another device type."""

    def __init__(self, device_type: str, source: str):
        self.device_type, self.source, self.calls = device_type, source, 0

    def check(self, op: str, args: tuple, kwargs: dict) -> None:
        self.calls += 1
        for t in _tensors(list(args) + list(kwargs.values())):
            if t.device.type != self.device_type:
                raise RuntimeError(f"torch.distributed.{op} was handed a {t.device} tensor "
                                   f"{tuple(t.shape)} {t.dtype}; the compiled model runs on "
                                   f"{self.device_type} (NCCL would refuse it)")


def _tensors(values: list) -> list:
    import torch

    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors(list(v))
        elif hasattr(v, "tensor") and isinstance(getattr(v, "tensor"), torch.Tensor):
            out.append(v.tensor)    # a dist.P2POp
    return out


def enable_device_check(device_type: str) -> DeviceCheck:
    """Check every tensor given to a collective (see the module docstring)."""
    try:
        from autohybrid.runtime import device_check as theirs   # the runtime's own check
    except ImportError:
        theirs = None
    if theirs is not None and hasattr(theirs, "enable"):
        import torch
        theirs.enable(torch.device(device_type))
        return DeviceCheck(device_type, "autohybrid.runtime.device_check")
    import torch.distributed as dist

    checker = DeviceCheck(device_type, "benchmarks/gpu_check_dist.py wrapper")
    for op in CHECKED:
        original = getattr(dist, op, None)
        if original is None:
            continue

        @functools.wraps(original)
        def wrapped(*args, _op=op, _original=original, **kwargs):
            checker.check(_op, args, kwargs)
            return _original(*args, **kwargs)
        setattr(dist, op, wrapped)
    return checker


# ------------------------------------------------------------------ one rank
def two_ranks_one_gpu():
    """Two one-GPU 'nodes' (rank % devices_per_node = 0: both ranks on cuda:0)."""
    import autohybrid as ah

    cluster = ah.Cluster.preset("hgx-h200", nodes=2, devices_per_node=1)
    return dataclasses.replace(cluster, name="one-gpu-two-ranks", is_local=True)


def worker(rank: int, port: int, out: Path, cpu: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import autohybrid as ah

    dev = "cpu" if cpu else "cuda"
    if not cpu:
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    checker = enable_device_check(dev)
    cluster = ah.Cluster.local(2, device_type="cpu") if cpu else two_ranks_one_gpu()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CONFIG["vocab"], (STEPS, BATCH, CONFIG["seq"] + 1), generator=gen)
    data = [(x[:, :-1].to(dev), x[:, 1:].to(dev)) for x in ids]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05)

    def model():
        torch.manual_seed(0)
        return ah.models.gpt(**CONFIG, device="cpu")

    result: dict[str, Any] = {"cases": {}, "device_check": checker.source}
    if rank == 0:
        m = model().to(dev)
        opt = sgd(m.parameters())
        losses = []
        for inputs, targets in data:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(m(inputs), targets)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        result["eager"] = losses
    for name, pins in CASES.items():
        before = checker.calls
        try:
            compiled = ah.compile(model(), cluster, (data[0][0],), loss_fn=loss_fn,
                                  example_targets=data[0][1], optimizer=sgd,
                                  constraints=ah.Constraints(**pins))
            losses = [float(compiled.train_step((i,), t)) for i, t in data]
            result["cases"][name] = {"losses": losses, "plan": compiled.plan.summary(),
                                     "checked": checker.calls - before}
            del compiled
        except Exception:
            result["cases"][name] = {"error": traceback.format_exc()[-3000:]}
        dist.barrier()
    (out / f"dist_rank{rank}.json").write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker(int(args[args.index("--worker") + 1]), int(args[args.index("--port") + 1]),
           Path(args[args.index("--out") + 1]), "--cpu" in args)
