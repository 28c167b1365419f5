"""Pipeline step time with autohybrid's cost-balanced stage split against pipeline()'s
equal split of the blocks, on a GPT whose embedding and output layer outweigh a block.

    python benchmarks/pipeline_balance.py [--steps 10] [--warmup 2] [--pp 2 4] [--quick]

The model: GPT, 8 blocks, hidden 256, 8 heads, vocabulary 32000, sequence 64, untied
output layer, global batch 8, fp32. Both ends are heavy: the embedding holds 8.2M
parameters against a block's 0.8M, and the LM head with its cross-entropy over 32000
classes costs as much time as about 10 blocks (measured below), the embedding's forward
and backward about 1.3 blocks.

For each pp, in one `ah.launch` on `ah.Cluster.local(pp)` (gloo, one thread per rank),
three copies of the same model (same seed) train on the same batches with the same SGD,
schedule 1F1B with 2·pp microbatches:

- autohybrid: `ah.compile(..., constraints=ah.Constraints(pp=pp, dp=1, tp=1,
  schedule="1f1b", num_microbatches=2·pp))`; the planner chooses the stage boundaries
  (its cost-balanced split), then `compiled.train_step(tokens, targets)`;
- pipeline() equal (the baseline): hand-written torch.distributed.pipelining, the way
  users split a model with `pipeline()`: `split_spec={"blocks.K": SplitPoint.BEGINNING}`
  cutting the blocks into pp equal runs (embedding in the first, head in the last stage),
  `pipe.build_stage(rank, device)`, `Schedule1F1B(stage, m, loss_fn=...)`,
  `schedule.step(...)` and the optimizer's step over the stage's parameters;
- pipeline() at autohybrid's split, for context: the same hand-written code with the
  planner's boundaries as split points. It separates the split's effect (pipeline()
  equal vs this) from autohybrid's runtime (this vs autohybrid).

The three alternate step by step (after a warm-up in which autohybrid captures its
training graph), so drift in the machine's speed hits all alike. A step's time is the
slowest rank's; the table gives medians, the ratio autohybrid / pipeline() equal (goal
≤ 0.90) and the predicted ratio: autohybrid's cost model pricing its plan against the
same plan with `stage_boundaries` pinned to the equal split (`ah.plan(...,
constraints=ah.Constraints(..., stage_boundaries=equal)).predicted.step_time_s`). The
losses of the three agree to fp32 rounding (equal work).

Then, per split, each stage's forward + backward on one microbatch (CPU time, fastest
of 7), timed in this process alone (one thread, the stages of `pipeline()`'s split run one after another):
whether the planned split is balanced in measured time, not only in the cost model.
`stage bound` = the slowest stage of the balanced split / that of the equal split, the
ratio a 1F1B step approaches when every rank has a core of its own.

`busiest CPU`: per step, the largest CPU time (process_time) of any rank, autohybrid /
pipeline() equal: the critical rank's work, which other jobs' load does not inflate.

This machine has 2 cores: at pp = 4 four ranks share them (oversubscribed), so a step
is bounded by the total work over 2 cores more than by the slowest stage, and the
measured pp = 4 ratio says little about balance. The VM is shared with other jobs and
Linux's autogroup scheduler gives each session (all ranks of this launch together) a
fair share of the 2 cores: with other sessions busy, the ranks get less than one core
between them, a step then takes about the total work of all ranks over that share
(both splits do the same total work), and the wall-clock ratio tends to 1 whatever the
split. The load average is printed; read the wall-clock ratio together with
`busiest CPU` and `stage bound`. A benchmark, not a CI gate. `--quick`: a small model at pp 2,
2 steps (a smoke test, figures meaningless).
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

CONFIG = dict(layers=8, hidden=256, heads=8, vocab=32000, seq=64, tie_embeddings=False)
BATCH = 8
QUICK_CONFIG = dict(layers=4, hidden=32, heads=2, vocab=2048, seq=16, tie_embeddings=False)
QUICK_BATCH = 8
LR = 0.01


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def build(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return ah.models.gpt(**config)


def batches(config: dict, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(count):
        ids = torch.randint(0, config["vocab"], (batch, config["seq"] + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def equal_boundaries(layers: int, pp: int) -> tuple[str, ...]:
    """pipeline()'s usual split: pp equal runs of blocks (layers % pp == 0 here)."""
    return tuple(f"model.blocks.{k * layers // pp}" for k in range(1, pp))


def split_spec(boundaries: tuple[str, ...]) -> dict:
    """autohybrid's layer names ('model.blocks.4', 'model.lm_head') as pipeline() split
    points (the module's own names: 'blocks.4', 'lm_head')."""
    from torch.distributed.pipelining import SplitPoint

    return {b.removeprefix("model."): SplitPoint.BEGINNING for b in boundaries}


