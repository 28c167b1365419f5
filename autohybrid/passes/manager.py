"""Runs the registered passes in order on a copy of a graph, verifying after each.

`AUTOHYBRID_DISABLE_PASSES=a,b` switches passes off by name (for bisecting);
`AUTOHYBRID_DEBUG=1` writes the graph after each pass (`NN_<pass>.py`), the plan and the
cost table under `$AUTOHYBRID_DUMP_DIR/rank<r>/` (default `./autohybrid_dump`).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch.fx as fx

from ..blame import PassFailure
from ..errors import AutohybridError
from ..graph import shared_fake_values, verify
from ..plan import Plan

log = logging.getLogger("autohybrid.passes")

Pass = Callable[[fx.GraphModule, "PassContext"], fx.GraphModule]


@dataclass
class PassContext:
    """What a pass may read: the Plan, this rank's mesh coordinates, graph facts.

    `notes` is where a pass leaves facts for the runtime (e.g. the loss kind); it is
    derived from the Plan and the graph only, so it is the same on every rank.
    """

    plan: Plan
    rank: int
    coords: tuple[int, int, int]          # (pp, dp, tp)
    graph_kind: str = "train"             # "train" (model + loss) or "forward"
    notes: dict[str, Any] = field(default_factory=dict)
    #: when a list, run_passes appends (pass name, copies of the graphs after it) for each
    #: pass that ran: {graph_kind: graph}, or {"stage<k>": graph} once the pipeline is
    #: split (`autohybrid inspect`, report/program.py); None: nothing kept
    snapshots: list[tuple[str, dict[str, fx.GraphModule]]] | None = None

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
    return fx.GraphModule(gm, graph)


def _snapshot(gm: fx.GraphModule, ctx: PassContext) -> dict[str, fx.GraphModule]:
    """Copies of the graphs as they stand: the pipeline's stages once it is split."""
    split = ctx.notes.get("pipeline")
    if split is None:
        return {ctx.graph_kind: copy_graph_module(gm)}
    return {f"stage{stage.index}": copy_graph_module(stage.gm) for stage in split.stages}


def disabled_passes() -> set[str]:
    return {p.strip() for p in os.environ.get("AUTOHYBRID_DISABLE_PASSES", "").split(",")
            if p.strip()}


def dump_dir(rank: int) -> Path | None:
    if os.environ.get("AUTOHYBRID_DEBUG", "") in ("", "0"):
        return None
    root = Path(os.environ.get("AUTOHYBRID_DUMP_DIR", "autohybrid_dump"))
    path = root / f"rank{rank}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_passes(gm: fx.GraphModule, ctx: PassContext,
               passes: list[tuple[str, Pass]]) -> fx.GraphModule:
    """Apply `passes` in order to a copy of `gm`; the captured graph is never modified.
    Fake values recomputed for identical ops on identical inputs are computed once
    (graph.shared_fake_values: a model's repeated blocks)."""
    with shared_fake_values():
        return _run_passes(gm, ctx, passes)


def _run_passes(gm: fx.GraphModule, ctx: PassContext,
                passes: list[tuple[str, Pass]]) -> fx.GraphModule:
    gm = copy_graph_module(gm)
    off = disabled_passes()
    dump = dump_dir(ctx.rank)
    if dump is not None:
        (dump / "plan.json").write_text(ctx.plan.to_json())
        (dump / f"00_{ctx.graph_kind}_capture.py").write_text(gm.print_readable(print_output=False))
    for index, (name, fn) in enumerate(passes, start=1):
        if name in off:
            log.info("pass %s disabled by AUTOHYBRID_DISABLE_PASSES", name)
            continue
        before = len(gm.graph.nodes)
        try:
            result = fn(gm, ctx)
        except AutohybridError:
            raise
        except Exception as exc:  # torch's, or a bug of ours: name the pass and node
            raise PassFailure.of(exc, name) from exc
        if not isinstance(result, fx.GraphModule):
            raise TypeError(f"pass {name!r} returned {type(result).__name__}, not a GraphModule")
        gm = result
        verify(gm, name)
        log.info("pass %s: %d → %d nodes", name, before, len(gm.graph.nodes))
        if ctx.snapshots is not None:
            ctx.snapshots.append((name, _snapshot(gm, ctx)))
        if dump is not None:
            text = gm.print_readable(print_output=False)
            (dump / f"{index:02d}_{ctx.graph_kind}_{name}.py").write_text(text)
    gm.recompile()  # once: no pass runs the module, and its code is a function of the graph
    return gm
