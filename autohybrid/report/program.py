"""A rank's program rebuilt from a Plan alone: what `autohybrid inspect` prints and the
HTML report draws.

`plan.model_ref` names the model the plan was made for (a MODEL string:
models/spec.py); `rank_program(plan, rank)` rebuilds it on the meta device, captures the
training graph with its loss, checks that the graph planned (`plan.model_hash`: that
training graph, or the forward graph for a plan made without targets) is this model's,
and runs every pass for `rank` under torch's fake process group (no process is
started, nothing is allocated: autohybrid/rewrite.py, the `rewrite` ah.compile runs),
keeping the graph after each pass (`RankProgram.snapshots`).
"""
from __future__ import annotations

from typing import Sequence

from ..capture import CapturedGraph, capture, model_hashes
from ..errors import PlanError
from ..models import spec as model_spec
from ..plan import Plan
from ..program import RankProgram
from ..rewrite import rewrite


def rebuild(plan: Plan) -> model_spec.Workload:
    """The model the plan was made for, on the meta device, from `plan.model_ref`."""
    if not plan.model_ref:
        raise PlanError("this plan does not record its model (plan.model_ref is empty): make "
                        "it with `autohybrid plan MODEL` or ah.plan(..., model_ref='MODEL') "
                        "to inspect it later")
    return model_spec.parse(plan.model_ref).build(device="meta")


def check_model(plan: Plan, workload: model_spec.Workload,
                train: CapturedGraph | None = None) -> None:
    """Refuse a model whose graph is not the one the plan was made for: its training
    graph (`train`, captured if not given) or, for a plan made without targets, its
    forward graph (capture.model_hashes)."""
    if train is None and workload.targets is not None:
        train = capture(workload.model, workload.inputs, workload.loss_fn, workload.targets)
    forward = lambda: capture(workload.model, workload.inputs, with_loss=False)  # noqa: E731
    hashes = (model_hashes(plan.model_hash, train, forward) if train is not None
              else model_hashes(plan.model_hash, forward()))
    if plan.model_hash not in hashes.values():
        mine = ", ".join(f"{what} {h}" for what, h in hashes.items())
        raise PlanError(f"the model rebuilt from {plan.model_ref!r} has graph hashes "
                        f"{mine}; the plan was made for {plan.model_hash}: the model's code "
                        "or arguments changed since; plan it again")


def rank_programs(plan: Plan, ranks: Sequence[int] | None = None,
                  workload: model_spec.Workload | None = None,
                  check: bool = True) -> list[RankProgram]:
    """The programs of `ranks` (default: the first rank of each pp coordinate, one per
    group of stages) for `plan`: the model captured once, the passes run per rank."""
    if ranks is None:
        ranks = stage_representatives(plan)
    for rank in ranks:
        if not 0 <= rank < plan.world_size:
            raise PlanError(f"rank {rank} is outside the plan's {plan.world_size} ranks "
                            f"(0..{plan.world_size - 1})")
    workload = workload or rebuild(plan)
    train = capture(workload.model, workload.inputs, workload.loss_fn, workload.targets)
    if check:
        check_model(plan, workload, train)
    return [rewrite(train, plan, rank, snapshots=True, fake_groups=True) for rank in ranks]


def rank_program(plan: Plan, rank: int = 0, workload: model_spec.Workload | None = None,
                 check: bool = True) -> RankProgram:
    """Rank `rank`'s program for `plan` (see the module docstring)."""
    return rank_programs(plan, [rank], workload, check)[0]


def stage_representatives(plan: Plan) -> list[int]:
    """The first rank of each pp coordinate: together they run every pipeline stage."""
    mesh = plan.mesh
    return [pp * mesh.dp * mesh.tp for pp in range(mesh.pp)]
