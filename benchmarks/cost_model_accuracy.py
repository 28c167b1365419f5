"""Predicted against measured step time on this machine, after calibration.

    python benchmarks/cost_model_accuracy.py [--steps 8]

Calibrates (matmul, element-wise, per-op overhead, all-reduce on 2 local ranks), then
for each small configuration compiles it with `ah.compile` on 1 or 2 local ranks, trains
warm-up + N steps, and compares the median measured step time with the plan's
prediction (priced with the calibration). Prints the error per row and Kendall's rank correlation τ.
Goal: errors within ±25 %, τ ≥ 0.7. A benchmark, not a CI gate.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import autohybrid as ah

#: name, model kwargs (gpt), global batch, ranks
CONFIGS = [
    ("gpt h64 l2 b8", dict(layers=2, hidden=64, heads=4, vocab=256, seq=64), 8, 1),
    ("gpt h128 l2 b8", dict(layers=2, hidden=128, heads=4, vocab=256, seq=64), 8, 1),
    ("gpt h128 l4 b16", dict(layers=4, hidden=128, heads=4, vocab=512, seq=64), 16, 1),
    ("gpt h256 l4 b16", dict(layers=4, hidden=256, heads=8, vocab=512, seq=64), 16, 1),
    ("gpt h128 l4 b16 dp2", dict(layers=4, hidden=128, heads=4, vocab=512, seq=64), 16, 2),
    ("gpt h256 l4 b32 dp2", dict(layers=4, hidden=256, heads=8, vocab=512, seq=64), 32, 2),
    ("gpt h384 l6 b16 dp2", dict(layers=6, hidden=384, heads=8, vocab=1024, seq=64), 16, 2),
]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def run_config(rank: int, config: dict, batch: int, ranks: int, steps: int,
               profile: ah.Profile) -> dict:
    torch.manual_seed(0)
    model = ah.models.gpt(**config)
    (tokens,), targets = ah.models.example_batch(model, batch)
    plan = ah.plan(model, ah.Cluster.local(ranks), (tokens,), loss_fn=loss_fn,
                   example_targets=targets, executable_only=True, calibration=profile,
                   dtype=torch.float32)
    compiled = ah.compile(model, ah.Cluster.local(ranks), (tokens,), loss_fn=loss_fn,
                          example_targets=targets, plan=plan,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    times = []
    for step in range(steps + 2):
        start = time.perf_counter()
        compiled.train_step(tokens, targets)
        times.append(time.perf_counter() - start)
    return {"measured": statistics.median(times[2:]), "predicted": plan.predicted.step_time_s}


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    pairs = concordant = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            pairs += 1
            concordant += 1 if (xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 else -1
    return concordant / pairs if pairs else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    profile = ah.calibrate(ah.Cluster.local(2))
    print(f"calibration {profile.hash()}: matmul {profile.matmul_flops['float32'] / 1e9:.1f} "
          f"GFLOP/s, element-wise {profile.memory_bandwidth / 1e9:.1f} GB/s, all-reduce α "
          f"{(profile.all_reduce_latency_s or 0) * 1e6:.0f} µs, launch overhead "
          f"{(profile.launch_overhead_s or 0) * 1e6:.1f} µs/op\n")
    print(f"{'config':>22} {'ranks':>5} {'predicted ms':>13} {'measured ms':>12} {'error':>8}")
    predicted, measured = [], []
    for name, config, batch, ranks in CONFIGS:
        result = ah.launch(run_config, ah.Cluster.local(ranks),
                           args=(config, batch, ranks, args.steps, profile))[0]
        predicted.append(result["predicted"])
        measured.append(result["measured"])
        error = result["predicted"] / result["measured"] - 1
        print(f"{name:>22} {ranks:>5} {result['predicted'] * 1e3:>13.2f} "
              f"{result['measured'] * 1e3:>12.2f} {error:>+8.0%}")
    print(f"\npredicted range {max(predicted) / min(predicted):.1f}×; median |error| "
          f"{statistics.median(abs(p / m - 1) for p, m in zip(predicted, measured)):.0%}; "
          f"Kendall τ {kendall_tau(predicted, measured):.2f}")


if __name__ == "__main__":
    main()
