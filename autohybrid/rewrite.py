"""The one compile pipeline step after planning: `rewrite(captured, plan, rank)` runs the
passes for one rank and returns its frozen RankProgram (autohybrid/program.py).

Every caller uses it: `ah.compile` (compiled.py, on the process groups of the job),
the planner's trial of a plan (trial.py), the dry run at scale (runtime/dry_run.py),
`autohybrid inspect` and the report (report/program.py). Those without a job bind each
mesh axis to torch's fake process group of its size (`fake_groups=True`, or the
`fake_process_groups` context manager around any code): nothing is allocated and no
message is sent, but every pass runs exactly as on rank `rank` of the real job.

The passes leave their facts in `PassContext.notes` while they run; this module is the
only reader of that scratch space, and what leaves it is the RankProgram.
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext
from types import MappingProxyType
from typing import Any, Iterator

from . import ops
from .capture import CapturedGraph
from .passes import ORDER, PassContext, passes_for, run_passes
from .plan import AXES, Plan, expert_groups, spatial_groups
from .program import RankProgram

#: The notes the passes leave (passes/*.py) → the RankProgram field each becomes.
NOTE_FIELDS = {
    "loss_kind": "loss_kind", "loss_output_index": "loss_output_index",
    "stats_output_index": "stats_output_index",
    "pipeline": "pipeline", "param_shards": "param_shards", "tp_layout": "tp_layout",
    "fusion": "fused_regions", "zero_gathers": "zero_gathers",
    "overlap_moved": "overlap_moved", "overlap_split": "overlap_split",
    "collective_matmuls": "collective_matmuls", "batch_equalities": "batch_equalities",
}


def rewrite(captured: CapturedGraph, plan: Plan, rank: int, *, example_inputs: tuple = (),
            snapshots: bool = False, fake_groups: bool = False,
            skip: tuple[str, ...] = (), padded_params: frozenset[str] = frozenset()
            ) -> RankProgram:
    """Rank `rank`'s program for `captured` under `plan`.

    `example_inputs` give the device of a graph captured under autocast (the passes'
    fake values follow autocast, as the graph runs); `snapshots=True` keeps a copy of the
    graphs after each pass (`RankProgram.snapshots`); `fake_groups=True` runs the passes
    on fake process groups (`fake_process_groups`), else on the groups bound now.
    `skip` names passes left out (the planner's trial leaves out those that never refuse
    a plan: trial.py `NEVER_REFUSE`); a name not in the pass table is refused.
    `padded_params`: the weights a training program split as a padded vocabulary, for a
    forward graph rewritten after it (tensor_parallel pads them alike).
    """
    unknown = sorted(set(skip) - set(ORDER))
    if unknown:
        raise ValueError(f"rewrite(skip=...): no pass named {unknown}; the passes are "
                         f"{', '.join(ORDER)}")
    with fake_process_groups(plan, rank) if fake_groups else nullcontext():
        kind = "train" if captured.with_loss else "forward"
        ctx = PassContext(plan=plan, rank=rank, coords=plan.mesh.coords(rank),
                          graph_kind=kind, snapshots=[] if snapshots else None,
                          padded_params=padded_params)
        if captured.with_loss:
            ctx.notes["loss_output_index"] = captured.user_outputs[0]
            if len(captured.user_outputs) == 2:   # (loss, per-sample statistics)
                ctx.notes["stats_output_index"] = captured.user_outputs[1]
        with captured.autocast_context(example_inputs):
            passes = [(name, fn) for name, fn in passes_for(kind) if name not in skip]
            gm = run_passes(captured.gm, ctx, passes, known=ORDER)
    return _program(captured, gm, ctx)


def _program(captured: CapturedGraph, gm: Any, ctx: PassContext) -> RankProgram:
    """The frozen RankProgram of a finished PassContext."""
    unknown = sorted(set(ctx.notes) - set(NOTE_FIELDS))
    if unknown:  # a pass left a fact nobody would read: give it a RankProgram field
        raise AssertionError(f"rewrite: the passes left notes {unknown} that RankProgram "
                             "has no field for (autohybrid/rewrite.py NOTE_FIELDS)")
    facts: dict[str, Any] = {NOTE_FIELDS[k]: v for k, v in ctx.notes.items()}
    if "param_shards" in facts:
        facts["param_shards"] = MappingProxyType(dict(facts["param_shards"]))
    if "fused_regions" in facts:
        facts["fused_regions"] = tuple(facts["fused_regions"])
    outputs = list(captured.user_outputs)
    if captured.with_loss:  # global_loss appended the denominator as the last output
        outputs.append(len(captured.mutated_buffers) + len(captured.user_outputs))
    return RankProgram(
        plan=ctx.plan, rank=ctx.rank, coords=ctx.coords, kind=ctx.graph_kind,
        captured=captured,
        runnable=dataclasses.replace(captured, gm=gm, user_outputs=outputs),
        pass_seconds=MappingProxyType(dict(ctx.pass_seconds)),
        snapshots=tuple((name, MappingProxyType(graphs))
                        for name, graphs in ctx.snapshots or ()),
        **facts)


@contextmanager
def fake_process_groups(plan: Plan, rank: int) -> Iterator[None]:
    """Each mesh axis of `plan` bound, for rank `rank`, to torch's standalone fake process
    group of its size; the previous bindings restored on exit.

    No default process group is created or touched, so this works in any process, also
    on a rank of a live job (`ah.compile`'s trial of a plan)."""
    from torch._C._distributed_c10d import FakeProcessGroup

    saved = ops.groups.snapshot()
    try:
        ops.groups.clear()
        sizes = (plan.mesh.pp, plan.mesh.dp, plan.mesh.tp)
        for axis, size, index in zip(AXES, sizes, plan.mesh.coords(rank)):
            ops.groups.bind(axis, FakeProcessGroup._create_internal(index, size)
                            if size > 1 else None)
        extra = {**spatial_groups(plan.mesh), **expert_groups(plan.mesh)}
        for axis, rows in extra.items():
            row = next(r for r in rows if rank in r)
            ops.groups.bind(axis, FakeProcessGroup._create_internal(row.index(rank), len(row)))
        yield
    finally:
        ops.groups.restore(saved)
