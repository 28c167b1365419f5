"""`autohybrid` command line: plan, inspect, benchmark, train, calibrate, oracle.

    autohybrid plan gpt3-175b --cluster dgx-a100-80gb --nodes 128 --global-batch 1536
    autohybrid plan gpt-tiny --cluster local:4 --constrain pp=2,tp=2 --report report.html
    autohybrid inspect plan.json --rank 1 --pass tensor_parallel
    autohybrid bench gpt-tiny --cluster local:2 --steps 5 --out bench.json --plot bench.png
    autohybrid train gpt-tiny --cluster local:2 --steps 10      # or: train script.py -- ARGS
    autohybrid train gpt-tiny --steps 100 --save-dir ckpt --save-every 20 --resume
    autohybrid calibrate --world-size 2 --out calibration.json
    autohybrid oracle vgg16 --cluster dgx-a100-80gb --nodes 4 --global-batch 256

MODEL is a zoo preset (`autohybrid plan --list-models`) or `path/file.py:factory`, with
arguments after `?` (`gpt-tiny?layers=2&seq=32`: models/spec.py). Every command takes
`--json` (machine-readable output on stdout; the human-readable tables otherwise).
Exit status: 0 done, 2 bad input or no plan fits (the reason is printed, nothing is
left written), 1 a run failed. A MODEL naming `file.py:factory` is code (building the
model runs the file); `inspect` runs a plan's file only with --trust-model-code.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .errors import AutohybridError
from .cli_checks import Outputs, check_model_code, check_outputs, check_run_plan

EXIT_NO_PLAN = 2
EXIT_FAILED = 1


def _add_planning(p: argparse.ArgumentParser, cluster_default: str) -> None:
    p.add_argument("--cluster", default=cluster_default,
                   help="cluster preset (dgx-a100-80gb, dgx-h100, ...), FILE.json or local:N "
                        f"(default {cluster_default})")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes of a preset")
    p.add_argument("--global-batch", type=int, default=None,
                   help="samples per optimizer step (default: the example batch, 8)")
    p.add_argument("--seq", type=int, default=None, help="sequence length of token inputs")
    p.add_argument("--constrain", default="",
                   help="pin choices, e.g. tp=2,pp=2,zero=1 (ah.Constraints fields)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--calibration", default=None,
                   help="a profile from `autohybrid calibrate` (price with measured figures)")


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
    _add_planning(plan, "local:1")
    plan.add_argument("--dtype", default="bfloat16", help="training dtype (default bfloat16)")
    plan.add_argument("--out", default=None, help="write the plan JSON to this file")
    plan.add_argument("--report", default=None, help="write the HTML report to this file")
    plan.add_argument("--trace", default=None, metavar="FILE",
                      help="write the predicted per-rank timeline as Chrome trace / Perfetto "
                           "JSON (opens in chrome://tracing and ui.perfetto.dev)")
    plan.add_argument("--plots", default=None, metavar="DIR",
                      help="write timeline.png and memory.png (matplotlib) to DIR")
    plan.add_argument("--list-models", action="store_true", help="list the zoo presets and exit")
    inspect = sub.add_parser(
        "inspect", help="show a saved plan: mesh, stages, shards and each pass's graph",
        description="Rebuild the model a plan was made for (the plan records it) on the "
                    "meta device and run every pass for one rank without starting processes: "
                    "print the plan, where each rank runs, the stage and shard assignment and "
                    "the rank's graph after each pass.")
    inspect.add_argument("plan_file", help="a plan JSON from `autohybrid plan --out`")
    inspect.add_argument("--rank", type=int, default=0, help="which rank's program (default 0)")
    inspect.add_argument("--pass", dest="show_pass", default=None, metavar="NAME",
                         help="print the code of the graph after this pass ('capture': as "
                              "captured; 'all': after every pass)")
    inspect.add_argument("--dot", default=None, metavar="DIR",
                         help="write Graphviz DOT files of the rank's graphs to DIR")
    inspect.add_argument("--report", default=None, help="write the HTML report to this file")
    inspect.add_argument("--json", action="store_true", help="print machine-readable JSON")
    inspect.add_argument("--trust-model-code", action="store_true",
                         help="rebuild a model whose MODEL names a Python file (runs it)")
    bench = sub.add_parser(
        "bench", help="compiled vs eager vs hand-written PyTorch of the same layout",
        description="Train MODEL on a local cluster with the compiled plan, in eager PyTorch "
                    "on one process, and with PyTorch's own implementation of the plan's "
                    "layout (DDP / FSDP2 / DTensor / pipelining; n/a where PyTorch has none); "
                    "report step times (median and spread), throughput, peak memory, exposed "
                    "communication, the prediction and a loss check against eager.")
    bench.add_argument("model", help="zoo preset or path/file.py:factory")
    _add_planning(bench, "local:2")
    bench.add_argument("--steps", type=int, default=5, help="measured steps (default 5)")
    bench.add_argument("--warmup", type=int, default=2, help="warm-up steps (default 2)")
    bench.add_argument("--plan", default=None, help="a plan JSON to run (default: search)")
    bench.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    bench.add_argument("--lr", type=float, default=None,
                       help="learning rate (default 0.01 for sgd, 1e-3 for adamw)")
    bench.add_argument("--dtype", default=None,
                       help="training dtype (default: the model's, float32); bf16 / fp16 "
                            "over float32 parameters is mixed precision (autocast), eager "
                            "and the baseline run under the same autocast")
    bench.add_argument("--breakdown", action="store_true",
                       help="profile 5 steps of each variant and print where the time goes "
                            "(compute by kind, each collective exposed and hidden, optimizer) "
                            "beside the cost model's parts")
    bench.add_argument("--no-baselines", action="store_true",
                       help="skip the hand-written PyTorch baseline")
    bench.add_argument("--out", default=None, help="write the results JSON to this file")
    bench.add_argument("--plot", default=None, help="write a plot (.png/.svg) of the results")
    bench.add_argument("--report", default=None, help="write the HTML report with the results")
    bench.add_argument("--trace", default=None, metavar="FILE",
                       help="write the measured and predicted timelines as Chrome trace JSON")
    bench.add_argument("--plots", default=None, metavar="DIR",
                       help="write timeline.png (measured beside predicted) and memory.png")
    _add_start_method(bench)
    calib = sub.add_parser(
        "calibrate", help="measure this machine (matmul, element-wise, collectives)",
        description="Time matmuls, a large element-wise add and all-reduces of several sizes "
                    "on WORLD_SIZE local processes; fit the collective's latency and "
                    "bandwidth; write the profile JSON that `plan --calibration` reads.")
    calib.add_argument("--world-size", type=int, default=2, help="local processes (default 2)")
    calib.add_argument("--out", default="calibration.json", help="profile file to write")
    calib.add_argument("--repeats", type=int, default=5,
                       help="timings per measurement, the median kept (default 5; more is "
                            "steadier on a busy machine, 1 is quickest)")
    calib.add_argument("--json", action="store_true", help="print the profile as JSON")
    _add_start_method(calib)
    orc = sub.add_parser(
        "oracle", help="ParaDL per-strategy epoch time and memory of a CNN (no processes)",
        description="Capture MODEL on the meta device and print, per parallel strategy "
                    "(serial, data, spatial, filter, channel, pipeline, data×filter, "
                    "data×spatial), the per-epoch compute and communication time, the "
                    "memory per PE, the limit on p, which strategies break it, and the "
                    "ranking by total time (cost/oracle.py).")
    orc.add_argument("model", help="zoo preset (e.g. resnet50, vgg16, cosmoflow) or "
                                   "path/file.py:factory")
    orc.add_argument("--cluster", default="dgx-a100-80gb",
                     help="cluster preset, FILE.json or local:N (default dgx-a100-80gb)")
    orc.add_argument("--nodes", type=int, default=None, help="number of nodes of a preset")
    orc.add_argument("--global-batch", type=int, default=None,
                     help="samples per iteration B (default: the example batch, 8)")
    orc.add_argument("--dataset-size", type=int, default=1_281_167,
                     help="samples per epoch D (default 1281167, ImageNet-1k)")
    orc.add_argument("--strategy", default=None, help="only this strategy (default: all)")
    orc.add_argument("--segments", type=int, default=None,
                     help="pipeline micro-batches S (default min(B, 4p))")
    orc.add_argument("--calibration", default=None,
                     help="a profile from `autohybrid calibrate` (price with measured figures)")
    orc.add_argument("--json", action="store_true", help="print machine-readable JSON")
    train = sub.add_parser(
        "train", help="train a MODEL with its plan, or launch a script on local processes",
        description="MODEL: compile it for the local cluster (searching a plan, or --plan) "
                    "and train --steps steps on generated batches, printing the losses. "
                    "SCRIPT.py: run it on --cluster local:N processes with torchrun "
                    "(torch.distributed.run --standalone); arguments after `--` go to it: "
                    "autohybrid train job.py --cluster local:4 -- --epochs 2")
    train.add_argument("target", help="zoo preset, path/file.py:factory, or a script.py")
    _add_planning(train, "local:2")
    train.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    _add_start_method(train)
    train.add_argument("--plan", default=None, help="a plan JSON to run (default: search)")
    train.add_argument("--optimizer", default="adamw", choices=("sgd", "adamw"))
    train.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    train.add_argument("--save", default=None, help="save the trained full state dict here")
    train.add_argument("--save-dir", default=None, metavar="DIR",
                       help="write checkpoints (compiled.save) under DIR: every --save-every "
                            "steps and at the end")
    train.add_argument("--save-every", type=int, default=None, metavar="N",
                       help="a checkpoint every N steps (needs --save-dir)")
    train.add_argument("--keep-last", type=int, default=None, metavar="K",
                       help="keep only the K newest checkpoints (needs --save-dir)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint under --save-dir (a fresh "
                            "start when there is none) to --steps steps in all")
    train.add_argument("--dtype", default=None,
                       help="training dtype (default: the model's, float32); a --plan must "
                            "have been made for it")
    train.add_argument("--check", nargs="?", const="auto", default=None,
                       choices=("auto", "whole", "stage"),
                       help="compare the first step with a reference and stop, naming the "
                            "first parameter whose gradient differs: 'whole' (rank 0 holds an "
                            "eager copy), 'stage' (one rank per pipeline stage holds that "
                            "stage), 'auto' (the default: whole where it fits on one rank)")
    return parser


def _spec(text: str, seq: int | None = None):
    """A MODEL string → ModelSpec, with --seq applied (models/spec.py)."""
    from .models import spec

    return spec.parse(text).with_inputs(seq=seq)


def _constraints(text: str):
    from .models.spec import parse_value
    from .plan import Constraints

    pinned = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        pinned[key.strip()] = parse_value(value.strip())
    try:
        return Constraints(**pinned)
    except TypeError as exc:
        raise SystemExit(f"autohybrid: --constrain: {exc}") from None


def _console():
    """rich's console for the tables (stdout; plain text when it is not a terminal)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120, soft_wrap=False,
                   highlight=False)


