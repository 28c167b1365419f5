"""Every layout against its hand-written PyTorch counterpart, paired step by step.

    python benchmarks/layouts.py [--worlds 2 4] [--steps 20] [--layouts dp zero1 ...]
                                 [--model MODEL] [--out FILE]

For each layout (`LAYOUTS`: dp with ZeRO 0–3, tp, tp+sp, pp 1F1B, and on 4 ranks dp × tp
at ZeRO 2/3) and world size, one `ah.bench` run: eager on one process, the
compiled plan pinned to the layout (what the layout leaves open, such as the gradient
bucket size, chosen by the planner calibrated on that many ranks first, `ah.calibrate`;
`--no-calibration`: on the placeholders), and the baseline `autohybrid/baselines.py` chooses
for it (DDP, DDP + ZeroRedundancyOptimizer, FSDP2 with and without resharding, DTensor,
FSDP2 + DTensor, torch.distributed.pipelining), alternating their steps with a barrier
before each. Prints one row per run: the medians, the paired ratio (the median over
steps of autohybrid's step ÷ the baseline's adjacent one: < 1 is faster) and whether the
losses equal eager's. The default model is the issue's (a GPT of hidden 512, 4 layers,
sequence 128), large enough that compute is most of a step on CPU.

On a 2-core machine the 4-rank rows share two cores between four ranks: they compare
the runtimes at the same load, not what four devices would do.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import autohybrid as ah

MODEL = "gpt3-1.3b?layers=4&hidden=512&heads=8&vocab=512&seq=128&batch=8"


@dataclass(frozen=True)
class Layout:
    name: str
    constrain: dict
    worlds: tuple[int, ...]
    #: MODEL arguments the layout's baseline needs (pipeline() does not tie weights
    #: across stages: the pp rows train the GPT with an untied head)
    model_args: str = ""


LAYOUTS = [
    Layout("dp", dict(tp=1, pp=1, zero=0), (2, 4)),
    Layout("zero1", dict(tp=1, pp=1, zero=1), (2, 4)),
    Layout("zero2", dict(tp=1, pp=1, zero=2), (2, 4)),
    Layout("zero3", dict(tp=1, pp=1, zero=3), (2, 4)),
    Layout("tp", dict(dp=1, pp=1, sp=False), (2, 4)),
    Layout("tp+sp", dict(dp=1, pp=1, sp=True), (2, 4)),
    Layout("pp", dict(dp=1, tp=1, schedule="1f1b"), (2, 4), "tie_embeddings=false"),
    Layout("dp2×tp2 zero2", dict(dp=2, tp=2, pp=1, zero=2, sp=False), (4,)),
    Layout("dp2×tp2 zero3", dict(dp=2, tp=2, pp=1, zero=3, sp=False), (4,)),
]


def constraints(layout: Layout, world: int) -> ah.Constraints:
    pinned = dict(layout.constrain)
    for axis in ("dp", "tp", "pp"):   # the axis left free takes the whole world
        if axis not in pinned:
            pinned[axis] = world
    return ah.Constraints(**pinned)


def run(model: str, layout: Layout, world: int, steps: int, warmup: int,
        calibration=None) -> dict:
    start = time.perf_counter()
    if layout.model_args:
        model += ("&" if "?" in model else "?") + layout.model_args
    result = ah.bench(model, ah.Cluster.local(world), steps=steps, warmup=warmup,
                      constraints=constraints(layout, world), calibration=calibration)
    compiled, baseline = result.run("autohybrid"), result.baseline
    return {"layout": layout.name, "world": world, "baseline": baseline.name,
            "available": baseline.available, "reason": baseline.reason,
            "eager_s": result.run("eager").median_s, "ah_s": compiled.median_s,
            "base_s": baseline.median_s, "paired": compiled.paired_ratio,
            "losses": "equal" if result.loss_check.get("ok") else "DIFFER",
            "mesh": result.plan.get("mesh", ""), "bucket_mb": result.full_plan.get("bucket_mb"),
            "wall_s": time.perf_counter() - start}


def row(r: dict) -> str:
    ms = lambda s: f"{s * 1e3:8.1f}" if s is not None else "       —"  # noqa: E731
    paired = f"{r['paired']:.3f}" if r["paired"] is not None else "—"
    if not r["available"]:
        return f"{r['layout']:<16} {r['world']:>5} no baseline: {r['reason']}"
    return (f"{r['layout']:<16} {r['world']:>5} {r['baseline']:<22} {ms(r['eager_s'])} "
            f"{ms(r['ah_s'])} {ms(r['base_s'])} {paired:>7}  {r['losses']:<6} "
            f"{r['bucket_mb']:g}")


HEADER = (f"{'layout':<16} {'ranks':>5} {'baseline':<22} {'eager ms':>8} {'ah ms':>8} "
          f"{'base ms':>8} {'paired':>7}  losses buckets MB")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layouts", nargs="+", default=[lay.name for lay in LAYOUTS])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="append the table here")
    parser.add_argument("--no-calibration", action="store_true",
                        help="plan with the local cluster's placeholder figures instead of "
                             "calibrating each world size first (ah.calibrate)")
    args = parser.parse_args(argv)
    known = {lay.name: lay for lay in LAYOUTS}
    unknown = [name for name in args.layouts if name not in known]
    if unknown:
        parser.error(f"unknown layouts {unknown}; known: {list(known)}")
    lines = [f"{args.model}, {args.steps} steps after {args.warmup} warm-up; "
             f"load {os.getloadavg()[0]:.1f} at the start", HEADER]
    print("\n".join(lines), flush=True)
    results = []
    for world in args.worlds:
        profile = None
        if not args.no_calibration:
            profile = ah.calibrate(ah.Cluster.local(world))
            lines.append(f"calibration on {world} ranks {profile.hash()}: all-reduce "
                         f"α {profile.all_reduce_latency_s * 1e6:.0f} µs, 1/β "
                         f"{profile.all_reduce_bandwidth / 1e9:.2f} GB/s, hidden share "
                         f"{profile.hidden_share.get('all_reduce', 1.0):.2f}")
            print(lines[-1], flush=True)
        for name in args.layouts:
            layout = known[name]
            if world not in layout.worlds:
                continue
            r = run(args.model, layout, world, args.steps, args.warmup, profile)
            results.append(r)
            lines.append(row(r))
            print(lines[-1], flush=True)
    lines.append(f"load {os.getloadavg()[0]:.1f} at the end")
    print(lines[-1])
    if args.out is not None:
        with args.out.open("a") as f:
            f.write("\n".join(lines) + "\n\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
