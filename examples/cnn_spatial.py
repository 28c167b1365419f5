"""Spatial parallelism chosen by the planner: a 3-D CNN whose activations do not fit.

    python examples/cnn_spatial.py                    # 4 local processes, CosmoFlow-style
    python examples/cnn_spatial.py --presets          # also: plans on DGX presets (meta)

A CosmoFlow-style 3-D CNN (the zoo's `cosmoflow`: conv 3³ → LeakyReLU → max pool 2,
per stage, then dense layers) regresses 4 parameters from volumes. The global batch is
smaller than the world, so data parallelism alone cannot spread it, and tensor
parallelism splits only the dense layers. The example finds the per-rank memory limit
under which no plan without tiles fits (planning with `Constraints(spatial=())`, the
limit lowered until none does), then lets `ah.compile` plan freely under it: it tiles
the volumes (`spatial` in the mesh: each rank holds a slab of every activation and
exchanges halos with its neighbours). Every rank trains; rank 0 also trains an eager
copy on the whole batch, and the table shows both losses.

`--presets` also plans, without processes (the models on the meta device), CosmoFlow at
128³ on two DGX A100 nodes with a global batch of 4, and ResNet-50 on four nodes with a
global batch of 256, and prints each plan with its best spatial and its best
filter/channel alternative.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import time

import torch
import torch.nn.functional as F

import autohybrid as ah


def build(config: dict, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    return ah.models.cosmoflow(**config).to(dtype)


def batches(args: argparse.Namespace, dtype: torch.dtype = torch.float64) -> list:
    out = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(args.batch, 4, args.size, args.size, args.size, generator=g)
        out.append(((x.to(dtype),), torch.randn(args.batch, 4, generator=g).to(dtype)))
    return out


def with_memory(cluster: ah.Cluster, nbytes: int) -> ah.Cluster:
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device,
                                                                   memory_bytes=nbytes))


def limit_without_tiles(model, cluster: ah.Cluster, example) -> tuple[int, str]:
    """A per-rank memory under which no plan without spatial tiles fits, and the best
    such plan at the machine's own memory."""
    (x,), y = example
    untiled = ah.Constraints(spatial=())
    # optimizer="none": plain SGD keeps no state, as ah.compile sees from the optimizer
    plan = ah.plan(model, cluster, (x,), loss_fn=F.mse_loss, example_targets=y,
                   constraints=untiled, executable_only=True, optimizer="none")
    limit = int(plan.predicted.memory_per_rank_bytes)
    while limit > 1:
        limit = int(limit * 0.9)
        try:
            ah.plan(model, with_memory(cluster, limit), (x,), loss_fn=F.mse_loss,
                    example_targets=y, constraints=untiled, executable_only=True,
                    optimizer="none")
        except ah.NoPlanFitsError:
            return limit, plan.summary().splitlines()[0]
    raise SystemExit("every plan without tiles fits in 1 byte: nothing to show")


def main(rank: int, args: argparse.Namespace, config: dict, limit: int) -> dict:
    model = build(config)
    eager = build(config) if rank == 0 else None
    data = batches(args)
    (x0,), y0 = data[0]
    cluster = with_memory(ah.Cluster.local(args.world_size), limit)
    optimizer = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    compiled = ah.compile(model, cluster, (x0,), loss_fn=F.mse_loss, example_targets=y0,
                          optimizer=optimizer)
    eager_opt = optimizer(list(eager.parameters())) if eager is not None else None
    rows = []
    for (x,), y in data:
        start = time.perf_counter()
        loss = compiled.train_step(x, y).item()
        compiled_s = time.perf_counter() - start
        eager_loss = eager_s = float("nan")
        if eager is not None:
            start = time.perf_counter()
            eager_opt.zero_grad()
            reference = F.mse_loss(eager(x), y)
            reference.backward()
            eager_opt.step()
            eager_s, eager_loss = time.perf_counter() - start, reference.item()
        rows.append((loss, eager_loss, compiled_s, eager_s))
    state = compiled.full_state_dict()
    result = {"rows": rows, "mesh": compiled.plan.mesh.describe()}
    if rank == 0:
        result["explain"] = compiled.explain()
        ref = eager.state_dict()
        result["max_param_diff"] = max((state[k] - ref[k]).abs().max().item() for k in ref)
    return result


