"""benchmarks/gpu_check.py's gpt section: a GPT-3 XL shape in bf16 on one rank (eager,
torch.compile, autohybrid with and without fusion); tiny and fp32 on CPU."""
from __future__ import annotations

import copy
import gc
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import autohybrid as ah

#: the GPT-3 XL preset's shape (autohybrid/models/presets.py 'gpt3-1.3b'), sequence 1024
GPU_CONFIG = (dict(layers=24, hidden=2048, heads=16, vocab=51200, seq=1024), 4)
CPU_CONFIG = (dict(layers=2, hidden=32, heads=4, vocab=96, seq=16), 2)
STEPS = {"cuda": 5, "cpu": 2}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def flops_per_token(config: dict, params: int) -> float:
    """Training FLOPs per token: 6·N for the weights plus 12·L·h·s for attention scores."""
    return 6 * params + 12 * config["layers"] * config["hidden"] * config["seq"]


def run(dev: str, roofline: dict, spec: dict, rtol: float,
        save: Callable[[dict], None] = lambda runs: None) -> dict[str, Any]:
    """Every variant in turn (torch.compile last: its compile is the longest), `save`d
    after each so that a timeout keeps what ran."""
    config, batch = CPU_CONFIG if dev == "cpu" else GPU_CONFIG
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    base = ah.models.gpt(**config, device="cpu")
    params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(1)
    steps = STEPS[dev]
    ids = torch.randint(0, config["vocab"], (steps + 1, batch, config["seq"] + 1), generator=gen)
    data = [(x[:, :-1].to(dev), x[:, 1:].to(dev)) for x in ids]
    variants: dict[str, Callable] = {"eager": _eager(False), "autohybrid fused": _ah(False),
                                     "autohybrid unfused": _ah(True)}
    if dev == "cuda":
        variants["torch.compile"] = _eager(True)
    tokens = batch * config["seq"]
    per_token = flops_per_token(config, params)
    gemm = roofline.get("bf16_gemm_best_flops") if dev == "cuda" else None
    runs: dict[str, Any] = {}
    for name, make in variants.items():
        try:
            runs[name] = _measure(name, make, base, data, dev, dtype)
        except Exception as exc:  # one variant failing leaves the others' figures
            runs[name] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
            continue
        r = runs[name]
        r["tokens_per_s"] = tokens / r["step_s"]
        achieved = per_token * tokens / r["step_s"]
        r["achieved_flops"] = achieved
        r["mfu_of_spec"] = achieved / spec["bf16_peak_flops"]
        r["mfu_of_measured_gemm"] = achieved / gemm if gemm else None
        save(runs)
    eager = runs.get("eager", {}).get("losses")
    for name, r in runs.items():
        if name != "eager" and "losses" in r and eager:
            diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], eager)]
            r["loss_rel_diff"] = max(diffs)
            r["loss_agrees"] = max(diffs) <= rtol
    ok = bool(eager) and all("error" not in r and r.get("loss_agrees", True)
                             for r in runs.values())
    return {"device": dev, "dtype": str(dtype), "config": config, "batch": batch,
            "parameters": params, "tokens_per_step": tokens, "flops_per_token": per_token,
            "loss_rtol": rtol, "steps": steps,
            "mfu_reference": {"spec_bf16_flops": spec["bf16_peak_flops"],
                              "measured_gemm_flops": gemm},
            "runs": runs, "checks_ok": ok}


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _measure(name: str, make: Callable, base, data: list, dev: str, dtype) -> dict[str, Any]:
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    step = make(copy.deepcopy(base), data[0], dev, dtype)
    times, losses = [], []
    for k, (inputs, targets) in enumerate(data):
        _sync(dev)
        start = time.perf_counter()
        loss = float(step(inputs, targets))  # the first call captures / compiles
        _sync(dev)
        times.append(time.perf_counter() - start)
        losses.append(loss)
    out = {"first_step_s": times[0], "step_s": statistics.median(times[1:]),
           "step_times_s": times, "losses": losses}
    if dev == "cuda":
        out["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    note = getattr(step, "note", None)
    if note:
        out["note"] = note
    del step
    return out


def _eager(compiled: bool) -> Callable:
    def make(model, batch, dev, dtype):
        model = model.to(dev)
        opt = sgd(model.parameters())
        forward = torch.compile(model) if compiled else model
        mixed = dtype != torch.float32

        def step(inputs, targets):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev, dtype=dtype, enabled=mixed):
                loss = lm_loss(forward(inputs), targets)
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    return make


def _ah(unfused: bool) -> Callable:
    def make(model, batch, dev, dtype):
        inputs, targets = batch
        with _fusion_off(unfused):
            compiled = ah.compile(model, ah.Cluster.local(1, device_type=dev), (inputs,),
                                  loss_fn=lm_loss, example_targets=targets, optimizer=sgd,
                                  dtype=dtype if dtype != torch.float32 else None)
        first = [True]

        def step(inputs, targets):
            if first[0]:   # the first step captures and rewrites: the passes run here
                first[0] = False
                with _fusion_off(unfused):
                    loss = compiled.train_step((inputs,), targets)
                program = getattr(compiled, "programs", {}).get("train")
                regions = len(getattr(program, "fused_regions", ()) or ())
                step.note = f"plan {compiled.plan.mesh}; {regions} fused regions"
                return loss
            return compiled.train_step((inputs,), targets)
        step.note = ""
        return step
    return make


class _fusion_off:
    """AUTOHYBRID_DISABLE_PASSES gains 'fusion' inside (when `on`), restored after."""

    def __init__(self, on: bool):
        self.on, self.saved = on, None

    def __enter__(self):
        self.saved = os.environ.get("AUTOHYBRID_DISABLE_PASSES")
        if self.on:
            os.environ["AUTOHYBRID_DISABLE_PASSES"] = ",".join(
                filter(None, [self.saved, "fusion"]))

    def __exit__(self, *exc):
        os.environ.pop("AUTOHYBRID_DISABLE_PASSES", None)
        if self.saved is not None:
            os.environ["AUTOHYBRID_DISABLE_PASSES"] = self.saved
