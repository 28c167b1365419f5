"""One GPU check, a few minutes on one GPU: the roofline, the fused kernels, a 1.3B GPT in
bf16 and a two-process run with collectives checked for CUDA tensors; JSON figures per
section in a folder.

    PYTHONPATH=. python benchmarks/gpu_check.py --out benchmarks/results/gpu_check_h200
    PYTHONPATH=. python benchmarks/gpu_check.py --cpu --out /tmp/gpu_check_cpu   # reduced

Each section runs in its own subprocess with a timeout (`--section NAME` runs one in this
process); a section that fails or times out is recorded with its error (`status`
"failed" / "timeout", `error`: the tail of its output) and the others still run. The
folder gets `<section>.json` per section and `summary.json` (every section's status and
figures); the exit status is 1 when any section is not "ok" or any check in it failed.

- roofline: torch / Triton / CUDA / NCCL versions and the device; the measured copy
  bandwidth (`dst.copy_(src)`, bytes read + written per second, CUDA events) and the
  bf16 GEMM rate (autohybrid/calibrate.py `measure_matmul`: 4096-8192 squares and GPT
  shapes), beside the spec figures of autohybrid/hardware.py.
- kernels: the fused patterns of a GPT block (benchmarks/fused_kernels.py's `patterns`, the
  ones `passes.fusion` fuses in the zoo's GPT, plus the softmax of attention scores) at
  GPT-3 XL sizes: autohybrid's generated kernel against eager and `torch.compile`
  (inductor), forward and forward+backward: equal to eager (max scaled abs diff within
  benchmarks/fused_kernels.py's tolerance), times, GB/s and % of the measured bandwidth.
- gpt: the GPT-3 XL shape (24 layers, hidden 2048, 16 heads, vocabulary 51200; sequence
  1024, batch 4) in bf16 mixed precision on one rank, SGD: eager under autocast,
  `torch.compile` of it, autohybrid with fusion and without (AUTOHYBRID_DISABLE_PASSES=
  fusion): first-step time (captures and compiles included), step time (median), tokens/s,
  MFU (6·N + 12·L·h·s FLOPs per token over the measured GEMM rate and over the spec peak),
  peak memory, and the first steps' losses against eager's.
- dist: two processes on the one GPU, gloo (NCCL refuses two ranks on one device) with
  every tensor handed to a collective checked to be a CUDA tensor (gloo would accept a CPU
  one; NCCL would not): dp 2, dp 2 ZeRO-3 and tp 2 + sp against eager
  (benchmarks/gpu_check_dist.py).

`--cpu`: the same code paths at tiny sizes on CPU (fp32, gloo on CPU tensors, the fused
kernels in Triton's interpreter, torch.compile left out); its figures say nothing about a
GPU. tests/test_benchmarks_gpu_check.py runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("roofline", "kernels", "gpt", "dist")
#: seconds per section on a GPU (sum 450 s: under 8 minutes with the start-ups) and on CPU
TIMEOUT_GPU = {"roofline": 45, "kernels": 120, "gpt": 195, "dist": 90}
TIMEOUT_CPU = {"roofline": 60, "kernels": 120, "gpt": 120, "dist": 120}
#: the patterns of benchmarks/fused_kernels.py run here: a GPT block's
GPT_PATTERNS = ("add+layernorm", "bias+gelu", "softmax")
#: relative difference of first-step losses still called equal (bf16 on GPU, fp32 on CPU)
LOSS_RTOL = {"gpu": 2e-2, "cpu": 1e-4}


# ------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the JSON figures")
    parser.add_argument("--cpu", action="store_true", help="reduced mode on CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply every section's timeout")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return run_section(args.section, out, args.cpu)
    summary: dict[str, Any] = {"mode": "cpu" if args.cpu else "gpu", "sections": {}}
    start = time.perf_counter()
    for name in [s.strip() for s in args.sections.split(",") if s.strip()]:
        if name not in SECTIONS:
            parser.error(f"unknown section {name!r}; known: {list(SECTIONS)}")
        limit = (TIMEOUT_CPU if args.cpu else TIMEOUT_GPU)[name] * args.timeout_scale
        summary["sections"][name] = spawn_section(name, out, args.cpu, limit)
        print(f"{name}: {summary['sections'][name]['status']} "
              f"({summary['sections'][name]['wall_s']:.1f} s)", flush=True)
    summary["wall_s"] = round(time.perf_counter() - start, 2)
    summary["ok"] = all(s["status"] == "ok" and s.get("checks_ok", True)
                        for s in summary["sections"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0 if summary["ok"] else 1


def section_env(cpu: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")])))
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    return env


def spawn_section(name: str, out: Path, cpu: bool, timeout_s: float) -> dict[str, Any]:
    """Run one section in a fresh interpreter; its JSON, or a record of how it failed."""
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out),
           "--section", name] + (["--cpu"] if cpu else [])
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=section_env(cpu), capture_output=True, text=True,
                              timeout=timeout_s, cwd=str(ROOT))
        status, tail = ("ok" if proc.returncode == 0 else "failed"), proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        status = "timeout"
        tail = f"timed out after {timeout_s:.0f} s\n" + _text(exc.stdout) + _text(exc.stderr)
    wall = round(time.perf_counter() - start, 2)
    record = json.loads(path.read_text()) if path.exists() else {}
    if status == "ok" and record.get("status") == "partial":
        status = "failed"
    if status != "ok" or not record:
        record = {**record, "status": status if status != "ok" else "failed",
                  "error": tail[-4000:] or "no output and no JSON"}
    record["wall_s"] = wall
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return record


def _text(b: Any) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_section(name: str, out: Path, cpu: bool) -> int:
    """In the section's own process: run it, write `<name>.json`; 0 when it ran."""
    fn: Callable[[Path, bool], dict] = {"roofline": roofline, "kernels": kernels,
                                        "gpt": gpt, "dist": dist}[name]
    try:
        record = {"status": "ok", **fn(out, cpu)}
        code = 0
    except Exception:
        record, code = {"status": "failed", "error": traceback.format_exc()[-4000:]}, 1
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    return code


