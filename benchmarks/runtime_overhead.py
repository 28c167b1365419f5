"""autohybrid's tensor- and pipeline-parallel step times against DTensor's
`parallelize_module` and a hand-written torch.distributed.pipelining run.

    python benchmarks/runtime_overhead.py [--steps 20] [--warmup 2] [--world 2]

In one `ah.launch` on `ah.Cluster.local(world)` (gloo, fp32, one thread per rank), for
each GPT size, three copies of the same model (same seed) train on the same global
batches with the same SGD optimizer:

- autohybrid: `ah.compile(..., constraints=ah.Constraints(tp=world, sp=False))`, then
  `compiled.train_step(tokens, targets)`;
- DTensor: `parallelize_module` on a 1-D device mesh of the same ranks with Megatron's
  layout, as close to autohybrid's as DTensor expresses it (see `parallelize_dtensor`):
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
  `schedule.step(...)` and SGD over the stage's parameters (see `HandPipeline`).

Both run the same stages on the same microbatches, so the ratio is the runtime's own
overhead; a barrier before each pp step keeps the ranks' step times aligned.

autohybrid and DTensor steps alternate (after a warm-up, autohybrid's first step captures
its training graph), so drift in the machine's speed hits both alike. A step's time is
the slowest rank's; the table gives medians, the ratio autohybrid / DTensor of the medians
(goal ≤ 1.0, first bar ≤ 1.10), the median of the per-step ratios (paired: adjacent steps,
robust to load from other processes on a shared machine) and the largest loss difference
between the two over all steps (equal work: the layouts are equivalent, so the losses
agree to fp32 rounding). A benchmark, not a CI gate; ranks beyond the core count (e.g.
--world 4 on 2 cores) time the scheduler more than the runtime.
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
from pipeline_balance import (HandPipeline, batches, build,  # the same model and data,
                              equal_boundaries)  # and pipeline() as users write it

#: name, gpt kwargs, global batch
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


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


# ------------------------------------------------------------------ DTensor side
def _qkv_rows_by_rank(hidden: int, tp: int) -> torch.Tensor:
    """Row order of a fused qkv weight whose contiguous Shard(0) chunk r holds q, k, v of
    rank r's heads — autohybrid's ShardSpec(chunks=3) layout. ColwiseParallel shards the
    fused rows contiguously, which would give rank 0 all of q and half of k."""
    part = hidden // tp
    order = [c * hidden + r * part + i for r in range(tp) for c in range(3) for i in range(part)]
    return torch.tensor(order)


def parallelize_dtensor(model: torch.nn.Module, mesh) -> None:
    """Megatron tp with DTensor; the math equals the unsplit model's.

    - attn.qkv, mlp.fc: ColwiseParallel (weight and bias Shard(0), input Replicate, local
      output). The fused qkv rows are first permuted so that rank r's contiguous shard is
      [q_r, k_r, v_r] (a re-parametrization: same function, and SGD commutes with it);
      each attention then sees its local heads (heads //= tp, hidden //= tp, as
      torchtitan does), so the model's view (b, t, 3, heads, head_dim) stays unchanged.
    - attn.proj, mlp.proj: RowwiseParallel (weight Shard(1), bias Replicate, all-reduce
      of the partial output, local output).
    - tok_emb: RowwiseParallel(input_layouts=Replicate()) — weight Shard(0) over the
      vocabulary (masked lookup, all-reduce): the vocabulary-parallel embedding.
    - lm_head: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) — weight
      Shard(0) over the vocabulary, logits split over the vocabulary for
      `loss_parallel()`'s cross-entropy (never gathered). The head is tied to tok_emb:
      parallelize_module gives each module a new DTensor parameter, so the tie is
      restored afterwards (both are Shard(0) on the same mesh, the same local shard).
    - pos_emb, LayerNorms: replicated plain tensors (as autohybrid keeps them).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    tp = mesh.size()
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            order = _qkv_rows_by_rank(attn.hidden, tp)
            attn.qkv.weight.copy_(attn.qkv.weight[order])
            attn.qkv.bias.copy_(attn.qkv.bias[order])
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(),
                     f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(),
                     f"blocks.{i}.mlp.proj": RowwiseParallel()})
        block.attn.heads //= tp
        block.attn.hidden //= tp
    parallelize_module(model, mesh, plan)
    model.lm_head.weight = model.tok_emb.weight  # re-tie


def dtensor_step(model, optimizer, tokens, targets) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel

    optimizer.zero_grad(set_to_none=True)
    logits = model(tokens)
    with loss_parallel():
        loss = loss_fn(logits, targets)
        loss.backward()
    optimizer.step()
    return loss.to_local().detach()


