"""Every CNN strategy autohybrid executes, measured on 4 local ranks, against the ParaDL
oracle's predicted ranking (cost/oracle.py), with Kendall's τ between the two orders.

    python benchmarks/cnn_strategies.py [--steps 10] [--warmup 2] [--size 32]
                                        [--batch 8] [--channels 8,16,16]

The model is the zoo's CosmoFlow-style 3-D CNN (`ah.models.cosmoflow`: conv 3³ →
LeakyReLU → max pool 2 per stage, then dense layers; no BatchNorm, so every strategy
can run it) on volumes of `--size`³, fp32, MSE against 4 targets, plain SGD. In one
`ah.launch` on `ah.Cluster.local(4)` (gloo, one thread per rank) each strategy trains
the same model (same seed) on the same global batches:

    serial         the eager model in one process (rank 0; the others wait)
    data           Constraints(dp=4, tp=1, pp=1)
    spatial        Constraints(tp=4, pp=1, spatial=(4,))        tiles along D
    filter         Constraints(tp=4, dp=1, pp=1, sp=False)      convs split by channels
    pipeline       Constraints(pp=4, dp=1, tp=1)                default schedule
    data×filter    Constraints(dp=2, tp=2, pp=1, sp=False)
    data×spatial   Constraints(dp=2, tp=2, pp=1, spatial=(2,))

autohybrid's tp axis splits convolutions in Megatron's pairs: a filter-split conv (its
output channels) feeds a channel-split conv (its input channels, partial sums
all-reduced) with no collective between, where the oracle's filter strategy splits every
layer's filters and all-gathers each output, and its channel strategy splits every
layer's input channels and all-reduces each output. The filter rows run those pairs;
channel alone is priced, not run (the table says so). The strategies alternate
step by step with a barrier before each, so load on the machine falls on all alike; a
step's time is the slowest rank's, the table gives medians. The oracle prices the same
model and global batch on the same cluster, whose hybrids put data parallelism across
nodes: it is given the 4 ranks as 2 nodes of 2 (the same gloo links), so its
data×spatial is dp 2 × spatial 2 as measured. Kendall's τ compares the predicted and the
measured order of the strategies both have (1: the same order, −1: reversed).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autohybrid as ah  # noqa: E402

WORLD = 4
STRATEGIES = {
    "data": ah.Constraints(dp=4, tp=1, pp=1),
    "spatial": ah.Constraints(tp=4, pp=1, spatial=(4,)),
    "filter": ah.Constraints(tp=4, dp=1, pp=1, sp=False),
    "pipeline": ah.Constraints(pp=4, dp=1, tp=1),
    "data×filter": ah.Constraints(dp=2, tp=2, pp=1, sp=False),
    "data×spatial": ah.Constraints(dp=2, tp=2, pp=1, spatial=(2,)),
}
#: strategies the oracle prices and autohybrid runs differently (filter: as the pairs)
NOTES = {"filter": "run as filter/channel pairs (tp 4)",
         "data×filter": "run as dp 2 × filter/channel pairs (tp 2)",
         "channel": "not run alone: autohybrid pairs channel- with filter-split convs"}


def build(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    return ah.models.cosmoflow(**config)


def batches(args: argparse.Namespace, count: int) -> list:
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch, 4, args.size, args.size, args.size, generator=g)
        out.append((x, torch.randn(args.batch, 4, generator=g)))
    return out


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def run_rank(rank: int, args: argparse.Namespace, config: dict) -> dict:
    data = batches(args, args.warmup + args.steps)
    x0, y0 = data[0]
    sgd = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    runners, losses = {}, {}
    if rank == 0:
        eager = build(config)
        opt = sgd(list(eager.parameters()))

        def serial(x, y):
            opt.zero_grad()
            loss = F.mse_loss(eager(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        runners["serial"] = serial
    else:
        runners["serial"] = None
    for name, constraints in STRATEGIES.items():
        # no try: a compile error on one rank (not all) would leave the others waiting in
        # the next collective; the launcher ends every rank and reports it instead
        compiled = ah.compile(build(config), ah.Cluster.local(WORLD), (x0,),
                              loss_fn=F.mse_loss, example_targets=y0, optimizer=sgd,
                              constraints=constraints)
        runners[name] = compiled.train_step
    times: dict[str, list[float]] = {name: [] for name in runners}
    for step, (x, y) in enumerate(data):
        for name, step_fn in runners.items():
            dist.barrier()
            start = time.perf_counter()
            loss = step_fn(x, y) if step_fn is not None else None
            seconds = _slowest(time.perf_counter() - start)
            if step >= args.warmup:
                times[name].append(seconds)
            if loss is not None:
                losses.setdefault(name, []).append(float(loss))
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "losses": losses}


def kendall_tau(first: list[str], second: list[str]) -> float:
    """Kendall's τ-a between two orders of the same items."""
    items = [s for s in first if s in second]
    pos = {s: second.index(s) for s in items}
    n = len(items)
    if n < 2:
        return float("nan")
    concordant = discordant = 0
    for i in range(n):
        for j in range(i + 1, n):
            if pos[items[i]] < pos[items[j]]:
                concordant += 1
            else:
                discordant += 1
    return (concordant - discordant) / (n * (n - 1) / 2)