# ------------------------------------------------------------------ shared
def device(cpu: bool) -> str:
    import torch

    if cpu:
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device visible: run with --cpu for the reduced mode")
    return "cuda"


def spec_figures(dev: str) -> dict[str, Any]:
    """The device's entry in autohybrid/hardware.py: bandwidth and bf16 peak."""
    import torch

    from autohybrid import hardware

    if dev == "cuda":
        props = torch.cuda.get_device_properties(0)
        spec = hardware.match_cuda_device(props.name, props.total_memory)
    else:
        spec = hardware.device("cpu")
    return {"name": spec.name, "memory_bandwidth": spec.memory_bandwidth,
            "bf16_peak_flops": spec.flops(torch.bfloat16)}


def save_partial(out: Path, name: str, record: dict[str, Any]) -> None:
    """What a section has so far, so that a timeout keeps it (spawn_section reads it)."""
    (out / f"{name}.json").write_text(json.dumps({"status": "partial", **record}, indent=2,
                                                 default=str) + "\n")


def roofline_of(out: Path) -> dict[str, Any]:
    """The roofline section's measured figures (empty when it did not run)."""
    path = out / "roofline.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    return data if data.get("status") == "ok" else {}


def seconds(fn: Callable[[], Any], dev: str, reps: int = 5) -> float:
    """Median seconds per call (CUDA events on a GPU, wall clock on CPU)."""
    from autohybrid.calibrate import device_time
    return device_time(fn, reps, dev)