def eager_step(model, optimizer, tokens, targets) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


# ------------------------------------------------------------------ one rank
def _timed(fn, *args) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    loss = fn(*args)
    return time.perf_counter() - start, loss


def _eager_run(config: dict, data) -> tuple[list[float], list[float]]:
    """Step times and losses of the same model trained eagerly in one process."""
    model = build(config)
    opt = sgd(model.parameters())
    times, losses = [], []
    for tokens, targets in data:
        t, loss = _timed(eager_step, model, opt, tokens, targets)
        times.append(t)
        losses.append(float(loss))
    return times, losses


def run_rank(rank: int, world: int, config: dict, batch: int, steps: int, warmup: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    data = batches(config, batch, warmup + steps)
    tokens0, targets0 = data[0]

    compiled = ah.compile(build(config), ah.Cluster.local(world), (tokens0,), loss_fn=loss_fn,
                          example_targets=targets0, optimizer=sgd,
                          constraints=ah.Constraints(tp=world, sp=False))
    dt_model = build(config)
    parallelize_dtensor(dt_model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    dt_opt = sgd(dt_model.parameters())

    ah_times, dt_times, ah_losses, dt_losses = [], [], [], []
    for tokens, targets in data:  # warm-up first (autohybrid captures its train graph)
        t, loss = _timed(compiled.train_step, tokens, targets)
        ah_times.append(t)
        ah_losses.append(float(loss))
        t, loss = _timed(dtensor_step, dt_model, dt_opt, tokens, targets)
        dt_times.append(t)
        dt_losses.append(float(loss))

    eager_times, eager_losses = _eager_run(config, data) if rank == 0 else ([], [])
    dist.barrier()
    shards = sorted(compiled.notes["train"]["param_shards"])
    return {"ah": ah_times[warmup:], "dt": dt_times[warmup:], "eager": eager_times[warmup:],
            "ah_loss": ah_losses, "dt_loss": dt_losses, "eager_loss": eager_losses,
            "ah_split": shards, "mesh": compiled.plan.mesh.describe()}


def run_pp_rank(rank: int, world: int, config: dict, batch: int, steps: int,
                warmup: int) -> dict:
    torch.set_num_threads(1)
    data = batches(config, batch, warmup + steps)
    tokens0, targets0 = data[0]
    m, boundaries = 2 * world, equal_boundaries(config["layers"], world)
    compiled = ah.compile(build(config), ah.Cluster.local(world), (tokens0,), loss_fn=loss_fn,
                          example_targets=targets0, optimizer=sgd,
                          constraints=ah.Constraints(pp=world, dp=1, tp=1, schedule="1f1b",
                                                     num_microbatches=m,
                                                     stage_boundaries=boundaries))
    hand = HandPipeline(build(config), boundaries, rank, world, m, tokens0, optimizer=sgd)

    ah_times, dt_times, ah_losses, dt_losses = [], [], [], []
    for tokens, targets in data:  # warm-up first (autohybrid captures its train graph)
        dist.barrier()
        t, loss = _timed(compiled.train_step, tokens, targets)
        ah_times.append(t)
        ah_losses.append(float(loss))
        dist.barrier()
        t, loss = _timed(hand.step, tokens, targets)
        dt_times.append(t)
        dt_losses.append(float(loss))

    eager_times, eager_losses = _eager_run(config, data) if rank == 0 else ([], [])
    dist.barrier()
    plan = compiled.plan
    return {"ah": ah_times[warmup:], "dt": dt_times[warmup:], "eager": eager_times[warmup:],
            "ah_loss": ah_losses, "dt_loss": dt_losses, "eager_loss": eager_losses,
            "boundaries": plan.stage_boundaries,
            "mesh": f"{plan.mesh.describe()} {plan.schedule} m={plan.num_microbatches}"}


def _slowest_rank(results: list[dict], key: str) -> list[float]:
    """Per timed step, the slowest rank's time (the step ends when every rank's ends)."""
    return [max(r[key][i] for r in results) for i in range(len(results[0][key]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world", type=int, default=2,
                        help="tp degree = pp degree = ranks (2 or 4)")
    args = parser.parse_args()

    rows = []
    for name, config, batch in CONFIGS:
        results = ah.launch(run_rank, ah.Cluster.local(args.world),
                            args=(args.world, config, batch, args.steps, args.warmup))
        r0 = results[0]
        ah_s, dt_s = _slowest_rank(results, "ah"), _slowest_rank(results, "dt")
        ah_ms, dt_ms = statistics.median(ah_s) * 1e3, statistics.median(dt_s) * 1e3
        paired = statistics.median(a / d for a, d in zip(ah_s, dt_s))
        spread = (min(ah_s) * 1e3, max(ah_s) * 1e3, min(dt_s) * 1e3, max(dt_s) * 1e3)
        eager_ms = statistics.median(r0["eager"]) * 1e3
        diff = max(abs(a - d) for a, d in zip(r0["ah_loss"], r0["dt_loss"]))
        rows.append((name, f"tp{args.world} vs DTensor", ah_ms, dt_ms, paired, eager_ms, diff))
        split = r0["ah_split"]
        outside = [p for p in split if not p.startswith("blocks.")]
        block0 = [p[len("blocks.0."):] for p in split if p.startswith("blocks.0.")]
        print(f"{name}: autohybrid plan {r0['mesh']}, {len(split)} split parameters: "
              f"{', '.join(outside)}; per block {', '.join(block0)}")
        print(f"  step-0 loss: autohybrid {r0['ah_loss'][0]:.7f}  DTensor "
              f"{r0['dt_loss'][0]:.7f}  eager {r0['eager_loss'][0]:.7f}; "
              f"last: {r0['ah_loss'][-1]:.7f} / {r0['dt_loss'][-1]:.7f} / "
              f"{r0['eager_loss'][-1]:.7f}; max |autohybrid − DTensor| over "
              f"{len(r0['ah_loss'])} steps {diff:.1e}")
        print(f"  step ms min–max: autohybrid {spread[0]:.1f}–{spread[1]:.1f}, DTensor "
              f"{spread[2]:.1f}–{spread[3]:.1f}; load average {os.getloadavg()[0]:.1f}",
              flush=True)

    for name, config, batch in PP_CONFIGS:
        results = ah.launch(run_pp_rank, ah.Cluster.local(args.world),
                            args=(args.world, config, batch, args.steps, args.warmup))
        r0, rl = results[0], results[-1]  # the last stage's rank holds pipeline()'s loss
        ah_s, dt_s = _slowest_rank(results, "ah"), _slowest_rank(results, "dt")
        ah_ms, dt_ms = statistics.median(ah_s) * 1e3, statistics.median(dt_s) * 1e3
        paired = statistics.median(a / d for a, d in zip(ah_s, dt_s))
        eager_ms = statistics.median(r0["eager"]) * 1e3
        diff = max(abs(a - d) for a, d in zip(rl["ah_loss"], rl["dt_loss"]))
        layout = f"pp{args.world} 1f1b vs pipeline()"
        rows.append((name, layout, ah_ms, dt_ms, paired, eager_ms, diff))
        print(f"{name}: autohybrid plan {r0['mesh']}, stage boundaries pinned to pipeline()'s "
              f"split {list(r0['boundaries'])}")
        print(f"  step-0 loss: autohybrid {rl['ah_loss'][0]:.7f}  pipeline() "
              f"{rl['dt_loss'][0]:.7f}  eager {r0['eager_loss'][0]:.7f}; "
              f"last: {rl['ah_loss'][-1]:.7f} / {rl['dt_loss'][-1]:.7f} / "
              f"{r0['eager_loss'][-1]:.7f}; max |autohybrid − pipeline()| over "
              f"{len(rl['ah_loss'])} steps {diff:.1e}")
        print(f"  step ms min–max: autohybrid {min(ah_s) * 1e3:.1f}–{max(ah_s) * 1e3:.1f}, "
              f"pipeline() {min(dt_s) * 1e3:.1f}–{max(dt_s) * 1e3:.1f}; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)

    print(f"\nmedian of {args.steps} steps after {args.warmup} warm-up, slowest rank per step; "
          f"ratio = autohybrid / baseline (DTensor or hand-written pipeline()) medians (goal "
          f"<= 1.0, first bar <= 1.10); paired = median of per-step ratios; eager: one "
          f"process, one thread")
    print(f"{'model':>27} {'layout':>24} {'ranks':>5} {'autohybrid ms':>14} "
          f"{'baseline ms':>12} {'ratio':>6} {'paired':>7} {'eager 1-proc ms':>16} "
          f"{'loss diff':>10}")
    for name, layout, ah_ms, dt_ms, paired, eager_ms, diff in rows:
        print(f"{name:>27} {layout:>24} {args.world:>5} {ah_ms:>14.1f} {dt_ms:>12.1f} "
              f"{ah_ms / dt_ms:>6.2f} {paired:>7.2f} {eager_ms:>16.1f} {diff:>10.1e}")


if __name__ == "__main__":
    main()
