"""Activation recomputation (`Plan.recompute`, passes/recompute.py) equals eager training,
checkpoints what the cost model assumes, and keeps the memory the cost model predicts.

Equivalence: gpt-tiny and llama-tiny compiled with recompute pinned to "full" and to
"selective" at dp 2, tp 2 and pp 2 (1F1B, 2 microbatches), trained 2 steps against an
eager float64 copy (loss, gathered gradients and parameters after each step;
tests/_equiv.py), each model under SGD and AdamW; a ResNet (BatchNorm) at dp 2; and a
GPT with dropout 0.1 at tp 2, where the recomputed forward must redraw eager's masks (same
seed on every rank and in eager before each step; without `preserve_rng_state` the
gradients differ). All 2-rank cases share one `ah.launch`. Then the rewritten graphs (what
sits in checkpointed submodules) and the bytes kept for backward against the cost model.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.fx as fx

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import (OPTIMIZERS, Failures, compare_training, default_eager_loss, eager_step,
                    lm_loss, report, train_and_compare, zoo_batches, zoo_loss, zoo_model)
from autohybrid.capture import capture
from autohybrid.graph import op_name
from autohybrid.passes import PassContext, passes_for, run_passes
from autohybrid.passes.recompute import SDPA_OPS, checkpoint_region
from autohybrid.search.layers import layer_key

MESHES = {
    "dp2": ah.Constraints(dp=2, tp=1, pp=1, num_microbatches=2),
    "tp2": ah.Constraints(dp=1, tp=2, pp=1),
    "pp2": ah.Constraints(pp=2, dp=1, tp=1, schedule="1f1b", num_microbatches=2),
}


def _regions(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The checkpointed submodules `gm` calls, in order."""
    return [getattr(gm, n.args[0].target) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is checkpoint_region]


def _region_ops(compiled) -> list[list[str]]:
    """The ops of each checkpointed region this rank runs (all stages with pp)."""
    split = compiled.programs["train"].pipeline
    gms = [s.gm for s in split.stages] if split is not None else [compiled.graphs["train"]]
    return [[op_name(n) for n in sub.graph.nodes if n.op == "call_function"]
            for gm in gms for sub in _regions(gm)]


