"""autohybrid's tensor-, pipeline- and data-parallel (ZeRO 0–3) step times against
DTensor's `parallelize_module`, a hand-written torch.distributed.pipelining run, DDP,
DDP with ZeroRedundancyOptimizer and FSDP2.

    python benchmarks/runtime_overhead.py [--steps 20] [--warmup 2] [--world 2]
                                          [--layouts tp pp dp]

In one `ah.launch` on `ah.Cluster.local(world)` (gloo, fp32, one thread per rank), for
each GPT size, three copies of the same model (same seed) train on the same global
batches with the same SGD optimizer:

- autohybrid: `ah.compile(..., constraints=ah.Constraints(tp=world, sp=False))`, then
  `compiled.train_step(tokens, targets)`;
- DTensor: `parallelize_module` on a 1-D device mesh of the same ranks with Megatron's
  layout, as close to autohybrid's as DTensor expresses it (`parallelize_dtensor` in
  autohybrid/baselines.py):
  ColwiseParallel for `attn.qkv` and `mlp.fc`, RowwiseParallel for `attn.proj` and
  `mlp.proj`, a vocabulary-parallel tied embedding (RowwiseParallel with replicated
  input ids) and LM head (ColwiseParallel with Shard(-1) logits) with `loss_parallel()`;
- eager: the whole model in one process (rank 0 while the others wait), for context.

The pp layout (`PP_CONFIGS`, GPT with an untied head: pipeline() does not tie weights
across stages) compares the same way, on pp = world ranks, schedule 1F1B with 2·pp
microbatches:

- autohybrid: `ah.Constraints(pp=world, dp=1, tp=1, schedule="1f1b", num_microbatches=m,
  stage_boundaries=equal)`, the stage boundaries pinned to the hand-written split;
- pipeline(): hand-written torch.distributed.pipelining, `pipeline(model, mb_args=...,
  split_spec={"blocks.K": SplitPoint.BEGINNING})` with equal runs of blocks,
  `pipe.build_stage(rank, device)`, `Schedule1F1B(stage, m, loss_fn=...)`,
  `schedule.step(...)` and SGD over the stage's parameters (see `HandPipeline` in
  autohybrid/baselines.py).

Both run the same stages on the same microbatches, so the ratio is the runtime's own
overhead; a barrier before each pp step keeps the ranks' step times aligned.

The dp layout (the `CONFIGS` models, tied head) trains on dp = world ranks with AdamW,
one microbatch per rank per step (DDP's unit of work), 25 MB buckets on both sides; each
autohybrid ZeRO stage, `ah.Constraints(dp=world, tp=1, pp=1, zero=k,
num_microbatches=1, bucket_mb=25)`, against torch's counterpart (`torch_dp` in
autohybrid/baselines.py):

    zero 0   DDP                                        all-reduce of gradient buckets
    zero 1   DDP + ZeroRedundancyOptimizer(AdamW)       torch's ZeRO-1: optimizer state
                                                        of 1/dp of the parameters
    zero 2   FSDP2 fully_shard per block and root,      parameters gathered per block,
             reshard_after_forward=False                kept until backward ends (ZeRO-2,
                                                        FSDP's SHARD_GRAD_OP)
    zero 3   FSDP2 fully_shard per block and root,      resharded after forward (blocks),
             reshard_after_forward default               gathered again in backward (ZeRO-3)

FSDP2 runs on CPU with gloo in torch 2.13 (all-gather and reduce-scatter of flat tensors).
The baselines' step includes an all-reduce of the loss, as autohybrid's train_step
returns the global batch's loss on every rank. All eight alternate step by step with a
barrier before each, so each pair sees the same machine.

autohybrid and DTensor steps alternate (after a warm-up, autohybrid's first step captures
its training graph), so drift in the machine's speed hits both alike. A step's time is
the slowest rank's; the table gives medians, the ratio autohybrid / DTensor of the medians
(goal ≤ 1.0, first bar ≤ 1.10), the median of the per-step ratios (paired: adjacent steps,
robust to load from other processes on a shared machine), `busiest CPU`: the largest CPU
time (process_time, all threads) of any rank per step, autohybrid / baseline medians (the
work done, which other jobs' load does not inflate; waits excluded), and the largest loss
difference between the two over all steps (equal work: the layouts are equivalent, so
the losses agree to fp32 rounding). A benchmark, not a CI gate; ranks beyond the core
count (e.g. --world 4 on 2 cores) time the scheduler more than the runtime.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autohybrid as ah
from autohybrid.baselines import (DP_BASELINES, BUCKET_MB, DTensorTP,  # torch's own layouts
                                  HandPipeline, Optim, TorchDataParallel, equal_boundaries)
from pipeline_balance import batches, build  # the same model and data

#: name, gpt kwargs, global batch (the tp and dp layouts)
CONFIGS = [
    ("gpt h128 l4 s64 b16", dict(layers=4, hidden=128, heads=4, vocab=1024, seq=64), 16),
    ("gpt h256 l4 s128 b8", dict(layers=4, hidden=256, heads=8, vocab=2048, seq=128), 8),
]
#: pp layout: name, gpt kwargs, global batch
PP_CONFIGS = [
    ("gpt h128 l4 s64 b16 untied",
     dict(layers=4, hidden=128, heads=4, vocab=1024, seq=64, tie_embeddings=False), 16),
]
LR = 0.05
ADAMW_LR = 1e-3
LAYOUTS = ("tp", "pp", "dp")
SGD = Optim(torch.optim.SGD, {"lr": LR})
ADAMW = Optim(torch.optim.AdamW, {"lr": ADAMW_LR})


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------ eager
# (the baselines live in autohybrid/baselines.py (DTensorTP: parallelize_module with Megatron's
# layout; TorchDataParallel: DDP / DDP + ZeroRedundancyOptimizer / FSDP2 per ZeRO stage;
# HandPipeline: pipeline() + Schedule1F1B), where `ah.bench` uses them too)
def eager_step(model, optimizer, tokens, targets) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


# ------------------------------------------------------------------ one rank
def _alternate(steps_of: dict, data, barrier: bool) -> dict[str, dict[str, list[float]]]:
    """Every step function on every batch in turn; per function its step times, CPU
    times (process_time: this rank's threads) and losses."""
    out = {key: {"time": [], "cpu": [], "loss": []} for key in steps_of}
    for tokens, targets in data:
        for key, step in steps_of.items():
            if barrier:
                dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = step(tokens, targets)
            out[key]["time"].append(time.perf_counter() - start)
            out[key]["cpu"].append(time.process_time() - start_cpu)
            out[key]["loss"].append(float(loss))
    return out


def _pair(runs: dict, ah_key: str, dt_key: str, warmup: int) -> dict:
    """autohybrid's and the baseline's timed steps (after warm-up) and all their losses."""
    ah_run, dt_run = runs[ah_key], runs[dt_key]
    return {"ah": ah_run["time"][warmup:], "dt": dt_run["time"][warmup:],
            "ah_cpu": ah_run["cpu"][warmup:], "dt_cpu": dt_run["cpu"][warmup:],
            "ah_loss": ah_run["loss"], "dt_loss": dt_run["loss"]}


def _eager_run(config: dict, data, optimizer=SGD) -> tuple[list[float], list[float]]:
    """Step times and losses of the same model trained eagerly in one process."""
    model = build(config)
    opt = optimizer(model.parameters())
    times, losses = [], []
    for tokens, targets in data:
        start = time.perf_counter()
        losses.append(float(eager_step(model, opt, tokens, targets)))
        times.append(time.perf_counter() - start)
    return times, losses


def _with_eager(rank: int, out: dict, config: dict, data, warmup: int, optimizer=SGD) -> dict:
    times, losses = _eager_run(config, data, optimizer) if rank == 0 else ([], [])
    dist.barrier()
    return {**out, "eager": times[warmup:], "eager_loss": losses}


def run_rank(rank: int, world: int, config: dict, batch: int, steps: int, warmup: int) -> dict:
    data = batches(config, batch, warmup + steps)
    tokens0, targets0 = data[0]

    compiled = ah.compile(build(config), ah.Cluster.local(world), (tokens0,), loss_fn=loss_fn,
                          example_targets=targets0, optimizer=SGD,
                          constraints=ah.Constraints(tp=world, sp=False))
    dtensor = DTensorTP(build(config), loss_fn, SGD)
    # warm-up first (autohybrid captures its train graph)
    runs = _alternate({"ah": compiled.train_step, "dt": dtensor.step}, data, False)
    out = {**_pair(runs, "ah", "dt", warmup),
           "ah_split": sorted(compiled.programs["train"].param_shards),
           "mesh": compiled.plan.mesh.describe()}
    return _with_eager(rank, out, config, data, warmup)


def run_pp_rank(rank: int, world: int, config: dict, batch: int, steps: int,
                warmup: int) -> dict:
    torch.set_num_threads(1)
    data = batches(config, batch, warmup + steps)
    tokens0, targets0 = data[0]
    m, boundaries = 2 * world, equal_boundaries(config["layers"], world)
    compiled = ah.compile(build(config), ah.Cluster.local(world), (tokens0,), loss_fn=loss_fn,
                          example_targets=targets0, optimizer=SGD,
                          constraints=ah.Constraints(pp=world, dp=1, tp=1, schedule="1f1b",
                                                     num_microbatches=m,
                                                     stage_boundaries=boundaries))
    hand = HandPipeline(build(config), boundaries, rank, world, m, tokens0, loss_fn, SGD)
    runs = _alternate({"ah": compiled.train_step, "dt": hand.step}, data, True)
    plan = compiled.plan
    out = {**_pair(runs, "ah", "dt", warmup), "boundaries": plan.stage_boundaries,
           "mesh": f"{plan.mesh.describe()} {plan.schedule} m={plan.num_microbatches}"}
    return _with_eager(rank, out, config, data, warmup)


def run_dp_rank(rank: int, world: int, config: dict, batch: int, steps: int, warmup: int,
                stages: tuple[int, ...] = (0, 1, 2, 3)) -> dict:
    """Per ZeRO stage, autohybrid at dp = world against torch's counterpart (AdamW)."""
    torch.set_num_threads(1)
    data = batches(config, batch, warmup + steps)
    tokens0, targets0 = data[0]
    steps_of, plans = {}, {}
    for stage in stages:
        compiled = ah.compile(
            build(config), ah.Cluster.local(world), (tokens0,), loss_fn=loss_fn,
            example_targets=targets0, optimizer=ADAMW,
            constraints=ah.Constraints(dp=world, tp=1, pp=1, zero=stage, num_microbatches=1,
                                       bucket_mb=BUCKET_MB))
        plans[stage] = compiled.plan.summary()
        steps_of[f"ah{stage}"] = compiled.train_step
        steps_of[f"dt{stage}"] = TorchDataParallel(stage, build(config), loss_fn, ADAMW,
                                                   bucket_mb=BUCKET_MB).step
    runs = _alternate(steps_of, data, True)
    out = {"stages": {s: _pair(runs, f"ah{s}", f"dt{s}", warmup) for s in stages},
           "plans": plans}
    return _with_eager(rank, out, config, data, warmup, ADAMW)


# ------------------------------------------------------------------ the table
def _slowest_rank(results: list[dict], key: str) -> list[float]:
    """Per timed step, the slowest rank's time (the step ends when every rank's ends)."""
    return [max(r[key][i] for r in results) for i in range(len(results[0][key]))]


def summarize(pairs: list[dict], losses: dict) -> dict:
    """Medians over the timed steps of one autohybrid/baseline pair (`pairs`: each
    rank's), the paired ratio, the busiest-CPU ratio, the losses' largest difference."""
    ah_s, dt_s = _slowest_rank(pairs, "ah"), _slowest_rank(pairs, "dt")
    ah_cpu, dt_cpu = _slowest_rank(pairs, "ah_cpu"), _slowest_rank(pairs, "dt_cpu")
    return {"ah_ms": statistics.median(ah_s) * 1e3, "dt_ms": statistics.median(dt_s) * 1e3,
            "paired": statistics.median(a / d for a, d in zip(ah_s, dt_s)),
            "cpu": statistics.median(ah_cpu) / statistics.median(dt_cpu),
            "spread": f"{min(ah_s) * 1e3:.1f}–{max(ah_s) * 1e3:.1f}",
            "dt_spread": f"{min(dt_s) * 1e3:.1f}–{max(dt_s) * 1e3:.1f}",
            "diff": max(abs(a - d) for a, d in zip(losses["ah_loss"], losses["dt_loss"]))}


def _losses_line(label: str, losses: dict, eager: list[float], diff: float) -> str:
    return (f"  step-0 loss: autohybrid {losses['ah_loss'][0]:.7f}  {label} "
            f"{losses['dt_loss'][0]:.7f}  eager {eager[0]:.7f}; last: "
            f"{losses['ah_loss'][-1]:.7f} / {losses['dt_loss'][-1]:.7f} / {eager[-1]:.7f}; "
            f"max |autohybrid − {label}| over {len(losses['ah_loss'])} steps {diff:.1e}")


def _spread_line(label: str, s: dict) -> str:
    return (f"  step ms min–max: autohybrid {s['spread']}, {label} {s['dt_spread']}; "
            f"load average {os.getloadavg()[0]:.1f}")


def tp_rows(world: int, steps: int, warmup: int) -> list[tuple]:
    rows = []
    for name, config, batch in CONFIGS:
        results = ah.launch(run_rank, ah.Cluster.local(world),
                            args=(world, config, batch, steps, warmup))
        r0 = results[0]
        s = summarize(results, r0)
        rows.append((name, f"tp{world} vs DTensor", s, statistics.median(r0["eager"]) * 1e3))
        split = r0["ah_split"]
        outside = [p for p in split if not p.startswith("blocks.")]
        block0 = [p[len("blocks.0."):] for p in split if p.startswith("blocks.0.")]
        print(f"{name}: autohybrid plan {r0['mesh']}, {len(split)} split parameters: "
              f"{', '.join(outside)}; per block {', '.join(block0)}")
        print(_losses_line("DTensor", r0, r0["eager_loss"], s["diff"]))
        print(_spread_line("DTensor", s), flush=True)
    return rows


def pp_rows(world: int, steps: int, warmup: int) -> list[tuple]:
    rows = []
    for name, config, batch in PP_CONFIGS:
        results = ah.launch(run_pp_rank, ah.Cluster.local(world),
                            args=(world, config, batch, steps, warmup))
        r0, rl = results[0], results[-1]  # the last stage's rank holds pipeline()'s loss
        s = summarize(results, rl)
        rows.append((name, f"pp{world} 1f1b vs pipeline()", s,
                     statistics.median(r0["eager"]) * 1e3))
        print(f"{name}: autohybrid plan {r0['mesh']}, stage boundaries pinned to pipeline()'s "
              f"split {list(r0['boundaries'])}")
        print(_losses_line("pipeline()", rl, r0["eager_loss"], s["diff"]))
        print(_spread_line("pipeline()", s), flush=True)
    return rows


def dp_rows(world: int, steps: int, warmup: int) -> list[tuple]:
    rows = []
    for name, config, batch in CONFIGS:
        results = ah.launch(run_dp_rank, ah.Cluster.local(world),
                            args=(world, config, batch, steps, warmup))
        r0 = results[0]
        eager_ms = statistics.median(r0["eager"]) * 1e3
        print(f"{name}, dp{world} AdamW: eager loss step 0 {r0['eager_loss'][0]:.7f}, "
              f"last {r0['eager_loss'][-1]:.7f}")
        for stage, pair in r0["stages"].items():
            label = DP_BASELINES[stage]
            s = summarize([r["stages"][stage] for r in results], pair)
            rows.append((name, f"dp{world} zero{stage} vs {label}", s, eager_ms))
            print(f" zero {stage}: autohybrid plan {r0['plans'][stage]}")
            print(_losses_line(label, pair, r0["eager_loss"], s["diff"]))
            print(_spread_line(label, s), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world", type=int, default=2,
                        help="tp degree = pp degree = dp degree = ranks (2 or 4)")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start",
          flush=True)

    make = {"tp": tp_rows, "pp": pp_rows, "dp": dp_rows}
    rows = [row for layout in args.layouts
            for row in make[layout](args.world, args.steps, args.warmup)]

    print(f"\nmedian of {args.steps} steps after {args.warmup} warm-up, slowest rank per step; "
          f"ratio = autohybrid / baseline medians (goal <= 1.0, first bar <= 1.10); paired = "
          f"median of per-step ratios; busiest CPU = busiest rank's CPU time per step, "
          f"autohybrid / baseline medians; eager: one process, one thread (SGD for tp/pp, "
          f"AdamW for dp); load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'model':>27} {'layout':>34} {'ranks':>5} {'autohybrid ms':>14} "
          f"{'baseline ms':>12} {'ratio':>6} {'paired':>7} {'busiest CPU':>12} "
          f"{'eager 1-proc ms':>16} {'loss diff':>10}")
    for name, layout, s, eager_ms in rows:
        print(f"{name:>27} {layout:>34} {args.world:>5} {s['ah_ms']:>14.1f} {s['dt_ms']:>12.1f} "
              f"{s['ah_ms'] / s['dt_ms']:>6.2f} {s['paired']:>7.2f} {s['cpu']:>12.2f} "
              f"{eager_ms:>16.1f} {s['diff']:>10.1e}")


if __name__ == "__main__":
    main()
