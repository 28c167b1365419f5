"""Executable means executed: the search of `ah.plan` (by default too) and `ah.compile`
builds a candidate's program for one rank on fake process groups before choosing it
(trial.py PassTrial), tries the next candidate when a pass rejects one, and keeps
the pass's reason in `plan.alternatives`; only the chosen plan is marked executable, and
alternatives whose passes were not run say so. `ah.compile` keeps the trial's program
for the ranks it is the program of. No processes: the trial binds each mesh axis to
torch's standalone FakeProcessGroup, also inside a live job.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autohybrid as ah
from autohybrid import models, ops, passes
from autohybrid.planning import make_plan
from autohybrid.capture import capture
from autohybrid.errors import AutohybridError
from autohybrid.models.coverage import RNNLM, lm_loss
from autohybrid.plan import Mesh, Plan
from autohybrid.rewrite import rewrite
from autohybrid.trial import PassTrial


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def _gpt_tiny():
    model = models.preset("gpt-tiny")
    inputs, targets = models.example_batch("gpt-tiny", 8)
    return model, inputs, targets


def _untried(model, cluster, inputs, loss_fn, targets) -> Plan:
    """The cost model's choice: a trial that accepts every plan (nothing rewritten)."""
    train = capture(model, inputs, loss_fn, targets)
    return make_plan(train, train, model, cluster, inputs, None, None, None, "adam",
                     executable_only=False, trial=lambda plan: None)


def _pinned(mesh: Mesh) -> ah.Constraints:
    """Constraints that leave only `mesh`."""
    kwargs = dict(dp=mesh.dp, tp=mesh.tp, pp=mesh.pp)
    if mesh.tp > 1:
        kwargs["sp"] = mesh.sp
    return ah.Constraints(**kwargs)


@pytest.mark.timeout(120)
def test_a_candidate_a_pass_rejects_gives_way_to_the_next(monkeypatch) -> None:
    model, inputs, targets = _gpt_tiny()
    cluster = ah.Cluster.local(2)
    favourite = ah.plan(model, cluster, inputs, loss_fn=_loss, example_targets=targets).mesh
    real = passes.REGISTRY["tensor_parallel"]

    def broken(gm, ctx):  # a torch-style error from inside a pass, on one mesh only
        if ctx.plan.mesh == favourite:
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    raise RuntimeError("boom")
        return real(gm, ctx)

    monkeypatch.setitem(passes.REGISTRY, "tensor_parallel", broken)
    plan = ah.plan(model, cluster, inputs, loss_fn=_loss, example_targets=targets,
                   executable_only=True)
    assert plan.mesh != favourite
    rejected = [a for a in plan.alternatives if "rejected by the passes" in a.reason]
    assert rejected, [a.reason for a in plan.alternatives]
    assert all(a.summary.startswith(favourite.describe()) for a in rejected)
    first = rejected[0]
    assert not first.executable and first.fits
    assert first.step_time_s <= plan.predicted.step_time_s  # it lost only to the trial
    # the reason is typed: the pass and the node it failed at, then torch's error
    assert "pass 'tensor_parallel' failed at node" in first.reason
    assert "RuntimeError: boom" in first.reason
    # ah.plan's default tries its choice too: the rejected favourite gives way there too
    default = ah.plan(model, cluster, inputs, loss_fn=_loss, example_targets=targets)
    assert default.mesh == plan.mesh and default.executable
    # pinned to the rejected mesh: refused before anything runs, with the same reason
    with pytest.raises(ah.NotExecutableError, match="tensor_parallel.*boom"):
        ah.plan(model, cluster, inputs, loss_fn=_loss, example_targets=targets,
                constraints=_pinned(favourite), executable_only=True)


