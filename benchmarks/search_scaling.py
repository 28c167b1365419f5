"""How long planning takes against model size, depth and GPU count (capture, search, CLI).

    python benchmarks/search_scaling.py            # all three tables
    python benchmarks/search_scaling.py --quick    # small sizes only, no CLI runs
    python benchmarks/search_scaling.py --full     # the depth table beside the full export

1. Per model (built on the meta device, forward graph captured once): capture seconds,
   then the search (with the pass trial on the chosen plan) for every cluster size,
   global batch 4 × GPUs, and the chosen plan.
2. Capture against depth: GPT at GPT-3's widths with 24 to 128 layers, captured once
   per distinct block (capture_blocks.py); it grows with distinct blocks, not layers.
   `--full` adds the whole-model export (`AUTOHYBRID_CAPTURE=full`) and checks both give
   the same graph.
3. The planning goals end to end, as a user runs them: the wall clock of `autohybrid
   plan` in a fresh process (Python start-up, imports, capture of the training graph,
   search, the pass trial), for GPT-3 175B on 128 DGX A100 nodes (global batch 1536,
   goal under 10 s) and the 1T GPT on 384 nodes = 3,072 GPUs (global batch 3072, goal
   under 20 s).

Competitors for scale: Alpa takes about 40 minutes for a 39B model on 64 GPUs; Meta's
autoparallel about 47 s for an 8B model on 64 GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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
#: (model, nodes, global batch, goal in seconds) of the end-to-end `autohybrid plan` runs
CLI_GOALS = [("gpt3-175b", 128, 1536, 10.0), ("gpt-1t", 384, 3072, 20.0),
             ("mixtral-8x7b", 8, 64, 10.0)]


def _timed_capture(model, tokens, full: bool):
    """(seconds, captured forward graph); `full` forces the whole-model export. The
    in-process memo of captures is off (capture_cache.py): a model captured before in
    this run (GPT-3 175B is the 96-layer row of the depth table) is exported again."""
    os.environ["AUTOHYBRID_CAPTURE_CACHE"] = "0"
    if full:
        os.environ["AUTOHYBRID_CAPTURE"] = "full"
    try:
        start = time.perf_counter()
        forward = capture(model, (tokens,), with_loss=False)
        return time.perf_counter() - start, forward
    finally:
        os.environ.pop("AUTOHYBRID_CAPTURE", None)
        os.environ.pop("AUTOHYBRID_CAPTURE_CACHE", None)


def search_table(models: list[str], nodes_list: list[int]) -> None:
    """Capture once per model, then the search per cluster size."""
    print(f"{'model':>10} {'params':>8} {'capture s':>9} {'GPUs':>6} {'search s':>9}  plan")
    for name in models:
        model = ah.models.preset(name, device="meta")
        (tokens,), _ = ah.models.example_batch(model, 8, device="meta")
        captured, forward = _timed_capture(model, tokens, full=False)
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
                  f"{searched:>9.2f}  {chosen}", flush=True)


def depth_table(full: bool) -> None:
    """Capture time against depth: it grows with distinct blocks, not with layers."""
    print(f"{'layers':>6} {'blocks s':>9} {'full s':>7}  same graph")
    for layers in DEPTHS:
        model = ah.models.gpt(layers=layers, device="meta", **GPT3)
        tokens = torch.randint(0, GPT3["vocab"], (8, GPT3["seq"]), device="meta")
        by_blocks, cap = _timed_capture(model, tokens, full=False)
        whole, same = "-", "-"
        if full:
            seconds, ref = _timed_capture(model, tokens, full=True)
            whole, same = f"{seconds:.1f}", str(ref.hash == cap.hash)
        print(f"{layers:>6} {by_blocks:>9.1f} {whole:>7}  {same}", flush=True)


def cli_table() -> None:
    """`autohybrid plan` end to end in a fresh process, wall clock against the goal."""
    print(f"{'model':>10} {'GPUs':>6} {'batch':>6} {'wall s':>7} {'goal s':>7}  plan")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      os.environ.get("PYTHONPATH")]))}
    for name, nodes, batch, goal in CLI_GOALS:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "plan.json")
            command = [sys.executable, "-m", "autohybrid.cli", "plan", name, "--cluster",
                       "dgx-a100-80gb", "--nodes", str(nodes), "--global-batch", str(batch),
                       "--out", out]
            start = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if done.returncode == 0:
                chosen = ah.Plan.from_json(out).summary()
            else:
                chosen = f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"
        print(f"{name:>10} {nodes * 8:>6} {batch:>6} {wall:>7.1f} {goal:>7.0f}  {chosen}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="gpt3-1.3b and gpt3-13b up to 128 nodes, 24 and 48 layers, no CLI")
    parser.add_argument("--full", action="store_true",
                        help="the depth table beside the full export (slow)")
    args = parser.parse_args()
    global DEPTHS
    if args.quick:
        DEPTHS = DEPTHS[:2]
    search_table(MODELS[:2] if args.quick else MODELS, NODES[:3] if args.quick else NODES)
    print()
    depth_table(args.full)
    if not args.quick:
        print()
        cli_table()


if __name__ == "__main__":
    main()
