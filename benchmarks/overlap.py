"""Overlap benchmark: step time and exposed communication with each mechanism on and off.

For one GPT on 4 local processes (gloo), each row compiles the same plan twice — with an
overlap mechanism on and off — trains both on the same batches and measures every step
under torch.profiler (runtime/profile.py): the step time (slowest rank per step) and the
exposed communication (communication not covered by compute, the most exposed rank per
step), medians over the measured steps. Beside them, the cost model's prediction for the
plan (`plan.predicted.step_time_s`, `.exposed_comm_s`).

Mechanisms:

- DP bucketing (dp 4, ZeRO 0): gradient buckets all-reduced during backward as they fill
  (`bucket_mb=1`: several buckets) against one bucket launched when backward ends
  (`bucket_mb=1000`);
- ZeRO-3 prefetch (dp 4): the overlap pass (passes/overlap.py) starting each layer's
  gather while the previous layer computes, against gathers started where they are
  waited for (`AUTOHYBRID_DISABLE_PASSES=overlap` at compile time);
- hierarchical all-reduce (dp 4 on 2 nodes × 2 processes, ZeRO 0): intra-node
  reduce-scatter, inter-node all-reduce, intra-node all-gather (and its segmented form)
  against the flat ring all-reduce;
- TP+SP (dp 2 × tp 2 with sequence parallelism): collective matmul (each sp all-gather →
  linear and linear → reduce-scatter in chunks, ops/collective_matmul.py), against the
  unchunked collectives split into issue and wait with independent compute moved
  between them ("async only": the overlap pass on, passes/overlap.py), against both off;
- PP (pp 2 × dp 2, 1F1B, 4 microbatches): each stage's dp gradient buckets launched as
  soon as their last microbatch's gradients are accumulated, while the schedule runs on
  (runtime/reducer.py), against the sync after the schedule
  (`AUTOHYBRID_DISABLE_PASSES=overlap` at compile time).

Profiling costs time of its own (both sides of a row pay it). Four processes on a 2-core
machine time the scheduler as much as the runtime: compare within a row.

    PYTHONPATH=. python benchmarks/overlap.py [--steps 8]
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.nn.functional as F

import autohybrid as ah
from autohybrid.runtime.profile import profile_steps

CONFIG = dict(layers=4, hidden=128, heads=4, vocab=1024, seq=64)
BATCH = 16
WORLD = 4


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(count: int):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, CONFIG["vocab"], (BATCH, CONFIG["seq"]), generator=g),
             torch.randint(0, CONFIG["vocab"], (BATCH, CONFIG["seq"]), generator=g))
            for _ in range(count)]


def _cluster(nodes: int) -> ah.Cluster:
    """This machine's 4 processes as one node, or as `nodes` nodes of the CPU preset (one
    NIC per node): the plan places ranks node-major, so ranks 0–1 are node 0."""
    if nodes == 1:
        return ah.Cluster.local(WORLD)
    return ah.Cluster.preset("cpu", nodes=nodes, devices_per_node=WORLD // nodes)


#: row name, nodes, {side: (constraints, passes disabled at compile)}
ROWS = [
    ("dp4 bucketing", 1, {
        "on": (ah.Constraints(dp=4, tp=1, pp=1, zero=0, num_microbatches=1, bucket_mb=1), ""),
        "off": (ah.Constraints(dp=4, tp=1, pp=1, zero=0, num_microbatches=1,
                               bucket_mb=1000), "")}),
    ("dp4 zero3 prefetch", 1, {
        "on": (ah.Constraints(dp=4, tp=1, pp=1, zero=3, num_microbatches=1), ""),
        "off": (ah.Constraints(dp=4, tp=1, pp=1, zero=3, num_microbatches=1), "overlap")}),
    ("dp4 hierarchical (2 nodes)", 2, {
        "hierarchical": (ah.Constraints(dp=4, tp=1, pp=1, zero=0, num_microbatches=1,
                                        collective_algorithm="hierarchical"), ""),
        "segmented": (ah.Constraints(dp=4, tp=1, pp=1, zero=0, num_microbatches=1,
                                     collective_algorithm="segmented"), ""),
        "flat": (ah.Constraints(dp=4, tp=1, pp=1, zero=0, num_microbatches=1,
                                collective_algorithm="flat"), "")}),
    ("dp2 x tp2+sp", 1, {
        "coll. matmul": (ah.Constraints(dp=2, tp=2, pp=1, sp=True, zero=0, num_microbatches=1,
                                        collective_matmul=True), ""),
        "async only": (ah.Constraints(dp=2, tp=2, pp=1, sp=True, zero=0, num_microbatches=1,
                                      collective_matmul=False), ""),
        "off": (ah.Constraints(dp=2, tp=2, pp=1, sp=True, zero=0, num_microbatches=1,
                               collective_matmul=False), "overlap")}),
    ("pp2 x dp2 1f1b", 1, {
        "on": (ah.Constraints(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=4), ""),
        "off": (ah.Constraints(dp=2, tp=1, pp=2, schedule="1f1b", num_microbatches=4),
                "overlap")}),
]


def run_rank(rank: int, world: int, nodes: int, sides: dict, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    data = _batches(steps + warmup)
    out = {}
    for side, (constraints, disabled) in sides.items():
        os.environ["AUTOHYBRID_DISABLE_PASSES"] = disabled
        torch.manual_seed(0)
        compiled = ah.compile(ah.models.gpt(**CONFIG), _cluster(nodes), (data[0][0],),
                              loss_fn=loss_fn, example_targets=data[0][1],
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                              constraints=constraints)
        os.environ["AUTOHYBRID_DISABLE_PASSES"] = ""
        timeline = profile_steps(compiled, data[warmup:], steps, warmup=warmup)
        per_step: dict[int, list] = {}
        for s in timeline.summaries():
            per_step.setdefault(s.step, []).append(s)
        p = compiled.plan.predicted
        out[side] = {
            "step_ms": statistics.median(max(s.step_time_s for s in ss)
                                         for ss in per_step.values()) * 1e3,
            "exposed_ms": statistics.median(max(s.exposed_comm_s for s in ss)
                                            for ss in per_step.values()) * 1e3,
            "comm_ms": statistics.median(max(s.comm_s for s in ss)
                                         for ss in per_step.values()) * 1e3,
            "pred_step_ms": p.step_time_s * 1e3, "pred_exposed_ms": p.exposed_comm_s * 1e3,
            "plan": f"{compiled.plan.summary()} {compiled.plan.collective_algorithm}",
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rows", nargs="+", default=[name for name, _, _ in ROWS])
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; "
          f"gpt {CONFIG}, batch {BATCH}, {WORLD} processes; median of {args.steps} profiled "
          f"steps after {args.warmup} warm-up", flush=True)
    print(f"{'plan':>28} {'mechanism':>13} {'step ms':>8} {'exposed ms':>11} {'comm ms':>8} "
          f"{'pred step':>10} {'pred exposed':>13}")
    for name, nodes, sides in ROWS:
        if name not in args.rows:
            continue
        results = ah.launch(run_rank, WORLD, args=(WORLD, nodes, sides, args.steps,
                                                   args.warmup))
        r0 = results[0]
        for side, r in r0.items():
            print(f"{name:>28} {side:>13} {r['step_ms']:>8.1f} {r['exposed_ms']:>11.1f} "
                  f"{r['comm_ms']:>8.1f} {r['pred_step_ms']:>10.1f} "
                  f"{r['pred_exposed_ms']:>13.1f}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