# ------------------------------------------------------------------ (a) roofline
def roofline(out: Path, cpu: bool) -> dict[str, Any]:
    import torch

    from autohybrid.calibrate import measure_matmul

    dev = device(cpu)
    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import triton
        versions["triton"] = triton.__version__
    except ImportError:
        versions["triton"] = None
    if dev == "cuda":
        nccl = torch.cuda.nccl.version()
        versions.update(cuda=torch.version.cuda,
                        nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                        device=torch.cuda.get_device_name(0),
                        capability=".".join(map(str, torch.cuda.get_device_capability(0))))
    numel = (1 << 28) if dev == "cuda" else (1 << 20)   # 512 MiB of bf16 / 2 MiB
    src = torch.randn(numel, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = seconds(lambda: dst.copy_(src), dev)
    bandwidth = 2 * src.numel() * src.element_size() / copy_s
    shapes = ((4096, 8192, (8192, 2048, 8192), (8192, 8192, 2048), (8192, 2048, 6144))
              if dev == "cuda" else (64, (64, 32, 96)))
    gemm = {str(s): measure_matmul(s, torch.bfloat16, 5, dev) for s in shapes}
    spec = spec_figures(dev)
    best = max(gemm.values())
    return {"device": dev, "versions": versions, "copy_bandwidth": bandwidth,
            "copy_bytes": 2 * src.numel() * src.element_size(), "bf16_gemm_flops": gemm,
            "bf16_gemm_best_flops": best, "spec": spec,
            "copy_of_spec": bandwidth / spec["memory_bandwidth"],
            "gemm_of_spec": best / spec["bf16_peak_flops"]}


# ------------------------------------------------------------------ (b) fused kernels
def kernels(out: Path, cpu: bool) -> dict[str, Any]:
    import torch

    import fused_kernels as kb   # benchmarks/fused_kernels.py (on PYTHONPATH via section_env)

    dev = device(cpu)
    dtype = torch.float32 if cpu else torch.bfloat16
    measured = roofline_of(out).get("copy_bandwidth")
    bandwidth = measured or spec_figures(dev)["memory_bandwidth"]
    timer = kb.Timer(dev == "cuda", 2)
    zoo, launches = kb.zoo_regions(), kb._count_launches()
    chosen = [p for p in kb.patterns(kb.SMOKE if cpu else kb.FULL) if p.name in GPT_PATTERNS]
    missing = set(GPT_PATTERNS) - {p.name for p in chosen}
    if missing:
        raise RuntimeError(f"benchmarks/fused_kernels.py has no pattern named {sorted(missing)}")
    rows = []
    for p in chosen:
        r = kb.run_pattern(p, dtype, dev, timer, None if cpu else "inductor", zoo, launches)
        row = {"pattern": p.name, "shapes": p.shapes, "fused_by_pass": r.in_pass,
               "mode": r.mode, "launches_fwd_bwd": r.launches,
               "equal_fwd": r.match_fwd, "equal_bwd": r.match_bwd,
               "max_abs_diff_fwd": r.err_fwd, "max_abs_diff_bwd": r.err_bwd,
               "compile_equal": r.compile_match, "tolerance": kb.TOL[dtype],
               "bytes_fwd": r.bytes_fwd, "bytes_fwd_bwd": r.bytes_fwd_bwd}
        for phase, times, nbytes in (("fwd", r.fwd, r.bytes_fwd),
                                     ("fwd_bwd", r.fwd_bwd, r.bytes_fwd_bwd)):
            for impl, t in times.items():
                row[f"{phase}_{impl}_s"] = t
                row[f"{phase}_{impl}_gbs"] = nbytes / t / 1e9
                row[f"{phase}_{impl}_of_bandwidth"] = nbytes / t / bandwidth
        rows.append(row)
        save_partial(out, "kernels", {"patterns": rows})
    ok = all(r["equal_fwd"] and r["equal_bwd"] and r["compile_equal"] is not False
             for r in rows)
    return {"device": dev, "dtype": str(dtype), "bandwidth": bandwidth,
            "bandwidth_source": "measured (roofline)" if measured else "hardware.py spec",
            "torch_compile": None if cpu else "inductor", "patterns": rows, "checks_ok": ok}


# ------------------------------------------------------------------ (c) the GPT
def gpt(out: Path, cpu: bool) -> dict[str, Any]:
    import gpu_check_gpt   # benchmarks/gpu_check_gpt.py

    return gpu_check_gpt.run(device(cpu), roofline_of(out), spec_figures(device(cpu)),
                             LOSS_RTOL["cpu" if cpu else "gpu"],
                             lambda runs: save_partial(out, "gpt", {"runs": runs}))


# ------------------------------------------------------------------ (d) two processes
def dist(out: Path, cpu: bool) -> dict[str, Any]:
    import gpu_check_dist   # benchmarks/gpu_check_dist.py

    return gpu_check_dist.run(out, cpu, section_env(cpu))


if __name__ == "__main__":
    sys.exit(main())