@pytest.mark.timeout(120)
def test_lstm_plan_the_tensor_parallel_pass_rejects_is_not_chosen() -> None:
    """E6: the cost model likes tp2+sp for this LSTM language model, whose `aten.lstm`
    the tp pass could not rewrite (a raw "Cannot call numel() on tensor with symbolic
    sizes" from inside the pass); executable_only=True returned that plan anyway. Now the
    chosen plan's passes have run on this graph before it is chosen."""
    torch.manual_seed(0)
    model = RNNLM("LSTM", vocab=4096, hidden=32)
    tokens = torch.randint(0, 4096, (4, 8))
    targets = torch.randint(0, 4096, (4, 8))
    cluster = ah.Cluster.local(2)
    favourite = ah.plan(model, cluster, (tokens,), loss_fn=lm_loss, example_targets=targets)
    train = capture(model, (tokens,), lm_loss, targets)
    trial = PassTrial(train)
    plan = make_plan(train, train, model, cluster, (tokens,), None, None, None, "adam",
                     executable_only=True, trial=trial)
    rewrite(train, plan, 0, fake_groups=True)  # executable means executed
    assert len(trial.ok) == 1 and trial.trials == len(trial.failed) + 1
    # the tp pass now rewrites aten.lstm (test_tp_semantics), so the favourite passes its
    # trial and is chosen; a rejected favourite is covered by the tests around this one
    assert plan.mesh == favourite.mesh and not trial.failed


@pytest.mark.timeout(120)
def test_a_loss_that_mixes_samples_is_planned_without_splitting_the_batch() -> None:
    """`((o - t) ** 2).mean(0).sum()` cannot split over batch shards: global_loss rejects
    every plan with dp > 1 or microbatches (once ah.compile's unconstrained plan failed
    with that PlanError), so the search picks the fastest plan that keeps the batch
    whole, and says why the faster ones lost."""
    torch.manual_seed(0)
    model = models.preset("mlp-tiny")
    (x,), _ = models.example_batch("mlp-tiny", 8)
    y = torch.randn(8, 8)
    mixing = lambda o, t: ((o - t) ** 2).mean(0).sum()  # noqa: E731
    cluster = ah.Cluster.local(4)
    favourite = _untried(model, cluster, (x,), mixing, y)
    assert favourite.mesh.dp * favourite.num_microbatches > 1  # the cost model's choice
    plan = ah.plan(model, cluster, (x,), loss_fn=mixing, example_targets=y,
                   executable_only=True)
    assert plan.mesh.dp == 1 and plan.num_microbatches == 1
    lost = [a for a in plan.alternatives if "rejected by the passes" in a.reason]
    assert lost and all("pass 'global_loss'" in a.reason and "no batch dimension" in a.reason
                        for a in lost)
    train = capture(model, (x,), mixing, y)
    rewrite(train, plan, 0, fake_groups=True)