def oracle_cluster() -> ah.Cluster:
    """The 4 local ranks as 2 nodes of 2 with the same links (the oracle's hybrids put
    data parallelism across nodes)."""
    local = ah.Cluster.local(WORLD)
    return dataclasses.replace(local, nodes=2, devices_per_node=2,
                               inter_link=local.intra_link, nics_per_node=1,
                               is_local=False)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--channels", default="8,16,16")
    args = parser.parse_args(argv)
    config = dict(channels=[int(c) for c in args.channels.split(",")], in_channels=4,
                  image_size=args.size, hidden=32, outputs=4)
    x, _ = batches(args, 1)[0]
    predicted = ah.oracle(build(config), oracle_cluster(), (x,), dataset_size=args.batch * 64,
                          global_batch=args.batch, model_name="cosmoflow")
    results = ah.launch(run_rank, ah.Cluster.local(WORLD), args=(args, config))
    first = results[0]
    measured = first["times"]
    oracle_order = [s.strategy for s in predicted.ranking
                    if s.strategy in measured or s.strategy == "serial"]
    measured_order = sorted(measured, key=measured.get)
    steps_per_epoch = predicted.dataset_size / predicted.global_batch
    print(f"CNN strategies: cosmoflow {config}, global batch {args.batch}, volumes "
          f"{args.size}³, fp32, SGD, on Cluster.local({WORLD}); median of {args.steps} "
          f"steps after {args.warmup} warm-up\n")
    print(f"{'strategy':<14} {'predicted ms':>12} {'measured ms':>12} {'pred rank':>9} "
          f"{'meas rank':>9}  note")
    for cost in predicted.strategies:
        name = cost.strategy
        pred_ms = cost.total_s / steps_per_epoch * 1e3
        if name in measured:
            print(f"{name:<14} {pred_ms:>12.2f} {measured[name] * 1e3:>12.2f} "
                  f"{oracle_order.index(name) + 1 if name in oracle_order else '-':>9} "
                  f"{measured_order.index(name) + 1:>9}  "
                  + NOTES.get(name, "")
                  + ("" if cost.applies else f"; oracle: breaks {cost.broken}"))
        else:
            why = NOTES.get(name, "not executed")
            print(f"{name:<14} {pred_ms:>12.2f} {'-':>12} {'-':>9} {'-':>9}  {why}")
    tau = kendall_tau(oracle_order, measured_order)
    print(f"\npredicted order: {' < '.join(oracle_order)}")
    print(f"measured order:  {' < '.join(measured_order)}")
    print(f"Kendall tau over {len([s for s in oracle_order if s in measured_order])} "
          f"strategies: {tau:+.2f}")
    serial = first["losses"].get("serial", [])
    worst = max((abs(a - b) / abs(b) for name, ls in first["losses"].items()
                 if name != "serial" for a, b in zip(ls, serial)), default=0.0)
    print(f"largest relative loss difference from serial over every step: {worst:.1e}")
    return {"measured": measured, "oracle_order": oracle_order,
            "measured_order": measured_order, "tau": tau, "loss_diff": worst}


if __name__ == "__main__":
    main()
