"""Whether the passes accept a plan: the planner's trial of a candidate (`PassTrial`).

The search of `ah.plan` and `ah.compile` tries candidates best first and drops those a
pass rejects (search/planner.py): rank `rank`'s program is built with `rewrite` on fake
process groups (autohybrid/rewrite.py), and any AutohybridError a pass raises becomes
the reason the plan cannot run. `ah.compile` never reuses a trial's program: it rewrites
for its own rank on the job's groups (the trial ran on rank 0 only, on fake groups;
compiled._rewrite says why the program is rebuilt).
"""
from __future__ import annotations

import os
import time
from typing import Any

from .capture import CapturedGraph
from .errors import AutohybridError
from .passes import ORDER
from .plan import Plan
from .program import RankProgram
from .rewrite import rewrite

#: The Plan fields each pass reads (passes/*.py), in pass order: a pass fails or not on a
#: graph as a function of these and of the fields of the passes before it. A pass not
#: listed here is keyed by every field (_PLAN_FIELDS).
PASS_FIELDS: dict[str, tuple[str, ...]] = {
    "global_loss": ("shards",),
    "spatial_parallel": ("spatial", "tp", "dp"),
    "sync_batch_norm": ("dp",),
    "tensor_parallel": ("tp", "sp", "shardings", "spatial"),
    "sequence_parallel": ("tp", "sp"),
    "zero": ("zero", "dp", "gather_min_mb", "grad_reduce_dtype", "recompute",
             "stage_boundaries"),
    "collective_matmul": ("collective_matmul", "collective_matmul_layers", "tp", "sp"),
    "pipeline_split": ("pp", "num_stages", "stage_boundaries"),
    "recompute": ("recompute",),
}
#: Passes a trial leaves out: they never rule a plan out (fusion leaves a region it cannot
#: lower unfused, passes/fusion.py), and on a pinned plan the trial and the rewrite that
#: follows would otherwise run them twice (a third of a small model's rewrite time).
#: A trial with keep=True runs every pass: its program is used (the dry run).
NEVER_REFUSE: tuple[str, ...] = ("fusion",)
_PLAN_FIELDS = ("shards", "pp", "dp", "tp", "sp", "spatial", "num_stages", "stage_boundaries",
                "recompute", "zero", "gather_min_mb", "collective_matmul",
                "collective_matmul_layers", "shardings", "grad_reduce_dtype", "schedule",
                "num_microbatches")


def _field(plan: Plan, name: str) -> Any:
    if name == "shards":
        return plan.mesh.dp * plan.num_microbatches > 1
    if name in ("pp", "dp", "tp", "sp", "spatial"):
        return getattr(plan.mesh, name)
    return getattr(plan, name)


class PassTrial:
    """Whether the passes accept `graph` under a plan: rank `rank`'s program is built on
    fake process groups (`rewrite`), and any AutohybridError a pass raises (the manager
    tags it with the pass; a PassFailure names the pass and node of a torch error)
    becomes the reason the plan cannot run.

    Callable as `trial(plan) -> None | reason`. Results are cached by the Plan fields the
    passes read (PASS_FIELDS): a success by all of them, a failure by those of the
    failing pass and the passes before it, so one trial stands for every candidate the
    planner would build alike. `keep=True` keeps the last successful program
    (`kept(plan)`), for a caller that needs it anyway (the dry run).
    """

    def __init__(self, graph: CapturedGraph, rank: int = 0, example_inputs: tuple = (),
                 keep: bool = False):
        self.graph, self.rank, self.example_inputs, self.keep = graph, rank, example_inputs, keep
        self.ok: set[tuple] = set()
        self.failed: list[tuple[str, tuple, str]] = []   # (pass, its key, reason)
        self.trials = 0
        self.seconds = 0.0
        self._kept: tuple[tuple, RankProgram] | None = None

    @staticmethod
    def key(plan: Plan, upto: str | None = None) -> tuple:
        if upto is None or upto not in PASS_FIELDS:
            fields = _PLAN_FIELDS
        else:
            names = list(ORDER)
            fields = tuple(dict.fromkeys(
                f for name in names[:names.index(upto) + 1] if name in PASS_FIELDS
                for f in PASS_FIELDS[name]))
        return tuple(_field(plan, f) for f in fields)

    def __call__(self, plan: Plan) -> str | None:
        if not self.graph.with_loss and plan.mesh.tp == 1 and plan.mesh.pp == 1:
            return None  # compile rewrites a forward graph only for tp or pp (compiled.py)
        full = self.key(plan)
        if full in self.ok:
            return None
        for name, key, reason in self.failed:
            if self.key(plan, name) == key:
                return reason
        start = time.perf_counter()
        self.trials += 1
        debug = os.environ.pop("AUTOHYBRID_DEBUG", None)  # no dumps of trial programs
        try:
            result = rewrite(self.graph, plan, min(self.rank, plan.world_size - 1),
                             example_inputs=self.example_inputs, fake_groups=True,
                             skip=() if self.keep else NEVER_REFUSE)
        except Exception as exc:  # noqa: BLE001 - every failure rules the plan out
            name = getattr(exc, "pass_name", None)
            reason = (str(exc).strip().splitlines() or [""])[0]
            if not isinstance(exc, AutohybridError):
                reason = f"{type(exc).__name__}: {reason}"
            if name and f"pass {name!r}" not in reason:
                reason = f"pass {name!r}: {reason}"
            self.failed.append((name, self.key(plan, name), reason))
            return reason
        finally:
            self.seconds += time.perf_counter() - start
            if debug is not None:
                os.environ["AUTOHYBRID_DEBUG"] = debug
        self.ok.add(full)
        if self.keep:
            self._kept = (full, result)
        return None

    def kept(self, plan: Plan) -> RankProgram | None:
        """The program `rewrite` built for `plan` in a successful trial (keep=True)."""
        if self._kept is not None and self._kept[0] == self.key(plan) \
                and min(self.rank, plan.world_size - 1) == self.rank:
            return self._kept[1]
        return None