# ============================================================================ equivalence
def _equivalence_rank(rank: int, world: int) -> list[str]:
    fails = Failures()
    # each mesh runs both modes, each on one model (they swap from mesh to mesh), so
    # every model meets every mode and both optimizers; tests/test_matrix.py pairs the
    # recompute modes with every other option
    for k, (mesh, constraints) in enumerate(MESHES.items()):
        for i, mode in enumerate(("full", "selective")):
            for name in [("gpt-tiny", "llama-tiny")[(i + k) % 2]]:
                optimizer = ("sgd", "adamw")[k % 2]
                case = f"{name}/{optimizer}/{mesh} recompute={mode}"
                compiled, _ = train_and_compare(
                    fails, case, zoo_model(name), zoo_batches(name, 4, steps=2), world,
                    loss_fn=zoo_loss(name), optimizer=OPTIMIZERS[optimizer],
                    constraints=dataclasses.replace(constraints, recompute=mode))
                fails.check(f"{case}: plan recompute={compiled.plan.recompute}",
                            compiled.plan.recompute == mode)
                regions = _region_ops(compiled)
                fails.check(f"{case}: {len(regions)} checkpointed regions (2 blocks)",
                            len(regions) == 2)
                if mode == "selective":  # the attention core alone (under tp: local heads)
                    fails.check(f"{case}: regions {regions}", regions == [[SDPA_OPS[0]]] * 2)
    # ResNet at dp 2: BatchNorm's running-statistics updates (sync_batch_norm) run once,
    # after each checkpointed block, not again when backward recomputes it
    compiled, _ = train_and_compare(
        fails, "resnet-tiny/adamw/dp2 recompute=full", zoo_model("resnet-tiny"),
        zoo_batches("resnet-tiny", 8, steps=2), world, loss_fn=zoo_loss("resnet-tiny"),
        optimizer=OPTIMIZERS["adamw"],
        constraints=ah.Constraints(dp=2, tp=1, pp=1, recompute="full"))
    regions = _region_ops(compiled)
    fails.check(f"resnet: {len(regions)} regions (4 blocks)", len(regions) == 4)
    fails.check("resnet: running statistics updated inside a checkpointed region",
                not any("update_running_stats" in op or op.endswith("add_.Tensor")
                        for ops in regions for op in ops))
    # dropout 0.1 (residual, attention weights) at tp 2: the recomputation redraws the masks
    batches = zoo_batches("gpt-tiny", 8, steps=2)
    for mode in ("full", "selective"):
        torch.manual_seed(0)
        model = ah.models.gpt(layers=2, hidden=32, heads=4, vocab=96, seq=16,
                              dropout=0.1).double()
        ref = copy.deepcopy(model)
        compiled = ah.compile(model, ah.Cluster.local(world), batches[0][0], loss_fn=lm_loss,
                              example_targets=batches[0][1], optimizer=OPTIMIZERS["adamw"],
                              constraints=dataclasses.replace(MESHES["tp2"], recompute=mode))
        ref_opt = OPTIMIZERS["adamw"](list(ref.parameters()))
        compare_training(fails, f"gpt dropout 0.1 tp2 recompute={mode}", compiled, ref,
                         ref_opt, batches, default_eager_loss(lm_loss), seed=100)
        regions = _region_ops(compiled)
        fails.check(f"dropout recompute={mode}: regions {regions}", len(regions) == 2)
        if mode == "selective":  # attention dropout under tp: autohybrid's sharded_sdpa
            fails.check(f"dropout recompute=selective: regions {regions}",
                        regions == [[SDPA_OPS[1]]] * 2)
    torch.manual_seed(7)
    without = eager_step(copy.deepcopy(ref), None, default_eager_loss(lm_loss), *batches[0])
    ref.eval()
    fails.check("dropout changes nothing (vacuous test)",
                not torch.allclose(without, default_eager_loss(lm_loss)(ref, *batches[0])))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_full_and_selective_recompute_match_eager_at_dp2_tp2_pp2():
    results = pool_launch(_equivalence_rank, 2, args=(2,), timeout_s=guard(240))
    assert not any(results), report(results)


# ============================================================================ the graph
def _rewrite(name: str, mode: str, world: int = 1, constraints=None, coords=(0, 0, 0)):
    model = zoo_model(name)
    inputs, targets = ah.models.example_batch(name, 8, dtype=torch.float64)
    cap = capture(model, inputs, zoo_loss(name), targets)
    plan = ah.plan(model, ah.Cluster.local(world), inputs,
                   constraints=dataclasses.replace(constraints or ah.Constraints(),
                                                   recompute=mode))
    ctx = PassContext(plan=plan, rank=0, coords=coords)
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    return cap, run_passes(cap.gm, ctx, passes_for("train")), ctx


