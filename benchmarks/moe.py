"""Expert parallelism against data parallelism alone, and the all-to-all measured beside the
predicted, in one run.

    python benchmarks/moe.py [--worlds 2 4] [--steps 10] [--warmup 2] [--model MODEL]
                             [--no-calibration] [--out FILE]

Per world size: `ah.calibrate` on that many local ranks (its all-to-all is one of the
collectives it times), then one launch in which every rank compiles the MoE model under
dp only (ep = 1) and under each expert-parallel degree the world allows (2; and 4 on 4
ranks), all with dp = world, tp = pp = 1, ZeRO 0, from the same initial weights; the
planner picks the chunks each MoE layer's tokens are exchanged in (×C in the table), and
at the largest ep the `--chunks` counts run pinned too (each chunk's exchange beside the
previous chunk's experts). Steps
alternate between the plans, a barrier before each (paired: a plan's step is compared
with the dp step next to it). Every rank times each all-to-all of token rows the MoE
layers issue (ops/moe.py's dispatch and combine, forward and backward; not the small
exchange of per-expert counts), summed per step. Prints per plan: the median step, the
paired ratio to dp (< 1: faster), the all-to-all time per step as the step spends it
(median over steps of the slowest rank; it includes waiting for peers still computing or
routing more rows), the same all-to-alls alone (each MoE layer's routed rows exchanged
with every rank starting together, after the steps; × 4 per layer) and the cost model's
prediction of them — four all-to-alls of each MoE layer's routed rows over the ep ranks
(cost/comm.all_to_all on the calibrated links) — and whether every plan's losses equal
the dp plan's. Times are ms per step.

The default model is Mixtral's layout shrunk (8 experts of 512, top-2, hidden 256, 4
layers, sequence 128, batch 8): the experts hold most of the parameters and FLOPs. On a 2-core machine the 4-rank
rows share two cores between four ranks.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autohybrid as ah  # noqa: E402
from autohybrid.cost import comm  # noqa: E402
from autohybrid.plan import Mesh  # noqa: E402
from autohybrid.search.pricing import axis_ranks  # noqa: E402

MODEL = ("mixtral-8x7b?layers=4&hidden=256&heads=8&kv_heads=4&vocab=512&experts=8&top_k=2"
         "&expert_hidden=512&seq=128&batch=8")


def ep_degrees(world: int, experts: int) -> list[int]:
    return [ep for ep in (1, 2, 4, 8) if ep <= world and world % ep == 0 and experts % ep == 0]


def predicted_all_to_all(workload, world: int, ep: int, chunks: int, profile) -> float:
    """Seconds per step of one rank's all-to-alls of routed rows under ep (4 per MoE
    layer, each in `chunks` pieces), on the calibrated links (the cluster's placeholders
    without a calibration)."""
    if ep == 1:
        return 0.0
    cluster = ah.Cluster.local(world)
    if profile is not None:
        cluster = profile.apply(cluster)
    cfg = workload.model.config
    tokens = workload.inputs[0].numel() // world          # this rank's share of the batch
    routed = tokens * cfg["top_k"] * cfg["hidden"] * 4    # float32 rows
    layers = cfg["layers"] - cfg.get("dense_layers", 0)
    ranks = axis_ranks(Mesh(dp=world, ep=ep), "ep")
    return 4 * layers * chunks * comm.all_to_all(cluster, ranks, routed / chunks)


def _rank(rank: int, ref: str, world: int, steps: int, warmup: int,
          extra_chunks: tuple[int, ...]) -> dict:
    workload = ah.models.spec.parse(ref).build(device="cpu")
    experts = workload.model.config["experts"]
    eps = ep_degrees(world, experts)
    # (ep, pinned chunks or None: the planner's), dp only first
    degrees = [(ep, None) for ep in eps] + [(eps[-1], c) for c in extra_chunks if eps[-1] > 1]
    batches = workload.batches(warmup + steps)
    compiled = {}
    for ep, pinned in degrees:
        torch.manual_seed(0)
        model = copy.deepcopy(workload.model)
        compiled[ep, pinned] = ah.compile(
            model, ah.Cluster.local(world), workload.inputs, loss_fn=workload.loss_fn,
            example_targets=workload.targets,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
            constraints=ah.Constraints(dp=world, tp=1, pp=1, zero=0, ep=ep,
                                       moe_chunks=pinned))
    spent = [0.0]
    original = dist.all_to_all_single

    def timed(output, input, *args, **kwargs):  # noqa: A002
        start = time.perf_counter()
        work = original(output, input, *args, **kwargs)
        if input.is_floating_point():   # token rows, not the per-expert counts
            spent[0] += time.perf_counter() - start
        return work

    chunks = {key: compiled[key].plan.moe_chunks for key in degrees}
    step_s = {ep: [] for ep in degrees}
    a2a_s = {ep: [] for ep in degrees}
    losses = {ep: [] for ep in degrees}
    dist.all_to_all_single = timed
    try:
        for k, (inputs, targets) in enumerate(batches):
            for key in degrees:
                dist.barrier()
                spent[0] = 0.0
                start = time.perf_counter()
                loss = compiled[key].train_step(inputs, targets)
                elapsed = time.perf_counter() - start
                if k >= warmup:
                    step_s[key].append(elapsed)
                    a2a_s[key].append(spent[0])
                    losses[key].append(float(loss))
    finally:
        dist.all_to_all_single = original
    cfg = workload.model.config
    rows = workload.inputs[0].numel() // world * cfg["top_k"]
    alone = {ep: _alone(rank, world, ep, rows, cfg["hidden"]) for ep in eps if ep > 1}
    return {"step_s": step_s, "a2a_s": a2a_s, "losses": losses, "alone_s": alone,
            "chunks": chunks}


def _alone(rank: int, world: int, ep: int, rows: int, hidden: int, repeats: int = 20
           ) -> float:
    """Median seconds of one all-to-all of a MoE layer's routed rows over this rank's ep
    group, every rank starting together (a barrier before each): the transfer without
    the wait for peers that a step's all-to-all includes."""
    groups = [dist.new_group(list(range(b * ep, (b + 1) * ep))) for b in range(world // ep)]
    group = groups[rank // ep]
    send = torch.randn(rows - rows % ep, hidden)
    received = torch.empty_like(send)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(received, send, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(world: int, ref: str, steps: int, warmup: int, calibrate: bool,
        extra_chunks: tuple[int, ...] = ()) -> list[dict]:
    workload = ah.models.spec.parse(ref).build(device="meta")
    profile = ah.calibrate(ah.Cluster.local(world)) if calibrate else None
    results = ah.launch(_rank, world, args=(ref, world, steps, warmup, extra_chunks),
                        timeout_s=3600)
    rows = []
    base = (1, None)
    for key in results[0]["step_s"]:
        ep, chunks = key[0], results[0]["chunks"][key]
        # the slowest rank's step and all-to-all time, per step
        steps_s = [max(r["step_s"][key][i] for r in results) for i in range(steps)]
        dp_s = [max(r["step_s"][base][i] for r in results) for i in range(steps)]
        a2a = [max(r["a2a_s"][key][i] for r in results) for i in range(steps)]
        layers = workload.model.config["layers"] - workload.model.config["dense_layers"]
        # the same bytes alone, in as many pieces as the plan sends them
        alone = 4 * layers * max(r["alone_s"][ep] for r in results) if ep > 1 else 0.0
        equal = all(abs(a - b) <= 1e-5 * max(1.0, abs(b))
                    for a, b in zip(results[0]["losses"][key], results[0]["losses"][base]))
        rows.append(dict(world=world, ep=ep, chunks=chunks, pinned=key[1] is not None,
                         step_s=statistics.median(steps_s),
                         paired=statistics.median(a / b for a, b in zip(steps_s, dp_s)),
                         a2a_s=statistics.median(a2a), alone_s=alone,
                         predicted_a2a_s=predicted_all_to_all(workload, world, ep, chunks,
                                                              profile),
                         losses="equal" if equal else "differ"))
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'ranks':>5} {'plan':<26} {'step ms':>8} {'÷ dp':>6} {'a2a in step':>11} "
            f"{'a2a alone':>9} {'predicted':>9} {'losses':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        plan = "dp only" if r["ep"] == 1 else \
            f"ep={r['ep']} (dp={r['world']}) ×{r['chunks']}{' pinned' if r['pinned'] else ''}"
        lines.append(f"{r['world']:>5} {plan:<26} {r['step_s'] * 1e3:8.1f} {r['paired']:6.3f} "
                     f"{r['a2a_s'] * 1e3:11.2f} {r['alone_s'] * 1e3:9.2f} "
                     f"{r['predicted_a2a_s'] * 1e3:9.2f} "
                     f"{r['losses']:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--no-calibration", action="store_true")
    parser.add_argument("--chunks", type=int, nargs="*", default=[4],
                        help="chunk counts also run pinned, at the largest ep")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for world in args.worlds:
        rows += run(world, args.model, args.steps, args.warmup, not args.no_calibration,
                    tuple(args.chunks))
    text = (f"{table(rows)}\n\n{args.model}; {args.steps} steps after {args.warmup} warm-up; "
            f"torch {torch.__version__}, gloo on CPU; load average "
            f"{os.getloadavg()[0]:.2f} at the end")
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
