"""Runs the passes in order on a copy of a graph: names the pass that fails, times each
one, and verifies after each the graph and, once the pipeline is split, every stage graph.

`AUTOHYBRID_DISABLE_PASSES=a,b` switches passes off by name (for bisecting; a name that
is no pass is refused, listing the valid ones);
`AUTOHYBRID_DEBUG=1` writes the graph after each pass (`NN_<pass>.py`), the plan and the
cost table under `$AUTOHYBRID_DUMP_DIR/rank<r>/` (default `./autohybrid_dump`).
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch.fx as fx

from ..blame import PassFailure
from ..errors import AutohybridError
from ..graph import fake_mode, lazy_graph_module, shared_fake_values, verify
from ..plan import Plan

log = logging.getLogger("autohybrid.passes")

Pass = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]


@dataclass
class PassContext:
    """What a pass may read: the Plan, this rank's mesh coordinates, graph facts.

    `notes` is the passes' scratch space while they run: where a pass leaves facts for
    later passes and for `rewrite` (e.g. the loss kind, the pipeline split), derived from
    the Plan and the graph only, so the same on every rank. What leaves `rewrite` is the
    frozen RankProgram built from it (autohybrid/program.py), never this dict.
    """

    plan: Plan
    rank: int
    coords: tuple[int, int, int]          # (pp, dp, tp)
    graph_kind: str = "train"             # "train" (model + loss) or "forward"
    #: weights the training graph split as a padded vocabulary (its loss is
    #: vocabulary-parallel); a forward graph, which has no loss to tell, pads them alike
    padded_params: frozenset[str] = frozenset()
    notes: dict[str, Any] = field(default_factory=dict)
    #: when a list, run_passes appends (pass name, copies of the graphs after it) for each
    #: pass that ran: {graph_kind: graph}, or {"stage<k>": graph} once the pipeline is
    #: split (`autohybrid inspect`, report/program.py); None: nothing kept
    snapshots: list[tuple[str, dict[str, fx.GraphModule]]] | None = None
    #: seconds each pass took, filled by run_passes in the order they ran
    pass_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.plan.mesh.dp


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with its own graph (nodes and their meta copied), same attributes."""
    graph = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, value_map)
    old_output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    graph.output(out).meta.update(old_output.meta)
    return lazy_graph_module(gm, graph)


def _snapshot(gm: fx.GraphModule, ctx: PassContext) -> dict[str, fx.GraphModule]:
    """Copies of the graphs as they stand: the pipeline's stages once it is split."""
    split = ctx.notes.get("pipeline")
    if split is None:
        return {ctx.graph_kind: copy_graph_module(gm)}
    return {f"stage{stage.index}": copy_graph_module(stage.gm) for stage in split.stages}


def _verify_all(gm: fx.GraphModule, ctx: PassContext, name: str) -> None:
    """The graph and, once the pipeline is split, every stage graph (what runs then)."""
    verify(gm, name)
    split = ctx.notes.get("pipeline")
    for stage in split.stages if split is not None else ():
        verify(stage.gm, f"{name}, stage {stage.index}", received=len(stage.received))


def disabled_passes(known: Iterable[str] | None = None) -> set[str]:
    """The pass names AUTOHYBRID_DISABLE_PASSES lists; with `known` (every pass's name),
    a name that is none of them is refused rather than silently switching nothing off."""
    names = {p.strip() for p in os.environ.get("AUTOHYBRID_DISABLE_PASSES", "").split(",")
             if p.strip()}
    if known is not None:
        known = list(known)
        unknown = sorted(names - set(known))
        if unknown:
            raise AutohybridError(
                f"AUTOHYBRID_DISABLE_PASSES names no pass: {', '.join(unknown)}; the passes "
                f"are {', '.join(known)}")
    return names


def dump_dir(rank: int) -> Path | None:
    if os.environ.get("AUTOHYBRID_DEBUG", "") in ("", "0"):
        return None
    root = Path(os.environ.get("AUTOHYBRID_DUMP_DIR", "autohybrid_dump"))
    path = root / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[tuple[str, Pass]],
               known: Iterable[str] | None = None) -> fx.GraphModule:
    """Apply `passes` in order to a copy of `gm`; the captured graph is never modified.
    `known`: every pass's name, which AUTOHYBRID_DISABLE_PASSES may use (default: those
    of `passes`). Fake values recomputed for identical ops on identical inputs are
    computed once (graph.shared_fake_values: a model's repeated blocks).

    Nor is the capture's ShapeEnv: the passes run with its guards suppressed. A fake
    kernel a pass reruns may ask for a concrete size (aten.gru's reads numel()), which
    otherwise records a guard and replaces the batch symbol by its example value for
    good; every later rewrite of that capture in the process (the memo reuses it) then
    saw a static batch, and global_loss, unable to prove the loss per sample, chose
    another loss form. Ranks with different histories (rank 0 ran the planner's trial,
    the others did not) then ran different loss forms and trained a GRU under tp2
    with wrong gradients. Every rewrite must be a function of the graph and the plan."""
    off = disabled_passes(known if known is not None else [name for name, _ in passes])
    mode = fake_mode(gm)
    env = getattr(mode, "shape_env", None)
    with shared_fake_values(), (env.suppress_guards() if env is not None else nullcontext()):
        return _run_passes(gm, ctx, passes, off)


def _run_passes(gm: fx.GraphModule, ctx: PassContext, passes: list[tuple[str, Pass]],
                off: set[str]) -> fx.GraphModule:
    gm = copy_graph_module(gm)
    dump = dump_dir(ctx.rank)
    if dump is not None:
        (dump / "plan.json").write_text(ctx.plan.to_json())
        (dump / f"00_{ctx.graph_kind}_capture.py").write_text(gm.print_readable(print_output=False))
    for index, (name, fn) in enumerate(passes, start=1):
        if name in off:
            log.info("pass %s disabled by AUTOHYBRID_DISABLE_PASSES", name)
            continue
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        try:
            result = fn(gm, ctx)
        except AutohybridError as exc:  # ours: tagged with the pass (PassTrial's reason)
            if getattr(exc, "pass_name", None) is None:
                exc.pass_name = name
            raise
        except Exception as exc:  # torch's, or a bug of ours: name the pass and node
            raise PassFailure.of(exc, name) from exc
        ctx.pass_seconds[name] = time.perf_counter() - start
        if not isinstance(result, fx.GraphModule):
            raise TypeError(f"pass {name!r} returned {type(result).__name__}, not a GraphModule")
        gm = result
        _verify_all(gm, ctx, name)
        log.info("pass %s: %d → %d nodes, %.3f s", name, before, len(gm.graph.nodes),
                 ctx.pass_seconds[name])
        if ctx.snapshots is not None:
            ctx.snapshots.append((name, _snapshot(gm, ctx)))
        if dump is not None:
            text = gm.print_readable(print_output=False)
            (dump / f"{index:02d}_{ctx.graph_kind}_{name}.py").write_text(text)
    # once, here: no pass runs a module, and its code is a function of its graph
    gm.recompile()
    split = ctx.notes.get("pipeline")
    for stage in split.stages if split is not None else ():
        stage.gm.recompile()
    return gm