def _blocks(gm: fx.GraphModule) -> set[str]:
    """The blocks whose ops `gm` computes (the recompute pass's own calls aside)."""
    return {layer_key(n) for n in gm.graph.nodes
            if n.op == "call_function" and ".blocks." in layer_key(n)
            and n.meta.get("ah_pass") != "recompute"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_full_recompute_checkpoints_each_block_and_selective_only_attention(name):
    cap, gm, _ = _rewrite(name, "full")
    subs = _regions(gm)
    assert [_blocks(s) for s in subs] == [{"model.blocks.0"}, {"model.blocks.1"}]
    assert not _blocks(gm)                       # no block op is left in the parent graph
    assert all(n.meta.get("ah_pass") == "recompute" for n in gm.graph.nodes
               if n.target is checkpoint_region)
    ops = lambda g: [op_name(n) for n in g.graph.nodes if n.op == "call_function"]
    assert not any(o in SDPA_OPS for o in ops(gm))
    _, gm, _ = _rewrite(name, "selective")
    assert [ops(s) for s in _regions(gm)] == [[SDPA_OPS[0]]] * 2   # the attention core alone
    assert _blocks(gm) == {"model.blocks.0", "model.blocks.1"}     # the rest is kept
    _, gm, _ = _rewrite(name, "none")
    assert not _regions(gm)


@pytest.mark.timeout(60)
def test_blocks_whose_op_updates_buffers_are_not_recomputed():
    """Eager `batch_norm` in training mode computes and updates the running statistics in
    one op: recomputing it would update them twice, so such blocks keep their activations
    (with dp > 1, sync_batch_norm's separate update moves after the region instead)."""
    _, gm, _ = _rewrite("resnet-tiny", "full")
    assert not _regions(gm)


@pytest.mark.timeout(60)
def test_full_recompute_rewrites_every_pipeline_stage():
    """(Under tp, selective recomputation checkpoints `sharded_sdpa`: checked in the
    2-rank equivalence test, which binds the tp groups.)"""
    _, gm, ctx = _rewrite("gpt-tiny", "full", 2, ah.Constraints(pp=2, dp=1, tp=1,
                                                               schedule="1f1b"))
    stages = ctx.notes["pipeline"].stages
    assert sorted(b for s in stages for sub in _regions(s.gm) for b in _blocks(sub)) == \
        ["model.blocks.0", "model.blocks.1"]
    assert all(not _blocks(s.gm) for s in stages)


# ============================================================================ memory
def _saved_bytes(compiled, inputs, targets) -> int:
    """Bytes of the distinct storages the forward keeps for backward (parameters aside):
    what `saved_tensors_hooks` packs outside checkpointed regions, plus the regions'
    inputs, which non-reentrant checkpoint saves through the same hooks."""
    params = {p.untyped_storage().data_ptr() for p in compiled.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    program = compiled.programs["train"].runnable
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        num, _ = program.run(compiled.executor.state, inputs, (targets,))
    del num
    return sum(seen.values())


@pytest.mark.timeout(60)
def test_recompute_saves_the_memory_the_cost_model_predicts():
    """Bytes kept for backward by a 4-block GPT (vocabulary 64, so the head and loss are
    small next to the blocks): full < selective <= none, and the saving of full
    recomputation is what pricing predicts, loosely.

    Pricing's `layer_times` says a layer keeps `saved` bytes, and `recompute_saved` (its
    input) under full recomputation; summed over the layers, `Σ recompute_saved / Σ saved`
    is the predicted ratio of kept bytes full/none. The runtime checkpoints only the
    blocks (the embedding, final norm, head and loss keep their activations), and the
    measurement counts what the CPU kernels save (e.g. sdpa's logsumexp, which the cost
    model does not), so the two agree within a factor 2, not exactly.
    """
    from autohybrid.search.pricing import Layout, layer_times
    from autohybrid.search.space import profile

    torch.manual_seed(0)
    base = ah.models.gpt(layers=4, hidden=64, heads=4, vocab=64, seq=32).double()
    inputs, targets = ah.models.example_batch(base, 4, dtype=torch.float64)
    saved = {}
    for mode in ("none", "selective", "full"):
        compiled = ah.compile(copy.deepcopy(base), ah.Cluster.local(1), inputs, loss_fn=lm_loss,
                              example_targets=targets, optimizer=OPTIMIZERS["sgd"],
                              constraints=ah.Constraints(recompute=mode))
        compiled.train_step(inputs, targets)                    # captures the train graph
        saved[mode] = _saved_bytes(compiled, inputs, targets)
    assert saved["full"] < saved["selective"] <= saved["none"], saved
    cap = capture(base, inputs, lm_loss, targets)
    prof = profile(cap.gm, cap.dim_roles)
    seq = inputs[0].shape[1]
    layout = Layout(compiled.plan.mesh, microbatch_size=4, num_microbatches=1,
                    recompute="full")
    times = [layer_times(layer, ah.Cluster.local(1), layout, seq, "float64", 8)
             for layer in prof.layers]
    predicted = sum(t.recompute_saved for t in times) / sum(t.saved for t in times)
    measured = saved["full"] / saved["none"]
    print(f"kept bytes {saved}; full/none measured {measured:.3f}, predicted {predicted:.3f}")
    assert predicted / 2 <= measured <= predicted * 2, (measured, predicted, saved)
