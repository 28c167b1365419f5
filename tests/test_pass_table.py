"""The pass table and the one driver (passes/__init__.py, passes/manager.py, rewrite.py).

No processes: the table's order is checked, AUTOHYBRID_DISABLE_PASSES refuses names that
are no pass, each pass is timed into the frozen RankProgram, and once the pipeline is
split every stage graph is verified after each pass, naming the pass and the stage.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import autohybrid as ah
from autohybrid import passes
from autohybrid.capture import capture
from autohybrid.errors import AutohybridError
from autohybrid.graph import GraphFormatError
from autohybrid.passes import ORDER, PASSES, PassRow, check_order
from autohybrid.passes.manager import disabled_passes
from autohybrid.program import RankProgram
from autohybrid.rewrite import rewrite


def _mlp():
    torch.manual_seed(0)
    model = ah.models.mlp(8, 16, 4, layers=4)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    return model, x, y, capture(model, (x,), F.mse_loss, y)


def test_the_table_runs_every_pass_after_those_it_must_follow():
    check_order(PASSES)
    assert ORDER == tuple(row.name for row in PASSES)
    assert all(row.why for row in PASSES)
    assert [name for name, _ in passes.passes_for("forward")] == \
        [row.name for row in PASSES if not row.train_only]


def test_a_reordered_table_is_refused_naming_both_passes():
    rows = list(PASSES)
    split = ORDER.index("pipeline_split")
    rows[split], rows[split + 1] = rows[split + 1], rows[split]   # recompute first
    with pytest.raises(AssertionError, match="'recompute' must run after 'pipeline_split'"):
        check_order(tuple(rows))
    ghost = (*PASSES, PassRow("late", lambda gm, ctx: gm, "test", after=("nowhere",)))
    with pytest.raises(AssertionError, match="'nowhere', which is no pass"):
        check_order(ghost)


def test_unknown_disabled_pass_names_are_refused_listing_the_passes(monkeypatch):
    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "overlap, fusoin")
    with pytest.raises(AutohybridError, match="names no pass: fusoin") as info:
        disabled_passes(ORDER)
    assert all(name in str(info.value) for name in ORDER)
    assert disabled_passes() == {"overlap", "fusoin"}   # unchecked without the names
    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "recompute,fusion")
    assert disabled_passes(ORDER) == {"recompute", "fusion"}


@pytest.mark.timeout(120)
def test_rewrite_refuses_an_unknown_disabled_pass(monkeypatch):
    model, x, y, cap = _mlp()
    plan = ah.plan(model, ah.Cluster.local(1), (x,), loss_fn=F.mse_loss, example_targets=y)
    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "tensor_paralel")
    with pytest.raises(AutohybridError, match="tensor_paralel.*the passes are global_loss"):
        rewrite(cap, plan, 0, fake_groups=True)


@pytest.mark.timeout(120)
def test_rewrite_returns_a_frozen_program_timed_per_pass(monkeypatch):
    model, x, y, cap = _mlp()
    plan = ah.plan(model, ah.Cluster.local(1), (x,), loss_fn=F.mse_loss, example_targets=y)
    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "fusion")
    program = rewrite(cap, plan, 0, fake_groups=True, snapshots=True)
    assert isinstance(program, RankProgram) and program.kind == "train"
    assert list(program.pass_seconds) == [n for n in ORDER if n != "fusion"]
    assert all(s >= 0 for s in program.pass_seconds.values())
    assert [name for name, _ in program.snapshots] == list(program.pass_seconds)
    assert program.loss_kind == "mean" and program.fused_regions == ()
    assert program.runnable.user_outputs[-1] == len(cap.user_outputs)  # the denominator
    with pytest.raises(dataclasses.FrozenInstanceError):
        program.loss_kind = "sum"
    with pytest.raises(TypeError):
        program.param_shards["x"] = None


@pytest.mark.timeout(120)
def test_every_stage_graph_is_verified_after_each_pass(monkeypatch):
    """A pass that breaks a stage's graph (not the rank's graph) is named, with the stage."""
    model, x, y, cap = _mlp()
    plan = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=F.mse_loss, example_targets=y,
                   constraints=ah.Constraints(pp=2, dp=1, tp=1, num_microbatches=2))
    assert rewrite(cap, plan, 0, fake_groups=True).pipeline is not None

    def break_stage_one(gm, ctx):
        stage = ctx.notes["pipeline"].stages[1]
        out = next(n for n in stage.gm.graph.nodes if n.op == "output")
        with stage.gm.graph.inserting_before(out):
            stage.gm.graph.call_function(torch.relu, (out.args[0],))   # not an ATen op
        return gm

    monkeypatch.setitem(passes.REGISTRY, "recompute", break_stage_one)
    with pytest.raises(GraphFormatError, match="after pass 'recompute, stage 1'"):
        rewrite(cap, plan, 0, fake_groups=True)