@pytest.mark.timeout(60)
def test_the_trial_runs_inside_a_live_job_and_restores_the_axis_groups() -> None:
    """ah.compile plans on every rank of a live job: the trial must neither need nor touch
    the job's process group, and must leave the ops' axis bindings as it found them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model, inputs, targets = _gpt_tiny()
    train = capture(model, inputs, _loss, targets)
    plan = ah.plan(model, ah.Cluster.local(2), inputs, loss_fn=_loss, example_targets=targets,
                   constraints=ah.Constraints(tp=2, sp=False))
    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    marker = object()
    before = ops.groups.snapshot()   # earlier tests in this process may have bound axes
    try:
        ops.groups.clear()
        ops.groups.bind("tp", marker)
        assert PassTrial(train, rank=1)(plan) is None
        assert ops.groups.snapshot() == {"tp": marker}
        assert dist.is_initialized() and dist.get_world_size() == 2
    finally:
        ops.groups.restore(before)
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_plan_marked_executable_is_one_its_passes_accept() -> None:
    """Once `ah.plan`'s default rewrote nothing: it marked the cost model's favourite
    executable (every feature is in the runtime) although global_loss rejects it (the
    loss mixes the samples of a batch, the plan splits the batch). Now the plan it marks
    executable is one whose passes ran on this graph, and the untried alternatives do
    not claim to run."""
    torch.manual_seed(0)
    model = models.preset("mlp-tiny")
    (x,), _ = models.example_batch("mlp-tiny", 8)
    y = torch.randn(8, 8)
    mixing = lambda o, t: ((o - t) ** 2).mean(0).sum()  # noqa: E731
    plan = ah.plan(model, ah.Cluster.local(4), (x,), loss_fn=mixing, example_targets=y)
    assert plan.executable and not plan.not_executable_because
    rewrite(capture(model, (x,), mixing, y), plan, 0, fake_groups=True)  # executable means executed
    assert plan.mesh.dp == 1 and plan.num_microbatches == 1
    for alt in plan.alternatives:
        if "rejected by the passes" in alt.reason:
            assert alt.executable is False and "pass 'global_loss'" in alt.reason
        elif alt.fits and "not executable yet" not in alt.reason:
            assert alt.executable is None and "not tried by the passes" in alt.reason
    assert any(a.executable is None for a in plan.alternatives)
    assert Plan.from_json(plan.to_json()) == plan   # None survives the JSON


@pytest.mark.timeout(120)
def test_when_the_passes_reject_every_plan_the_default_marks_the_best(monkeypatch) -> None:
    """`ah.plan` ranks and marks (DESIGN.md): when no candidate passes, the default
    returns the best, not executable, with the pass's reason; executable_only raises."""
    model, inputs, targets = _gpt_tiny()
    cluster = ah.Cluster.local(2)

    def refuse(gm, ctx):
        raise ah.PlanError("this loss cannot be computed here (test)")

    monkeypatch.setitem(passes.REGISTRY, "global_loss", refuse)
    plan = ah.plan(model, cluster, inputs, loss_fn=_loss, example_targets=targets)
    assert not plan.executable
    assert any("rejected by the passes: pass 'global_loss'" in r and "(test)" in r
               for r in plan.not_executable_because), plan.not_executable_because
    assert plan.mesh == _untried(model, cluster, inputs, _loss, targets).mesh
    assert all(a.summary != plan.summary() for a in plan.alternatives)
    with pytest.raises(ah.NotExecutableError, match="reject every candidate.*global_loss"):
        ah.plan(model, cluster, inputs, loss_fn=_loss, example_targets=targets,
                executable_only=True)




@pytest.mark.timeout(120)
def test_a_trial_leaves_out_only_the_passes_that_never_refuse_a_plan(monkeypatch) -> None:
    """The trial skips fusion (it leaves a region it cannot lower unfused: no plan is
    ruled out by it), a kept trial program (the dry run's) runs every pass, and a pass
    name `rewrite` does not know is refused."""
    from autohybrid.trial import NEVER_REFUSE

    model, inputs, targets = _gpt_tiny()
    train = capture(model, inputs, _loss, targets)
    plan = ah.plan(model, ah.Cluster.local(2), inputs, loss_fn=_loss,
                   example_targets=targets, constraints=_pinned(Mesh(dp=2, tp=1, pp=1)))
    assert NEVER_REFUSE == ("fusion",)
    kept = PassTrial(train, keep=True)
    assert kept(plan) is None and "fusion" in kept.kept(plan).pass_seconds

    def fusion_ran(gm, ctx):
        raise AutohybridError("fusion ran")

    monkeypatch.setitem(passes.REGISTRY, "fusion", fusion_ran)
    assert PassTrial(train)(plan) is None                      # not run in a trial
    assert "fusion ran" in PassTrial(train, keep=True)(plan)   # run where it is kept
    monkeypatch.undo()
    assert rewrite(train, plan, 0, fake_groups=True, skip=NEVER_REFUSE).fused_regions == ()
    assert rewrite(train, plan, 0, fake_groups=True).fused_regions != ()
    with pytest.raises(ValueError, match="no pass named"):
        rewrite(train, plan, 0, fake_groups=True, skip=("fusoin",))
