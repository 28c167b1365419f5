"""Does the planner choose the plan that is fastest in fact? Every candidate it lists, run.

    python benchmarks/plan_choice.py [--steps 8] [--rounds 2] [--max-plans 10]
                                     [--cases gpt-2 llama-2 gpt-4 ...]

Per case (a model, a global batch, a number of local ranks): calibrate this machine on
that many ranks (`ah.calibrate`: matmul, element-wise, per-op overhead, all-reduce, all
ranks at once, so ranks sharing cores are measured sharing them), plan with that
calibration (`ah.plan(..., executable_only=True)`), and take the chosen plan and every
alternative the planner listed that fits and is not known to be unrunnable, up to
`--max-plans`. Each alternative is made again from its own `Alternative.constraints`
(the same layout, the same prediction); one the passes refuse is shown as refused.

Then one `ah.launch` per case runs every plan in turn (one compiled model alive at a
time), `--rounds` rounds in alternating order so that drift in the machine's load falls
on the first and last plans alike; a plan's step time is the median over its steps of
the slowest rank's step (a barrier before each step, warm-up steps dropped). Each plan's
first loss is held against the chosen plan's: the plans train one function.

Prints per plan predicted vs measured step time; per case Kendall's τ between the two
orders and the measured time of the planner's choice over the measured best. The issue's
goal: τ ≥ 0.7 on each case of ≥ 5 plans, the choice within 10 % of the best. Cases with
more ranks than cores are marked `*`. A benchmark, not a CI gate
(tests/test_benchmarks_plan_choice.py runs it on a tiny model).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autohybrid as ah
from _ranking import kendall_tau


@dataclass(frozen=True)
class Case:
    name: str
    kind: str              # "gpt" or "llama" (ah.models)
    config: dict
    batch: int             # global batch
    ranks: int


CASES = {
    "gpt-2": Case("gpt h256 l4 s64 b16", "gpt",
                  dict(layers=4, hidden=256, heads=8, vocab=512, seq=64), 16, 2),
    "llama-2": Case("llama h256 l4 s64 b16", "llama",
                    dict(layers=4, hidden=256, heads=8, kv_heads=4, vocab=512, seq=64), 16, 2),
    "gpt-wide-2": Case("gpt h512 l4 s128 b8", "gpt",
                       dict(layers=4, hidden=512, heads=8, vocab=1024, seq=128), 8, 2),
    "gpt-4": Case("gpt h256 l4 s64 b16", "gpt",
                  dict(layers=4, hidden=256, heads=8, vocab=512, seq=64), 16, 4),
}
DEFAULT_CASES = ("gpt-2", "llama-2", "gpt-wide-2", "gpt-4")
WARMUP = 2


@dataclass
class Candidate:
    label: str                       # "chosen" or "alt k"
    summary: str
    predicted_s: float
    plan: ah.Plan | None = None      # None: refused (why in `refused`)
    refused: str = ""
    times: list[float] = field(default_factory=list)
    first_loss: float | None = None


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def build(case: Case):
    torch.manual_seed(0)
    model = getattr(ah.models, case.kind)(**case.config)
    (tokens,), targets = ah.models.example_batch(model, case.batch)
    return model, tokens, targets


def candidates(case: Case, profile: ah.Profile | None, max_plans: int) -> list[Candidate]:
    """The planner's choice and its listed alternatives, each made again as a Plan."""
    model, tokens, targets = build(case)
    cluster = ah.Cluster.local(case.ranks)
    plan_kw = dict(loss_fn=loss_fn, example_targets=targets, executable_only=True,
                   calibration=profile, dtype=torch.float32)
    chosen = ah.plan(model, cluster, (tokens,), **plan_kw)
    out = [Candidate("chosen", _describe(chosen), chosen.predicted.step_time_s, chosen)]
    for k, alt in enumerate(chosen.alternatives, 1):
        if len(out) >= max_plans:
            break
        if not alt.fits or alt.executable is False or alt.constraints is None:
            continue
        cand = Candidate(f"alt {k}", alt.summary, alt.step_time_s)
        try:
            cand.plan = ah.plan(model, cluster, (tokens,), constraints=alt.constraints,
                                **plan_kw)
        except ah.AutohybridError as exc:  # the passes refuse it: shown, not run
            cand.refused = str(exc).splitlines()[0][:100]
        out.append(cand)
    return out


def _describe(plan: ah.Plan) -> str:
    sched = f" {plan.schedule}" + (f"×{plan.virtual_stages}" if plan.virtual_stages > 1 else "")
    return (f"{plan.mesh.describe()} microbatch {plan.microbatch_size}×{plan.num_microbatches}"
            f"{sched if plan.mesh.pp > 1 else ''} zero{plan.zero} recompute={plan.recompute}")