# ------------------------------------------------------------------ hand-written pipeline()
class HandPipeline:
    """torch.distributed.pipelining as a user writes it: pipeline() + Schedule1F1B."""

    def __init__(self, model, boundaries, rank: int, pp: int, m: int, example: torch.Tensor,
                 optimizer=None):
        from torch.distributed.pipelining import Schedule1F1B, pipeline

        self.rank, self.pp = rank, pp
        pipe = pipeline(model, mb_args=(example[: example.shape[0] // m],),
                        split_spec=split_spec(boundaries))
        self.stage = pipe.build_stage(rank, torch.device("cpu"))
        self.schedule = Schedule1F1B(self.stage, m, loss_fn=loss_fn)
        self.optimizer = (optimizer or sgd)(self.stage.submod.parameters())

    def step(self, tokens, targets) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(tokens)
        elif self.rank == self.pp - 1:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        self.optimizer.step()
        if not losses:
            return torch.tensor(float("nan"))
        return torch.stack([l.detach() for l in losses]).mean()  # equal microbatches


# ------------------------------------------------------------------ one rank
def run_rank(rank: int, pp: int, config: dict, batch: int, m: int, steps: int,
             warmup: int) -> dict:
    torch.set_num_threads(1)
    data = batches(config, batch, warmup + steps)
    tokens0, targets0 = data[0]
    compiled = ah.compile(build(config), ah.Cluster.local(pp), (tokens0,), loss_fn=loss_fn,
                          example_targets=targets0, optimizer=sgd,
                          constraints=ah.Constraints(pp=pp, dp=1, tp=1, schedule="1f1b",
                                                     num_microbatches=m))
    planned = compiled.plan.stage_boundaries
    steps_of = {
        "ah": compiled.train_step,
        "equal": HandPipeline(build(config), equal_boundaries(config["layers"], pp), rank,
                              pp, m, tokens0).step,
        "at_ah": HandPipeline(build(config), planned, rank, pp, m, tokens0).step,
    }
    times = {k: [] for k in steps_of}
    cpu = {k: [] for k in steps_of}
    losses = {k: [] for k in steps_of}
    for tokens, targets in data:  # warm-up first (autohybrid captures its train graph)
        for key, step in steps_of.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = step(tokens, targets)
            times[key].append(time.perf_counter() - start)
            cpu[key].append(time.process_time() - start_cpu)
            losses[key].append(float(loss))
    dist.barrier()
    return {"times": {k: v[warmup:] for k, v in times.items()},
            "cpu": {k: v[warmup:] for k, v in cpu.items()}, "losses": losses,
            "planned": planned, "predicted": compiled.plan.predicted.step_time_s,
            "plan": compiled.plan.summary()}


# ------------------------------------------------------------------ stage timing
def stage_times(config: dict, boundaries: tuple[str, ...], tokens: torch.Tensor,
                targets: torch.Tensor, reps: int) -> list[float]:
    """Fastest of `reps` forward + backward CPU seconds (process_time, one thread: robust
    to other jobs' load) of each stage of pipeline()'s split at
    `boundaries` on one microbatch, run in this process (the last stage with the loss)."""
    from torch.distributed.pipelining import pipeline

    pipe = pipeline(build(config), mb_args=(tokens,), split_spec=split_spec(boundaries))
    mods = [pipe.get_stage_module(i) for i in range(pipe.num_stages)]
    samples: list[list[float]] = [[] for _ in mods]
    for rep in range(reps + 1):  # the first is a warm-up
        args: tuple = (tokens,)
        for i, mod in enumerate(mods):
            args = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
            mod.zero_grad(set_to_none=True)
            start = time.process_time()
            out = mod(*args)
            outs = out if isinstance(out, tuple) else (out,)
            if i == len(mods) - 1:
                loss_fn(outs[0], targets).backward()
            else:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            if rep:
                samples[i].append(time.process_time() - start)
            args = tuple(o.detach() for o in outs)
    return [min(s) for s in samples]


def _slowest_rank(results: list[dict], key: str, what: str = "times") -> list[float]:
    """Per timed step, the slowest rank's time (the step ends when every rank's ends)."""
    return [max(r[what][key][i] for r in results)
            for i in range(len(results[0][what][key]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true",
                        help="small model, pp 2, 2 steps: a smoke test")
    args = parser.parse_args()
    config, batch, pps = CONFIG, BATCH, args.pp
    if args.quick:
        config, batch, pps = QUICK_CONFIG, QUICK_BATCH, [2]
        args.steps, args.warmup = 2, 1
    torch.set_num_threads(1)
    print(f"model: gpt {config}, global batch {batch}, fp32; {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    rows = []
    for pp in pps:
        m = 2 * pp
        equal = equal_boundaries(config["layers"], pp)
        tokens, targets = batches(config, batch, 1)[0]
        # plain SGD keeps no optimizer state: ah.compile prices it as optimizer "none"
        common = dict(loss_fn=loss_fn, example_targets=targets, optimizer="none",
                      executable_only=True)
        cluster = ah.Cluster.local(pp)
        pinned = dict(pp=pp, dp=1, tp=1, schedule="1f1b", num_microbatches=m)
        model = build(config)
        planned_plan = ah.plan(model, cluster, (tokens,), constraints=ah.Constraints(**pinned),
                               **common)
        equal_plan = ah.plan(model, cluster, (tokens,),
                             constraints=ah.Constraints(**pinned, stage_boundaries=equal),
                             **common)

        results = ah.launch(run_rank, cluster, args=(pp, config, batch, m, args.steps,
                                                     args.warmup))
        last = results[-1]
        planned = last["planned"]
        ah_s, eq_s, at_s = (_slowest_rank(results, k) for k in ("ah", "equal", "at_ah"))
        ah_ms, eq_ms, at_ms = (statistics.median(s) * 1e3 for s in (ah_s, eq_s, at_s))
        paired = statistics.median(a / e for a, e in zip(ah_s, eq_s))
        ah_cpu, eq_cpu = (statistics.median(_slowest_rank(results, k, "cpu")) * 1e3
                          for k in ("ah", "equal"))
        pred_ratio = planned_plan.predicted.step_time_s / equal_plan.predicted.step_time_s
        diff = max(max(abs(a - b) for a, b in zip(last["losses"]["ah"], last["losses"][k]))
                   for k in ("equal", "at_ah"))

        micro_tokens, micro_targets = tokens[: batch // m], targets[: batch // m]
        reps = 3 if args.quick else 7
        st_eq = stage_times(config, equal, micro_tokens, micro_targets, reps)
        st_ah = stage_times(config, planned, micro_tokens, micro_targets, reps)
        bound = max(st_ah) / max(st_eq)
        rows.append((pp, m, ah_ms, eq_ms, at_ms, paired, pred_ratio, bound, ah_cpu / eq_cpu))

        print(f"\npp {pp}, 1f1b, {m} microbatches of {batch // m}: autohybrid plan "
              f"{last['plan']}")
        print(f"  boundaries: autohybrid {list(planned)} (ah.plan in the parent: "
              f"{list(planned_plan.stage_boundaries)}); pipeline() equal {list(equal)}")
        print(f"  predicted step: planned {planned_plan.predicted.step_time_s * 1e3:.1f} ms "
              f"(compiled: {last['predicted'] * 1e3:.1f}), equal split "
              f"{equal_plan.predicted.step_time_s * 1e3:.1f} ms")
        print(f"  stage fwd+bwd ms per microbatch, one process: autohybrid split "
              f"{' / '.join(f'{t * 1e3:.1f}' for t in st_ah)} (slowest/mean "
              f"{max(st_ah) / statistics.mean(st_ah):.2f}); equal split "
              f"{' / '.join(f'{t * 1e3:.1f}' for t in st_eq)} (slowest/mean "
              f"{max(st_eq) / statistics.mean(st_eq):.2f})")
        print(f"  busiest rank's CPU time per step (process_time, median): autohybrid "
              f"{ah_cpu:.0f} ms, pipeline() equal {eq_cpu:.0f} ms")
        print(f"  step-0 loss: autohybrid {last['losses']['ah'][0]:.7f}  pipeline() equal "
              f"{last['losses']['equal'][0]:.7f}  pipeline() at autohybrid's split "
              f"{last['losses']['at_ah'][0]:.7f}; max |difference| over "
              f"{len(last['losses']['ah'])} steps {diff:.1e}")
        print(f"  step ms min–max: autohybrid {min(ah_s) * 1e3:.0f}–{max(ah_s) * 1e3:.0f}, "
              f"pipeline() equal {min(eq_s) * 1e3:.0f}–{max(eq_s) * 1e3:.0f}, pipeline() at "
              f"autohybrid's split {min(at_s) * 1e3:.0f}–{max(at_s) * 1e3:.0f}; load average "
              f"{os.getloadavg()[0]:.1f}" + ("; oversubscribed: "
                                             f"{pp} ranks on {os.cpu_count()} cores"
                                             if pp > (os.cpu_count() or 1) else ""),
              flush=True)

    print(f"\nmedian of {args.steps} steps after {args.warmup} warm-up, slowest rank per step; "
          f"ratio = autohybrid / pipeline() equal medians (goal <= 0.90); paired = median of "
          f"per-step ratios; predicted = cost model, planned / equal split; stage bound = "
          f"slowest stage, planned / equal split (one process, CPU time); busiest CPU = "
          f"busiest rank's CPU time per step, autohybrid / pipeline() equal")
    print(f"{'pp':>3} {'m':>3} {'autohybrid ms':>14} {'pipeline() equal ms':>20} "
          f"{'ratio':>6} {'paired':>7} {'predicted':>10} {'stage bound':>12} "
          f"{'busiest CPU':>12} {'pipeline() at ah split ms':>26}")
    for pp, m, ah_ms, eq_ms, at_ms, paired, pred, bound, cpu in rows:
        print(f"{pp:>3} {m:>3} {ah_ms:>14.1f} {eq_ms:>20.1f} {ah_ms / eq_ms:>6.2f} "
              f"{paired:>7.2f} {pred:>10.2f} {bound:>12.2f} {cpu:>12.2f} {at_ms:>26.1f}")


if __name__ == "__main__":
    main()
