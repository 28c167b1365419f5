"""Predicted against measured step time on this machine, after calibration.

    python benchmarks/cost_model_accuracy.py [--steps 8] [--rounds 2] [--sections sizes plans]

Calibrates (matmul, element-wise, per-op overhead, all-reduce on 2 local ranks), then
compiles each row with `ah.compile` on local ranks (gloo, fp32, one thread per rank,
AdamW), trains warm-up + N steps and compares the measured step time with the plan's
prediction, `plan.predicted.step_time_s` priced with the calibration. Two sections:

- sizes: GPTs of growing size on 1 or 2 ranks, the planner's own plan for each;
- plans: one GPT (`PLAN_MODEL`) under pinned plans: 1 rank; dp2 with ZeRO 0, 1, 2 (two
  microbatches: ZeRO-2 reduce-scatters each one's gradients), 3; tp2 with and without
  sequence parallelism; pp2 1F1B; pp2 × dp2 1F1B on 4 ranks. Does the cost model order
  the plans of one model as they measure?

A row's measured step time is the median over its steps of the slowest rank's step (a
barrier before each step), pooled over `--rounds` rounds; each round starts the rows
afresh (`ah.launch` per ranks count, rows compiled one after another in it: two compiled
models with different meshes must not be alive in one process, their collectives look
process groups up by axis name), in the reverse order of the round before, so drift in
the machine's load hits the first and last rows alike. `busiest CPU`: the median of the
largest CPU time (process_time) of any rank per step — the work, which other jobs' load
does not inflate — shown for context.

Prints per row predicted/measured and, per section, Kendall's rank correlation τ between
predicted and measured. Goal: ratios within 0.75–1.25, τ ≥ 0.7. Rows marked `*` put more
ranks than the machine has cores (4 ranks on 2 cores): the cost model prices a device
per rank, so they are left out of τ and of the median error. A benchmark, not a CI gate.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autohybrid as ah
from _ranking import kendall_tau

C = ah.Constraints


@dataclass(frozen=True)
class Row:
    section: str
    name: str
    config: dict          # ah.models.gpt kwargs
    batch: int            # global batch
    ranks: int
    constraints: ah.Constraints | None = None   # None: the planner's choice


SIZES = [
    Row("sizes", "gpt h64 l2 b8", dict(layers=2, hidden=64, heads=4, vocab=256, seq=64), 8, 1),
    Row("sizes", "gpt h128 l2 b8", dict(layers=2, hidden=128, heads=4, vocab=256, seq=64), 8, 1),
    Row("sizes", "gpt h128 l4 b16", dict(layers=4, hidden=128, heads=4, vocab=512, seq=64), 16, 1),
    Row("sizes", "gpt h256 l4 b16", dict(layers=4, hidden=256, heads=8, vocab=512, seq=64), 16, 1),
    Row("sizes", "gpt h128 l4 b16 dp2", dict(layers=4, hidden=128, heads=4, vocab=512, seq=64),
        16, 2),
    Row("sizes", "gpt h256 l4 b32 dp2", dict(layers=4, hidden=256, heads=8, vocab=512, seq=64),
        32, 2),
    Row("sizes", "gpt h384 l6 b16 dp2", dict(layers=6, hidden=384, heads=8, vocab=1024, seq=64),
        16, 2),
]
PLAN_MODEL = dict(layers=4, hidden=256, heads=8, vocab=512, seq=64)
PLAN_BATCH = 16
#: name, ranks, constraints: the plans of one model
PLAN_SPECS = [
    ("1 rank", 1, C(dp=1, tp=1, pp=1)),
    ("dp2", 2, C(dp=2, tp=1, pp=1, zero=0)),
    ("dp2 zero1", 2, C(dp=2, tp=1, pp=1, zero=1)),
    ("dp2 zero2 m2", 2, C(dp=2, tp=1, pp=1, zero=2, num_microbatches=2)),
    ("dp2 zero3", 2, C(dp=2, tp=1, pp=1, zero=3)),
    ("tp2", 2, C(dp=1, tp=2, pp=1, sp=False)),
    ("tp2 sp", 2, C(dp=1, tp=2, pp=1, sp=True)),
    ("pp2 1f1b", 2, C(dp=1, tp=1, pp=2, schedule="1f1b")),
    ("pp2 dp2 1f1b", 4, C(dp=2, tp=1, pp=2, schedule="1f1b")),
]
PLANS = [Row("plans", name, PLAN_MODEL, PLAN_BATCH, ranks, c) for name, ranks, c in PLAN_SPECS]
SECTIONS = {"sizes": SIZES, "plans": PLANS}


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def run_row(row: Row, steps: int, profile: ah.Profile | None) -> dict:
    """This rank's step times of `row` (warm-up of 2 steps dropped) and its plan."""
    torch.manual_seed(0)
    model = ah.models.gpt(**row.config)
    (tokens,), targets = ah.models.example_batch(model, row.batch)
    cluster = ah.Cluster.local(row.ranks)
    plan = ah.plan(model, cluster, (tokens,), loss_fn=loss_fn, example_targets=targets,
                   executable_only=True, calibration=profile, dtype=torch.float32,
                   constraints=row.constraints)
    compiled = ah.compile(model, cluster, (tokens,), loss_fn=loss_fn, example_targets=targets,
                          plan=plan, optimizer=adamw)
    times, cpu = [], []
    for _ in range(steps + 2):
        if dist.is_initialized():
            dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        compiled.train_step(tokens, targets)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return {"times": times[2:], "cpu": cpu[2:],
            "predicted": plan.predicted.step_time_s, "plan": plan.summary().split(" | ")[0]}