def run_plans(rank: int, case: Case, plans: list[ah.Plan], steps: int, rounds: int
              ) -> list[dict]:
    """This rank's step times of every plan, `rounds` rounds in alternating order."""
    out = [{"times": [], "first_loss": None} for _ in plans]
    for r in range(rounds):
        order = list(range(len(plans)))[::(-1 if r % 2 else 1)]
        for i in order:
            model, tokens, targets = build(case)
            compiled = ah.compile(model, ah.Cluster.local(case.ranks), (tokens,),
                                  loss_fn=loss_fn, example_targets=targets, plan=plans[i],
                                  optimizer=adamw)
            for s in range(WARMUP + steps):
                dist.barrier()
                start = time.perf_counter()
                loss = float(compiled.train_step(tokens, targets))
                if s >= WARMUP:
                    out[i]["times"].append(time.perf_counter() - start)
                elif s == 0 and r == 0:
                    out[i]["first_loss"] = loss
            del compiled, model
            gc.collect()
    return out


def measure(case: Case, cands: list[Candidate], steps: int, rounds: int) -> None:
    runnable = [c for c in cands if c.plan is not None]
    per_rank = ah.launch(run_plans, ah.Cluster.local(case.ranks),
                         args=(case, [c.plan for c in runnable], steps, rounds))
    for i, cand in enumerate(runnable):
        cand.times = [max(t) for t in zip(*(r[i]["times"] for r in per_rank))]
        cand.first_loss = per_rank[0][i]["first_loss"]


def report(case: Case, cands: list[Candidate]) -> dict:
    """Print the case's table; return its τ and choice ratio."""
    mark = "*" if case.ranks > (os.cpu_count() or 1) else ""
    print(f"\n{case.name} on {case.ranks}{mark} local ranks: load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'':>7} {'plan':<62} {'predicted ms':>12} {'measured ms':>12} {'pred/meas':>9}")
    ran = [c for c in cands if c.times]
    base_loss = cands[0].first_loss
    for c in cands:
        if not c.times:
            print(f"{c.label:>7} {c.summary:<62} {c.predicted_s * 1e3:>12.1f} "
                  f"{'refused: ' + c.refused:>22}")
            continue
        meas = statistics.median(c.times)
        print(f"{c.label:>7} {c.summary:<62} {c.predicted_s * 1e3:>12.1f} {meas * 1e3:>12.1f} "
              f"{c.predicted_s / meas:>9.2f}")
    pred = [c.predicted_s for c in ran]
    meas = [statistics.median(c.times) for c in ran]
    tau = kendall_tau(pred, meas)
    choice = meas[0] / min(meas) if ran and ran[0].label == "chosen" else float("nan")
    losses = [abs(c.first_loss - base_loss) for c in ran
              if c.first_loss is not None and base_loss is not None]
    print(f"Kendall τ {tau:+.2f} over {len(ran)} plans; chosen / measured best "
          f"{choice:.3f}; median |error| "
          f"{statistics.median(abs(p / m - 1) for p, m in zip(pred, meas)):.0%}; "
          f"first losses agree within {max(losses, default=0.0):.1e}")
    order = lambda xs: ", ".join(ran[i].label for i in sorted(range(len(xs)),  # noqa: E731
                                                              key=xs.__getitem__))
    print(f"  fastest → slowest, predicted: {order(pred)}")
    print(f"  fastest → slowest, measured:  {order(meas)}")
    return {"tau": tau, "choice": choice, "plans": len(ran),
            "loss_diff": max(losses, default=0.0)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-plans", type=int, default=10)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(DEFAULT_CASES))
    parser.add_argument("--no-calibration", action="store_true",
                        help="price with the cluster's documented figures (quick runs)")
    args = parser.parse_args(argv)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start, "
          f"torch {torch.__version__}")
    profiles: dict[int, ah.Profile | None] = {}
    results = []
    for name in args.cases:
        case = CASES[name]
        if case.ranks not in profiles:
            profiles[case.ranks] = None if args.no_calibration else \
                ah.calibrate(ah.Cluster.local(case.ranks))
            prof = profiles[case.ranks]
            if prof is not None:
                print(f"calibration on {case.ranks} ranks {prof.hash()}: matmul "
                      f"{prof.matmul_flops['float32'] / 1e9:.1f} GFLOP/s, element-wise "
                      f"{prof.memory_bandwidth / 1e9:.1f} GB/s, all-reduce α "
                      f"{(prof.all_reduce_latency_s or 0) * 1e6:.0f} µs, 1/β "
                      f"{(prof.all_reduce_bandwidth or 0) / 1e9:.2f} GB/s, per op "
                      f"{(prof.launch_overhead_s or 0) * 1e6:.1f} µs, a rank alone "
                      f"{max(prof.alone_speedup.values(), default=1.0):.2f}× its rate "
                      f"beside the others", flush=True)
        cands = candidates(case, profiles[case.ranks], args.max_plans)
        measure(case, cands, args.steps, args.rounds)
        results.append({"case": name, **report(case, cands)})
    print(f"\nmeasured = median over {args.rounds} rounds × {args.steps} steps (after "
          f"{WARMUP} warm-up) of the slowest rank's step; load average "
          f"{os.getloadavg()[0]:.1f} at the end")
    return results


if __name__ == "__main__":
    main()
