"""`autohybrid` command line: plan a model for a cluster, calibrate this machine.

    autohybrid plan gpt3-175b --cluster dgx-a100-80gb --nodes 128 --global-batch 1536
    autohybrid calibrate --world-size 2 --out calibration.json

MODEL is a zoo preset (`autohybrid plan --list-models`) or `path/file.py:factory`.
Exit status: 0 a plan was found, 2 no plan fits (the numbers are printed) or bad input.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Sequence

EXIT_NO_PLAN = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autohybrid",
        description="Automatic hybrid-parallel training for PyTorch models.",
        epilog="Run `autohybrid COMMAND --help` for the options of a command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    plan = sub.add_parser(
        "plan", help="choose a parallel plan for a model on a cluster (no processes started)",
        description="Capture MODEL on the meta device, search the plan with the shortest "
                    "predicted step time that fits in memory, and print it. Exit status 2 "
                    "when no plan fits (the memory figures are printed).")
    plan.add_argument("model", nargs="?", help="zoo preset (e.g. gpt3-175b) or path/file.py:factory")
    plan.add_argument("--cluster", default="local:1",
                      help="cluster preset (dgx-a100-80gb, dgx-h100, ...), FILE.json or local:N")
    plan.add_argument("--nodes", type=int, default=None, help="number of nodes of a preset")
    plan.add_argument("--global-batch", type=int, default=None,
                      help="samples per optimizer step (default: the example batch, 8)")
    plan.add_argument("--seq", type=int, default=None, help="sequence length of token inputs")
    plan.add_argument("--dtype", default="bfloat16", help="training dtype (default bfloat16)")
    plan.add_argument("--constrain", default="",
                      help="pin choices, e.g. zero=1,num_microbatches=4 (ah.Constraints fields)")
    plan.add_argument("--out", default=None, help="write the plan JSON to this file")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--list-models", action="store_true", help="list the zoo presets and exit")
    plan.add_argument("--calibration", default=None,
                      help="a profile from `autohybrid calibrate` (price with measured figures)")
    calib = sub.add_parser(
        "calibrate", help="measure this machine (matmul, element-wise, collectives)",
        description="Time matmuls, a large element-wise add and all-reduces of several sizes "
                    "on WORLD_SIZE local processes; fit the collective's latency and "
                    "bandwidth; write the profile JSON that `plan --calibration` reads.")
    calib.add_argument("--world-size", type=int, default=2, help="local processes (default 2)")
    calib.add_argument("--out", default="calibration.json", help="profile file to write")
    calib.add_argument("--json", action="store_true", help="print the profile as JSON")
    return parser


def load_model(spec: str, device: str = "meta"):
    """A zoo preset name or `path/file.py:factory` → (model, example inputs)."""
    from . import models

    if ":" in spec and spec.split(":")[0].endswith(".py"):
        path, factory = spec.rsplit(":", 1)
        module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        if module_spec is None or not Path(path).exists():
            raise SystemExit(f"autohybrid: cannot load {path!r}: no such file")
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        result = getattr(module, factory)()
        if not isinstance(result, tuple) or len(result) != 2:
            raise SystemExit(f"autohybrid: {spec} must return (model, example_inputs)")
        return result
    model = models.preset(spec, device=device)
    inputs, _ = models.example_batch(model, batch=8, device=device)
    return model, inputs


def _constraints(text: str):
    from .plan import Constraints

    pinned = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        lowered = value.strip().lower()
        if lowered in ("true", "false"):
            pinned[key.strip()] = lowered == "true"
        else:
            try:
                pinned[key.strip()] = int(value)
            except ValueError:
                try:
                    pinned[key.strip()] = float(value)
                except ValueError:
                    pinned[key.strip()] = value.strip()
    try:
        return Constraints(**pinned)
    except TypeError as exc:
        raise SystemExit(f"autohybrid: --constrain: {exc}") from None


def cmd_plan(args: argparse.Namespace) -> int:
    import torch

    from . import api, models
    from .cluster import Cluster
    from .errors import AutohybridError, NoPlanFitsError
    from .report.text import format_plan

    if args.list_models:
        print("\n".join(sorted(models.PRESETS)))
        return 0
    if not args.model:
        print("autohybrid plan: give a MODEL (see --list-models)", file=sys.stderr)
        return EXIT_NO_PLAN
    start = time.perf_counter()
    try:
        cluster = Cluster.parse(args.cluster, nodes=args.nodes)
        model, inputs = load_model(args.model)
        if args.seq is not None:
            inputs = tuple(t[:, : args.seq] if t.dim() >= 2 else t for t in inputs)
        plan = api.plan(model, cluster, inputs, global_batch=args.global_batch,
                        dtype=args.dtype, constraints=_constraints(args.constrain),
                        model_ref=args.model, calibration=args.calibration)
    except NoPlanFitsError as exc:
        print(f"no plan fits: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"fits": False, "reason": str(exc)}))
        return EXIT_NO_PLAN
    except (AutohybridError, ValueError) as exc:
        print(f"autohybrid plan: {exc}", file=sys.stderr)
        return EXIT_NO_PLAN
    elapsed = time.perf_counter() - start
    if args.out:
        plan.to_json(args.out)
    if args.json:
        print(plan.to_json(), end="")  # the JSON text ends in a newline already
    else:
        print(format_plan(plan))
        print(f"(planned in {elapsed:.1f} s)")
    del torch
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate
    from .cluster import Cluster
    from .errors import AutohybridError

    try:
        profile = calibrate(Cluster.local(args.world_size) if args.world_size > 1 else None)
    except AutohybridError as exc:
        print(f"autohybrid calibrate: {exc}", file=sys.stderr)
        return EXIT_NO_PLAN
    profile.to_json(args.out)
    if args.json:
        print(profile.to_json(), end="")
    else:
        flops = ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in profile.matmul_flops.items())
        print(f"matmul {flops}; element-wise {profile.memory_bandwidth / 1e9:.1f} GB/s")
        if profile.all_reduce_latency_s is not None:
            bw = profile.all_reduce_bandwidth or float("inf")
            print(f"all-reduce on {profile.world_size} ranks: α = "
                  f"{profile.all_reduce_latency_s * 1e6:.1f} µs, 1/β = {bw / 1e9:.2f} GB/s")
        print(f"wrote {args.out} (profile {profile.hash()})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        return cmd_plan(args)
    if args.command == "calibrate":
        return cmd_calibrate(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