def run_rows(rank: int, rows: list[Row], steps: int, profile: ah.Profile | None) -> list[dict]:
    """Every row in turn on this rank (one compiled model alive at a time)."""
    return [run_row(row, steps, profile) for row in rows]


def measure(rows: list[Row], steps: int, rounds: int, profile: ah.Profile | None) -> list[dict]:
    """Per row: the pooled slowest-rank step times and CPU times over `rounds` rounds."""
    results: list[dict] = [{"times": [], "cpu": []} for _ in rows]
    for r in range(rounds):
        order = list(range(len(rows)))[::(-1 if r % 2 else 1)]
        worlds = list(dict.fromkeys(rows[i].ranks for i in order))
        for world in worlds:
            indices = [i for i in order if rows[i].ranks == world]
            per_rank = ah.launch(run_rows, ah.Cluster.local(world),
                                 args=([rows[i] for i in indices], steps, profile))
            for k, i in enumerate(indices):
                ranks = [p[k] for p in per_rank]
                results[i]["times"] += [max(t) for t in zip(*(x["times"] for x in ranks))]
                results[i]["cpu"] += [max(t) for t in zip(*(x["cpu"] for x in ranks))]
                results[i].update(predicted=ranks[0]["predicted"], plan=ranks[0]["plan"])
    return results


def oversubscribed(row: Row) -> bool:
    return row.ranks > (os.cpu_count() or 1)


def report(section: str, rows: list[Row], results: list[dict]) -> None:
    print(f"\n{section}: load average {os.getloadavg()[0]:.1f}")
    print(f"{'config':>22} {'ranks':>5} {'plan':>46} {'predicted ms':>13} {'measured ms':>12} "
          f"{'pred/meas':>10} {'busiest CPU ms':>15}")
    predicted, measured = [], []
    for row, res in zip(rows, results):
        pred, meas = res["predicted"], statistics.median(res["times"])
        cpu = statistics.median(res["cpu"])
        mark = "*" if oversubscribed(row) else " "
        print(f"{row.name:>22} {row.ranks:>4}{mark} {res['plan']:>46} {pred * 1e3:>13.2f} "
              f"{meas * 1e3:>12.2f} {pred / meas:>10.2f} {cpu * 1e3:>15.2f}")
        if not oversubscribed(row):
            predicted.append(pred)
            measured.append(meas)
    by_pred = sorted(range(len(predicted)), key=predicted.__getitem__)
    by_meas = sorted(range(len(measured)), key=measured.__getitem__)
    names = [r.name for r in rows if not oversubscribed(r)]
    print(f"predicted range {max(predicted) / min(predicted):.1f}×; median |error| "
          f"{statistics.median(abs(p / m - 1) for p, m in zip(predicted, measured)):.0%}; "
          f"Kendall τ {kendall_tau(predicted, measured):.2f} over {len(predicted)} rows"
          + (" (* left out)" if len(predicted) < len(rows) else ""))
    print(f"  fastest → slowest, predicted: {', '.join(names[i] for i in by_pred)}")
    print(f"  fastest → slowest, measured:  {', '.join(names[i] for i in by_meas)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS),
                        default=list(SECTIONS))
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    profile = ah.calibrate(ah.Cluster.local(2))
    print(f"calibration {profile.hash()}: matmul {profile.matmul_flops['float32'] / 1e9:.1f} "
          f"GFLOP/s, element-wise {profile.memory_bandwidth / 1e9:.1f} GB/s, all-reduce α "
          f"{(profile.all_reduce_latency_s or 0) * 1e6:.0f} µs, launch overhead "
          f"{(profile.launch_overhead_s or 0) * 1e6:.1f} µs/op", flush=True)
    for section in args.sections:
        rows = SECTIONS[section]
        results = measure(rows, args.steps, args.rounds, profile)
        report(section, rows, results)
    print(f"\nmeasured = median over {args.rounds} rounds × {args.steps} steps (after 2 "
          f"warm-up) of the slowest rank's step; load average {os.getloadavg()[0]:.1f} "
          f"at the end")


if __name__ == "__main__":
    main()