def presets() -> None:
    """Plans on cluster presets, models on the meta device (no processes)."""
    cases = [("cosmoflow", dict(image_size=128), ah.Cluster.preset("dgx-a100-80gb", nodes=2),
              4, (4, 128, 128, 128)),
             ("resnet50", None, ah.Cluster.preset("dgx-a100-80gb", nodes=4), 256,
              (3, 224, 224))]
    for name, config, cluster, global_batch, sample in cases:
        model = ah.models.preset(name, device="meta")
        x = torch.empty(2, *sample, device="meta")
        y = torch.empty(2, 4, device="meta") if name == "cosmoflow" else \
            torch.zeros(2, dtype=torch.long, device="meta")
        loss = F.mse_loss if name == "cosmoflow" else F.cross_entropy
        start = time.perf_counter()
        plan = ah.plan(model, cluster, (x,), global_batch=global_batch, loss_fn=loss,
                       example_targets=y, executable_only=True)
        seconds = time.perf_counter() - start
        print(f"{name}, global batch {global_batch}, on {cluster.describe()} "
              f"(planned in {seconds:.1f} s):")
        print(f"  chosen   {plan.summary().splitlines()[0]}")
        tiled = [a for a in plan.alternatives if "spatial" in a.summary]
        if plan.mesh.spatial:
            others = [a for a in plan.alternatives if "spatial" not in a.summary]
            if others:
                print(f"  untiled  {others[0].summary}: {others[0].reason}")
        elif tiled:
            print(f"  tiled    {tiled[0].summary}: {tiled[0].reason}")
        # data × filter/channel: convolutions split by channels on the tp axis
        channels = [a for a in plan.alternatives
                    if re.search(r"×tp[2-9]", a.summary) and "spatial" not in a.summary]
        if channels and not re.search(r"×tp[2-9]", plan.summary()):
            print(f"  channels {channels[0].summary}: {channels[0].reason}")
        print()


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="global batch")
    parser.add_argument("--size", type=int, default=32, help="side of the volumes")
    parser.add_argument("--channels", default="4,8,8", help="conv channels per stage")
    parser.add_argument("--presets", action="store_true",
                        help="also plan CosmoFlow and ResNet-50 on DGX presets")
    args = parser.parse_args(argv)
    config = dict(channels=[int(c) for c in args.channels.split(",")], in_channels=4,
                  image_size=args.size, hidden=16, outputs=4)
    model = build(config)
    limit, untiled = limit_without_tiles(model, ah.Cluster.local(args.world_size),
                                         batches(args)[0])
    print(f"autohybrid spatial example: cosmoflow {config}, global batch {args.batch}, "
          f"volumes {args.size}³, on Cluster.local({args.world_size}), {args.steps} SGD "
          f"steps\nwithout tiles the best plan is {untiled}; below {limit:,} bytes per "
          f"rank no plan without tiles fits: the ranks get that limit\n")
    (x0,), y0 = batches(args)[0]
    try:   # the same plan ah.compile makes on every rank, checked before processes start
        ah.plan(model, with_memory(ah.Cluster.local(args.world_size), limit), (x0,),
                loss_fn=F.mse_loss, example_targets=y0, executable_only=True,
                optimizer="none")
    except ah.NoPlanFitsError as exc:
        raise SystemExit(f"at {limit:,} bytes per rank no tiled plan fits either (halos and "
                         f"gathers outweigh the tiles at this size: try larger --size):\n"
                         f"{exc}") from None
    results = ah.launch(main, ah.Cluster.local(args.world_size), args=(args, config, limit))
    first = results[0]
    print(first["explain"], "\n")
    print(f"{'step':>4}  {'compiled loss':>14}  {'eager loss':>14}  {'|diff|':>9}  "
          f"{'compiled s':>10}  {'eager s':>8}")
    for step, (loss, eager_loss, compiled_s, eager_s) in enumerate(first["rows"]):
        print(f"{step:>4}  {loss:>14.6f}  {eager_loss:>14.6f}  {abs(loss - eager_loss):>9.2e}  "
              f"{compiled_s:>10.4f}  {eager_s:>8.4f}")
    print(f"\nmesh {first['mesh']}; largest parameter difference from eager after "
          f"{args.steps} steps: {first['max_param_diff']:.2e}")
    if args.presets:
        print()
        presets()
    return {"results": results, "limit": limit}


if __name__ == "__main__":
    run()
