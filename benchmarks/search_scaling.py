"""How long planning takes against model size and GPU count (capture, profile, search).

    python benchmarks/search_scaling.py            # all sizes
    python benchmarks/search_scaling.py --quick    # small sizes only
    python benchmarks/search_scaling.py --capture  # capture vs depth, and GPT-3 end to end

Each model is built on the meta device and captured once; the search then runs for every
cluster size. Prints seconds per phase and the chosen plan. `--capture` prints capture
time against depth (GPT at GPT-3's widths, 24 to 128 layers) block by block
(capture_blocks.py) beside the full export (`AUTOHYBRID_CAPTURE=full`), and `ah.plan` of
GPT-3 175B on 128 DGX A100 nodes (global batch 1536) end to end, capture and search split. Competitors for scale: Alpa
takes about 40 minutes for a 39B model on 64 GPUs; Meta's autoparallel about 47 s for an
8B model on 64 GPUs.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

import autohybrid as ah
from autohybrid.planning import make_plan
from autohybrid.capture import capture
from autohybrid.errors import PlanError

MODELS = ["gpt3-1.3b", "gpt3-13b", "gpt3-175b", "gpt-1t"]
NODES = [1, 8, 128, 384]
DEPTHS = [24, 48, 96, 128]
GPT3 = dict(hidden=12288, heads=96, vocab=51200, seq=2048)


def _timed_capture(model, tokens, full: bool):
    """(seconds, captured forward graph); `full` forces the whole-model export."""
    if full:
        os.environ["AUTOHYBRID_CAPTURE"] = "full"
    try:
        start = time.perf_counter()
        forward = capture(model, (tokens,), with_loss=False)
        return time.perf_counter() - start, forward
    finally:
        os.environ.pop("AUTOHYBRID_CAPTURE", None)


def capture_scaling(full: bool) -> None:
    """Capture time against depth: it grows with distinct blocks, not with layers."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("        %(message)s"))
    logger = logging.getLogger("autohybrid.capture")   # how each capture went, and its split
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    print(f"{'layers':>6} {'blocks s':>9} {'full s':>7}  same graph")
    for layers in DEPTHS:
        model = ah.models.gpt(layers=layers, device="meta", **GPT3)
        tokens = torch.randint(0, GPT3["vocab"], (8, GPT3["seq"]), device="meta")
        by_blocks, cap = _timed_capture(model, tokens, full=False)
        whole, same = "-", "-"
        if full:
            seconds, ref = _timed_capture(model, tokens, full=True)
            whole, same = f"{seconds:.1f}", str(ref.hash == cap.hash)
        print(f"{layers:>6} {by_blocks:>9.1f} {whole:>7}  {same}")


def plan_end_to_end() -> None:
    """`ah.plan` of GPT-3 175B on 128 DGX A100 nodes, as `autohybrid plan gpt3-175b
    --cluster dgx-a100-80gb --nodes 128 --global-batch 1536` runs it."""
    model = ah.models.preset("gpt3-175b", device="meta")
    (tokens,), _ = ah.models.example_batch(model, 8, device="meta")
    cluster = ah.Cluster.preset("dgx-a100-80gb", nodes=128)
    start = time.perf_counter()
    plan = ah.plan(model, cluster, example_inputs=(tokens,), global_batch=1536,
                   dtype=torch.bfloat16)
    total = time.perf_counter() - start
    captured, forward = _timed_capture(model, tokens, full=False)
    start = time.perf_counter()
    make_plan(forward, None, model, cluster, (tokens,), 1536, torch.bfloat16, None, "adam",
              executable_only=False)
    searched = time.perf_counter() - start
    print(f"gpt3-175b on {cluster.world_size} GPUs: ah.plan {total:.1f} s end to end "
          f"(capture {captured:.1f} s + search {searched:.1f} s, timed apart)\n  {plan.summary()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="gpt3-1.3b and gpt3-13b, up to 128 nodes")
    parser.add_argument("--capture", action="store_true",
                        help="capture time vs depth and GPT-3 175B end to end, then stop")
    parser.add_argument("--no-full", action="store_true",
                        help="with --capture: skip the full exports (the slow reference)")
    args = parser.parse_args()
    if args.capture:
        capture_scaling(full=not args.no_full)
        plan_end_to_end()
        return
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