def _with_progress(args: argparse.Namespace):
    """Install rich progress bars (on stderr) unless --json asks for quiet stdout."""
    from . import logs
    from .report.terminal import rich_progress_factory

    if not getattr(args, "json", False) and sys.stderr.isatty():
        from rich.console import Console

        logs.set_progress_factory(rich_progress_factory(Console(stderr=True)))


def _fail(command: str, exc: BaseException) -> int:
    """Print why `command` stopped; exit 1 when a run failed, 2 for bad input."""
    from .errors import RuntimeFailure

    print(f"autohybrid {command}: {exc}", file=sys.stderr)
    return EXIT_FAILED if isinstance(exc, RuntimeFailure) else EXIT_NO_PLAN


def _write_report(path: str, plan, *, measured=None, bench=None, program=None) -> None:
    """The HTML report of `plan`; its graph is rank 0's program (every stage's graph),
    rebuilt from `plan.model_ref` unless given."""
    from .report.html import write_report

    write_report(path, plan, programs=program, measured=measured, bench=bench)
    print(f"wrote {path}", file=sys.stderr)


def cmd_plan(args: argparse.Namespace) -> int:
    from . import api, models
    from .cluster import Cluster
    from .errors import AutohybridError, NoPlanFitsError
    from .report.terminal import print_plan

    if args.list_models:
        print("\n".join(sorted(models.PRESETS)))
        return 0
    if not args.model:
        print("autohybrid plan: give a MODEL (see --list-models)", file=sys.stderr)
        return EXIT_NO_PLAN
    _with_progress(args)
    start = time.perf_counter()
    try:
        check_outputs(args)
        cluster = Cluster.parse(args.cluster, nodes=args.nodes)
        spec = _spec(args.model, args.seq)
        work = spec.build(device="meta")
        # on the training graph (model + loss), as `train` and `bench` compile it: the
        # plan names that graph (a MODEL without targets: its forward graph)
        plan = api.plan(work.model, cluster, work.inputs, global_batch=args.global_batch,
                        dtype=args.dtype, constraints=_constraints(args.constrain),
                        loss_fn=work.loss_fn, example_targets=work.targets,
                        model_ref=spec.ref, calibration=args.calibration)
    except NoPlanFitsError as exc:
        print(f"no plan fits: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps({"fits": False, "reason": str(exc)}))
        return EXIT_NO_PLAN
    except (AutohybridError, ValueError, OSError) as exc:
        return _fail("plan", exc)
    elapsed = time.perf_counter() - start
    outputs = Outputs()
    try:
        program = None
        if args.report:  # rank 0's program from the model just planned: no second rebuild
            from .report.program import rank_program

            try:
                program = rank_program(plan, 0, workload=work, check=False)
            except AutohybridError:
                program = None  # the report rebuilds it and says why it cannot
        _write_files(args, plan, program=program, outputs=outputs)
        if args.out:
            plan.to_json(args.out)
            outputs.wrote([args.out])
    except (AutohybridError, ValueError, OSError) as exc:
        outputs.remove()  # no partial output
        return _fail("plan", exc)
    if args.json:
        print(plan.to_json(), end="")  # the JSON text ends in a newline already
    else:
        print_plan(plan, _console())
        print(f"(planned in {elapsed:.1f} s)")
    return 0


def _write_files(args: argparse.Namespace, plan, measured=None, bench=None,
                 program=None, outputs: Outputs | None = None) -> None:
    """--report, --trace and --plots of `plan` (with the measured run, if any). The
    predicted timeline (half a second for GPT-3's 1024 ranks) is built only for them."""
    outputs = outputs if outputs is not None else Outputs()
    if getattr(args, "report", None):
        _write_report(args.report, plan, measured=measured, bench=bench, program=program)
        outputs.wrote([args.report])
    if not (getattr(args, "trace", None) or getattr(args, "plots", None)):
        return
    from .report.timeline import predicted_timeline, write_chrome_trace

    predicted = predicted_timeline(plan)
    if getattr(args, "trace", None):
        timelines = (measured, predicted) if measured is not None else (predicted,)
        write_chrome_trace(args.trace, *timelines)
        outputs.wrote([args.trace])
        print(f"wrote {args.trace}", file=sys.stderr)
    if getattr(args, "plots", None):
        from .report.plots import plot_memory, plot_timeline

        folder = Path(args.plots)
        folder.mkdir(parents=True, exist_ok=True)
        others = (measured,) if measured is not None else ()
        written = [plot_timeline(predicted, folder / "timeline.png", others=others),
                   plot_memory(plan, folder / "memory.png")]
        outputs.wrote(written)
        print("wrote " + ", ".join(map(str, written)), file=sys.stderr)


def _shard_json(spec) -> dict[str, Any]:
    """A ShardSpec as `inspect` shows it (its inner split, expert tensor parallelism under
    ep, as "then")."""
    out = {"dim": spec.dim, "size": spec.size, "shard": spec.index, "of": spec.ways,
           "local_size": spec.shard_size}
    if spec.axis != "tp" or spec.inner is not None:
        out["axis"] = spec.axis
    if spec.inner is not None:
        out["then"] = _shard_json(spec.inner)
    return out


def inspect_data(plan, rank: int, show_pass: str | None = None) -> tuple[dict[str, Any], Any]:
    """What `inspect` shows, as JSON-able data, and the rank's program."""
    from .report.program import rank_program

    program = rank_program(plan, rank)
    placement = next(p for p in plan.placement if p.rank == rank)
    mesh = plan.mesh
    stage_ranks = plan.stage_ranks()
    starts = ("(first layer)",) + tuple(plan.stage_boundaries)
    stages = [{"stage": i, "pp_rank": stage_ranks[i], "starts_at": starts[i],
               "ranks": [r for r in range(plan.world_size)
                         if mesh.coords(r)[0] == stage_ranks[i]]}
              for i in range(plan.num_stages)] if mesh.pp > 1 else []
    mine = program.params()
    shards = {name: _shard_json(spec) for name, spec in sorted(program.param_shards.items())
              if name in mine}
    passes = []
    previous = {"train": program.captured.gm}
    for name, snapshot in program.snapshots:
        graphs = program.mine(snapshot)
        created = sum(1 for gm in graphs.values() for node in gm.graph.nodes
                      if node.meta.get("ah_pass") == name)
        codes = {kind: gm.code for kind, gm in graphs.items()}
        entry = {"pass": name, "graphs": {kind: len(gm.graph.nodes) for kind, gm in graphs.items()},
                 "nodes": sum(len(gm.graph.nodes) for gm in graphs.values()),
                 "changed": codes != {kind: gm.code for kind, gm in previous.items()},
                 "nodes_created": created}
        if show_pass in (name, "all"):
            entry["code"] = codes
        passes.append(entry)
        previous = graphs
    data = {
        "plan": plan.to_dict(), "summary": plan.summary(), "rank": rank,
        "coords": dict(zip(("pp", "dp", "tp"), program.coords)),
        "node": placement.node, "device": placement.device,
        "placement": [{"rank": p.rank, "node": p.node, "device": p.device,
                       "coords": dict(zip(("pp", "dp", "tp"), mesh.coords(p.rank)))}
                      for p in plan.placement],
        "stages": stages, "rank_stages": sorted(program.graphs()), "shards": shards,
        "captured_nodes": len(program.captured.gm.graph.nodes), "passes": passes,
        "autohybrid_ops": program.collectives(),
        "graphs": {k: len(g.graph.nodes) for k, g in program.graphs().items()},
    }
    if show_pass == "capture":
        data["capture_code"] = program.captured.gm.code
    if show_pass and show_pass not in ("capture", "all") and \
            show_pass not in [p["pass"] for p in passes]:
        raise ValueError(f"--pass {show_pass!r}: the passes are "
                         f"{', '.join(p['pass'] for p in passes)} (or 'capture', 'all')")
    return data, program


def cmd_inspect(args: argparse.Namespace) -> int:
    from .errors import AutohybridError
    from .plan import Plan

    try:
        check_outputs(args)
        plan = Plan.from_json(args.plan_file)
        check_model_code(plan, args.trust_model_code)
        data, program = inspect_data(plan, args.rank, args.show_pass)
        if args.dot:
            from .report.graphview import write_dot

            folder = Path(args.dot)
            folder.mkdir(parents=True, exist_ok=True)
            data["dot"] = [str(write_dot(folder / f"rank{args.rank}_{kind}.dot", gm))
                           for kind, gm in program.graphs().items()]
        if args.report:
            _write_report(args.report, plan, program=program if args.rank == 0 else None)
    except (AutohybridError, ValueError, OSError) as exc:
        return _fail("inspect", exc)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_inspect(plan, data, _console())
    return 0


def _print_inspect(plan, data: dict[str, Any], console) -> None:
    """inspect's tables: the plan, where ranks run, stages, shards, the passes."""
    from rich.table import Table

    from .report.terminal import print_plan

    print_plan(plan, console)
    coords = data["coords"]
    console.print(f"rank {data['rank']}: (pp, dp, tp) = ({coords['pp']}, {coords['dp']}, "
                  f"{coords['tp']}) on node {data['node']}, device {data['device']}; runs "
                  f"{', '.join(data['rank_stages'])}")
    where = Table(title="ranks", title_justify="left")
    for column in ("rank", "node", "device", "pp", "dp", "tp"):
        where.add_column(column, justify="right")
    for p in data["placement"]:
        where.add_row(*(str(x) for x in (p["rank"], p["node"], p["device"], *p["coords"].values())))
    console.print(where)
    if data["stages"]:
        stages = Table(title="pipeline stages", title_justify="left")
        for column in ("stage", "pp rank", "starts at", "ranks"):
            stages.add_column(column)
        for st in data["stages"]:
            stages.add_row(str(st["stage"]), str(st["pp_rank"]), st["starts_at"],
                           ", ".join(map(str, st["ranks"])))
        console.print(stages)
    if data["shards"]:
        shards = Table(title=f"tensor-parallel shards on rank {data['rank']}",
                       title_justify="left")
        for column in ("parameter", "dim", "full", "shard", "local"):
            shards.add_column(column)
        for name, sh in data["shards"].items():
            cuts = [sh] + ([sh["then"]] if "then" in sh else [])
            shards.add_row(name, *(" then ".join(str(c[k]) for c in cuts)
                                   for k in ("dim", "size")),
                           " then ".join(f"{c['shard']}/{c['of']} {c.get('axis', 'tp')}"
                                         if len(cuts) > 1 or "axis" in c
                                         else f"{c['shard']}/{c['of']}" for c in cuts),
                           " then ".join(str(c["local_size"]) for c in cuts))
        console.print(shards)
    passes = Table(title=f"rank {data['rank']}'s graph after each pass "
                         f"(captured: {data['captured_nodes']} nodes)", title_justify="left")
    for column in ("pass", "graphs (nodes)", "changed", "nodes it created"):
        passes.add_column(column)
    for p in data["passes"]:
        passes.add_row(p["pass"], ", ".join(f"{k} {v}" for k, v in p["graphs"].items()),
                       "yes" if p["changed"] else "-", str(p["nodes_created"] or "-"))
    console.print(passes)
    ops = ", ".join(f"{k} {v}" for k, v in data["autohybrid_ops"].items()) or "none"
    console.print(f"autohybrid ops in this rank's graphs: {ops}")
    for p in data["passes"]:
        for kind, code in p.get("code", {}).items():
            print(f"\n# {kind} after pass {p['pass']}\n{code}")
    if "capture_code" in data:
        print(f"\n# graph as captured\n{data['capture_code']}")


def _add_start_method(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--start-method", default=None, choices=("fork", "spawn", "forkserver"),
                        help="how the local ranks start (default: spawn on CUDA, fork on CPU)")


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench
    from .cluster import Cluster
    from .errors import AutohybridError
    from .plan import Plan
    from .report.terminal import print_bench

    _with_progress(args)
    try:
        check_outputs(args)
        cluster = Cluster.parse(args.cluster, nodes=args.nodes)
        spec = _spec(args.model, args.seq)
        plan = _run_plan(args.plan, spec, cluster, args.dtype, "bench")
        result = bench(spec.ref, cluster, global_batch=args.global_batch, steps=args.steps,
                       warmup=args.warmup, plan=plan, dtype=args.dtype,
                       constraints=_constraints(args.constrain) if args.constrain else None,
                       optimizer=args.optimizer, lr=args.lr, baselines=not args.no_baselines,
                       json_path=args.out, plot_path=args.plot,
                       start_method=args.start_method, breakdown=args.breakdown,
                       calibration=args.calibration)
    except (AutohybridError, ValueError, OSError) as exc:
        return _fail("bench", exc)
    try:
        from .report.timeline import Timeline

        measured = (Timeline.from_dict(result.measured_timeline)
                    if result.measured_timeline else None)
        _write_files(args, Plan.from_dict(result.full_plan), measured=measured,
                     bench=result.to_dict())
    except (AutohybridError, ValueError, OSError) as exc:
        return _fail("bench", exc)
    if args.json:
        print(result.to_json(), end="")
    else:
        print_bench(result.to_dict(), _console())
        if args.breakdown:
            print("\nwhere the time goes (median of the profiled steps, slowest rank):")
            print(result.format_breakdown())
    return 0 if result.to_dict()["loss_check"]["ok"] else EXIT_FAILED


def _run_plan(path: str | None, spec, cluster, dtype: str | None, command: str = "train"):
    """The `--plan` of train / bench, checked against this run before any rank starts:
    the MODEL builds (on the meta device), and the plan is for this world size, the
    MODEL's parameters and the run's dtype (`dtype`; None: the model's own)."""
    from .plan import Plan
    from .planning import dtype_name

    workload = spec.build(device="meta")  # a bad MODEL argument fails here, not in ranks
    if path is None:
        return None
    plan = Plan.from_json(path)
    check_run_plan(plan, workload, cluster.world_size, dtype_name(dtype, workload.model),
                   command)
    return plan


def _train_rank(rank: int, ref: str, cluster: Any, steps: int, plan_json: str | None,
                constraints: Any, global_batch: int | None, optimizer: str, lr: float,
                save: str | None, check: str | None = None,
                fit_options: dict[str, Any] | None = None,
                dtype: str | None = None) -> dict[str, Any]:
    """One rank of `autohybrid train MODEL`: compile, train to `steps` steps through
    compiled.fit (checkpoints and resume: `fit_options`), report."""
    import torch

    from . import api
    from .baselines import Optim
    from .bench import OPTIMIZERS
    from .models import spec as model_spec
    from .plan import Plan

    work = model_spec.parse(ref).build(device="cpu", seed=0)
    batch = global_batch or work.spec.batch
    batches = work.batches(steps, batch=batch, seed=1)
    make = Optim(OPTIMIZERS[optimizer][0], {"lr": lr})  # as ah.bench builds it
    inputs, targets = batches[0]
    compiled = api.compile(work.model, cluster, inputs, loss_fn=work.loss_fn,
                           example_targets=targets, optimizer=make,
                           plan=Plan.from_json(plan_json) if plan_json else None,
                           constraints=constraints, global_batch=batch, dtype=dtype,
                           check=True if check == "auto" else (check or False))
    # the batches are one epoch of `steps`: a resume at step k skips the first k
    result = compiled.fit(batches, steps=steps, **(fit_options or {}))
    state = compiled.full_state_dict()  # every rank takes part in the gather
    if rank == 0 and save:
        torch.save(state, save)
    return {"losses": result.losses, "step_s": result.step_s, "plan": compiled.plan.to_dict(),
            "summary": compiled.plan.summary(), "start_step": result.start_step,
            "resumed_from": result.resumed_from, "checkpoints": result.checkpoints,
            "tokens_per_s": result.tokens_per_s}


def cmd_train(args: argparse.Namespace) -> int:
    from .cluster import Cluster
    from .errors import AutohybridError
    from .runtime.launch import launch

    target = args.target
    if target.endswith(".py") and ":" not in target:
        return _train_script(args)
    try:
        cluster = Cluster.parse(args.cluster, nodes=args.nodes)
        if cluster.nodes != 1 or not args.cluster.startswith("local:"):
            raise ValueError(f"train runs on this machine: give --cluster local:N, not "
                             f"{args.cluster!r} (on a real cluster, run your script under "
                             "torchrun with ah.Cluster.from_env())")
        if args.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {args.steps}")
        fit_options = _fit_options(args)
        check_outputs(args)
        spec = _spec(target, args.seq)
        constraints = _constraints(args.constrain) if args.constrain else None
        _run_plan(args.plan, spec, cluster, args.dtype)
        if args.calibration is not None:   # the ranks plan with the measured figures
            from .api import load_calibration

            cluster = load_calibration(args.calibration).apply(cluster)
        results = launch(_train_rank, cluster, args=(
            spec.ref, cluster, args.steps, args.plan, constraints,
            args.global_batch, args.optimizer, args.lr, args.save, args.check, fit_options,
            args.dtype), start_method=args.start_method)
    except (AutohybridError, ValueError, OSError) as exc:
        return _fail("train", exc)
    first = results[0]
    agree = all(r["losses"] == first["losses"] for r in results)
    out = {"model": spec.ref, "cluster": args.cluster, "plan": first["plan"],
           "losses": first["losses"], "step_s": first["step_s"], "ranks_agree": agree,
           "saved": args.save, "checked": args.check, "start_step": first["start_step"],
           "resumed_from": first["resumed_from"], "checkpoints": first["checkpoints"],
           "tokens_per_s": first["tokens_per_s"]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"trained {spec.ref} on {args.cluster} with plan {first['summary']}")
        if first["resumed_from"]:
            print(f"  resumed from {first['resumed_from']} at step {first['start_step']}")
        for step, (loss, s) in enumerate(zip(first["losses"], first["step_s"]),
                                         start=first["start_step"]):
            print(f"  step {step:>3}  loss {loss:.6f}  {s * 1e3:8.1f} ms")
        if first["checkpoints"]:
            print(f"  checkpoints: {', '.join(first['checkpoints'])}")
        if args.check:
            print(f"  the first step's loss and gradients equal the reference's "
                  f"(--check {args.check})")
        print(f"all {len(results)} ranks report the same losses: {agree}"
              + (f"; saved the full state dict to {args.save}" if args.save else ""))
    return 0 if agree else EXIT_FAILED


def _fit_options(args: argparse.Namespace) -> dict[str, Any]:
    """compiled.fit's checkpoint options from train's flags, checked before any launch."""
    for flag, value in (("--save-every", args.save_every), ("--keep-last", args.keep_last)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
        if value is not None and args.save_dir is None:
            raise ValueError(f"{flag} needs --save-dir DIR, where checkpoints are written")
    if args.resume and args.save_dir is None:
        raise ValueError("--resume needs --save-dir DIR, the directory to resume from")
    if args.resume and args.check:
        raise ValueError("--check compares the first step with eager from the model's "
                         "initial weights, and --resume starts from a checkpoint's: run "
                         "the check without --resume")
    # a bar on a terminal; elsewhere the table below is the log (and --json stays JSON)
    quiet = args.json or not sys.stdout.isatty()
    return {"save_dir": args.save_dir, "save_every": args.save_every,
            "keep_last": args.keep_last, "resume": args.resume,
            "log_every": None if quiet else 1}


def _train_script(args: argparse.Namespace) -> int:
    """`train script.py`: torchrun --standalone --nproc-per-node N script.py ARGS."""
    if not Path(args.target).is_file():
        print(f"autohybrid train: no such script {args.target!r}", file=sys.stderr)
        return EXIT_NO_PLAN
    cluster = args.cluster
    if not cluster.startswith("local:") or not cluster[6:].isdigit() or int(cluster[6:]) < 1:
        print(f"autohybrid train: a script runs on --cluster local:N, got {cluster!r}",
              file=sys.stderr)
        return EXIT_NO_PLAN
    if args.calibration is not None:
        print("autohybrid train: a script plans itself, so --calibration does not reach "
              "it; apply the profile there (from autohybrid.calibrate import Profile; "
              "cluster = Profile.from_json(FILE).apply(ah.Cluster.from_env()))",
              file=sys.stderr)
        return EXIT_NO_PLAN
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={cluster[6:]}", args.target, *args.script_args]
    print("+ " + " ".join(command), file=sys.stderr)
    return subprocess.call(command)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate
    from .cluster import Cluster
    from .errors import AutohybridError, UsageError

    _with_progress(args)
    try:
        check_outputs(args)
        if args.world_size < 1:
            raise UsageError(f"--world-size must be at least 1, got {args.world_size}")
        if args.repeats < 1:
            raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
        profile = calibrate(Cluster.local(args.world_size) if args.world_size > 1 else None,
                            repeats=args.repeats, start_method=args.start_method)
        profile.to_json(args.out)
    except (AutohybridError, OSError) as exc:
        return _fail("calibrate", exc)
    if args.json:
        print(profile.to_json(), end="")
    else:
        flops = ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in profile.matmul_flops.items())
        print(f"matmul {flops}; element-wise {profile.memory_bandwidth / 1e9:.1f} GB/s")
        for dtype, speedup in profile.alone_speedup.items():
            print(f"a rank computing alone: {speedup:.2f}× its {dtype} matmul rate beside the "
                  f"other ranks (ranks sharing cores; priced in pipeline bubbles)")
        if profile.all_reduce_latency_s is not None:
            bw = profile.all_reduce_bandwidth or float("inf")
            print(f"all-reduce on {profile.world_size} ranks: α = "
                  f"{profile.all_reduce_latency_s * 1e6:.1f} µs, 1/β = {bw / 1e9:.2f} GB/s")
        print(f"wrote {args.out} (profile {profile.hash()})")
    return 0


def cmd_oracle(args: argparse.Namespace) -> int:
    from . import api
    from .cluster import Cluster

    try:
        cluster = Cluster.parse(args.cluster, nodes=args.nodes)
        spec = _spec(args.model, None)
        work = spec.build(device="meta")
        result = api.oracle(work.model, cluster, work.inputs, dataset_size=args.dataset_size,
                            global_batch=args.global_batch, strategy=args.strategy,
                            segments=args.segments, calibration=args.calibration,
                            model_name=spec.ref)
    except (AutohybridError, ValueError, OSError) as exc:
        return _fail("oracle", exc)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(result.table())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:  # what follows goes to a script run by `train`
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.script_args = extra
    commands = {"plan": cmd_plan, "calibrate": cmd_calibrate, "inspect": cmd_inspect,
                "bench": cmd_bench, "train": cmd_train, "oracle": cmd_oracle}
    if args.command not in commands:
        parser.print_help()
        return 0
    try:
        return commands[args.command](args)
    except AutohybridError as exc:  # whatever a command did not catch: no traceback
        return _fail(args.command, exc)


if __name__ == "__main__":
    sys.exit(main())
