"""How long planning takes against model size and GPU count (capture, profile, search).

    python benchmarks/search_scaling.py            # all sizes
    python benchmarks/search_scaling.py --quick    # small sizes only

Each model is built on the meta device and captured once; the search then runs for every
cluster size. Prints seconds per phase and the chosen plan. Competitors for scale: Alpa
takes about 40 minutes for a 39B model on 64 GPUs; Meta's autoparallel about 47 s for an
8B model on 64 GPUs.
"""
from __future__ import annotations

import argparse
import time

import torch

import autohybrid as ah
from autohybrid.api import make_plan
from autohybrid.capture import capture
from autohybrid.errors import PlanError

MODELS = ["gpt3-1.3b", "gpt3-13b", "gpt3-175b", "gpt-1t"]
NODES = [1, 8, 128, 384]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt3-1.3b and gpt3-13b, up to 128 nodes")
    args = parser.parse_args()
    models = MODELS[:2] if args.quick else MODELS
    nodes_list = NODES[:3] if args.quick else NODES
    print(f"{'model':>10} {'params':>8} {'capture s':>9} {'GPUs':>6} {'search s':>9}  plan")
    for name in models:
        model = ah.models.preset(name, device="meta")
        (tokens,), _ = ah.models.example_batch(model, 8, device="meta")
        start = time.perf_counter()
        forward = capture(model, (tokens,), with_loss=False)
        captured = time.perf_counter() - start
        params = sum(p.numel() for p in model.parameters()) / 1e9
        for nodes in nodes_list:
            cluster = ah.Cluster.preset("dgx-a100-80gb", nodes=nodes)
            start = time.perf_counter()
            try:
                plan = make_plan(forward, None, model, cluster, (tokens,), 4 * cluster.world_size,
                                 torch.bfloat16, None, "adam", executable_only=False)
                chosen = plan.summary()
            except PlanError as exc:
                chosen = f"no plan: {str(exc)[:60]}…"
            searched = time.perf_counter() - start
            print(f"{name:>10} {params:>7.1f}B {captured:>9.1f} {cluster.world_size:>6} "
                  f"{searched:>9.2f}  {chosen}")


if __name__ == "__main__":
    main()
