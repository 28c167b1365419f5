"""MoE models train like single-process eager under expert parallelism and its hybrids.

The zoo's moe-tiny (4 experts, top-2, a shared expert, the per-sequence balance loss in
the loss) compiled for 2 and 4 gloo ranks, each plan trained beside an eager copy on the
same global batches: losses, gathered gradients and parameters after every step
(tests/_equiv.py), under SGD and AdamW. Plans: ep=2 (with microbatches), ep=4, ep=2 × dp
(experts replicated on two ranks each, their gradients summed over those), ep × tp (with
and without sequence parallelism), tp without sequence parallelism and ep (each tp rank a
slice of every expert's intermediate size, checked), ep × pp, ep with ZeRO-1 and ZeRO-2 (expert slices
sharded over the ranks holding the same experts), ep with the tokens in chunks (each
chunk's all-to-all beside the previous one's experts); and, for reference, dp, tp and pp
without ep. Every ep plan is checked to hold E/ep experts per rank (its expert weights are
slices), so a plan that quietly fell back to replicated experts fails. With a capacity
factor (routes past an expert's per-sequence capacity dropped: checked to drop some),
ep with microbatches, ep=4, ep × pp and ep × tp. The routing of
the tiny model is uneven per expert (checked); extreme routing (every token to one
rank's experts, none to the others) is covered by tests/test_moe_ops.py.
"""
from __future__ import annotations

import math

import pytest
import torch

import autohybrid as ah
from _equiv import OPTIMIZERS, Failures, lm_loss, train_and_compare, zoo_batches
from _limits import guard
from _pool import launch as pool_launch
from autohybrid.models.spec import zoo_loss
from test_moe_loop import LoopLM, LoopMoE, QwenLoopMoE

EXPERTS = 4
#: an expert takes at most ceil(1.0 · T · k / E) routes of a sequence: about a tenth drop
CAPACITY = dict(capacity_factor=1.0)


def _routing(model, ids) -> torch.Tensor:
    """Routes of the batch to each expert (the last entry: dropped past capacity) in the
    first MoE layer."""
    counts = []
    moe = next(b.mlp for b in model.blocks if hasattr(b.mlp, "experts"))
    hook = moe.experts.register_forward_pre_hook(lambda m, args: counts.append(
        torch.bincount(args[1].reshape(-1), minlength=EXPERTS + 1)))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return counts[0]


def _rank(rank: int, world: int, cases: list[tuple]) -> Failures:
    fails = Failures()
    for pinned, optimizer, *extra in cases:
        clip = extra[0] if extra else None
        overrides = extra[1] if len(extra) > 1 else {}
        name = f"{pinned} {optimizer}" + (f" clipped to {clip}" if clip else "") + \
            (f" {overrides}" if overrides else "")
        torch.manual_seed(0)
        model = ah.models.preset("moe-tiny", **overrides).double()
        batches = zoo_batches("moe-tiny", 8, steps=2)
        routes = _routing(model, batches[0][0][0])
        fails.check(f"{name}: routing is even {routes}", len(set(routes[:-1].tolist())) > 1)
        fails.check(f"{name}: {routes[-1]} routes dropped past capacity",
                    (routes[-1] > 0) == ("capacity_factor" in overrides))
        compiled, _ = train_and_compare(fails, name, model, batches, world, loss_fn=zoo_loss,
                                        optimizer=OPTIMIZERS[optimizer],
                                        constraints=ah.Constraints(**pinned),
                                        max_grad_norm=clip)
        ep, mesh = pinned.get("ep", 1), compiled.plan.mesh
        fails.check(f"{name}: mesh {mesh}", mesh.ep == ep)
        if mesh.tp > 1 and not mesh.sp:   # expert tensor parallelism (under ep too)
            sliced = {n: p for n, p in compiled.sharded.local.items() if "expert" in n}
            inter = model.blocks[0].mlp.experts.down_proj.shape[-1]
            fails.check(f"{name}: experts' tp slices {[tuple(p.shape) for p in sliced.values()]}",
                        len(sliced) == 4 and all(
                            p.shape[1 if "gate_up" in n else 2] == (2 if "gate_up" in n else 1)
                            * inter // mesh.tp for n, p in sliced.items()))
        if "moe_chunks" in pinned:
            fails.check(f"{name}: {compiled.plan.moe_chunks} chunks",
                        compiled.plan.moe_chunks == pinned["moe_chunks"])
        if ep > 1:
            local = {n: p for n, p in compiled.sharded.local.items()
                     if compiled.sharded.specs[n].axis == "ep"}
            moe_layers = 2 - overrides.get("dense_layers", 0) + overrides.get("layers", 2) - 2
            fails.check(f"{name}: expert slices {[tuple(p.shape) for p in local.values()]}",
                        len(local) == 2 * moe_layers and all(p.shape[0] == EXPERTS // ep
                                                             for p in local.values()))
    return fails


def _expert_slices(compiled, axis: str) -> dict:
    """The expert weights this rank holds as slices over `axis` ("ep": some experts;
    "tp": every expert's share of the intermediate size)."""
    return {n: p for n, p in compiled.sharded.local.items()
            if "expert" in n and compiled.sharded.specs[n].axis == axis} \
        if compiled.sharded is not None else {}


def _run(world: int, cases: list[tuple]) -> None:
    results = pool_launch(_rank, world, args=(world, cases), timeout_s=guard(200))
    assert results == [[]] * world, "\n".join(line for r in results for line in r)


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_two_ranks():
    _run(2, [(dict(dp=2, ep=2), "sgd"), (dict(dp=2, ep=2), "adamw"),
             (dict(dp=2, ep=2, num_microbatches=2), "sgd"), (dict(dp=2, ep=2, zero=1), "adamw"),
             (dict(dp=2, ep=2), "sgd", 0.05),     # the global norm counts each expert once
             # DeepSeek-V3's options: sigmoid scores, a routed scale, a dense first layer
             (dict(dp=2, ep=2), "adamw", None, dict(layers=3, dense_layers=1,
                                                    score="sigmoid", routed_scale=2.5)),
             (dict(dp=2), "sgd"), (dict(tp=2), "sgd"), (dict(pp=2, num_microbatches=2), "sgd"),
             # expert tensor parallelism: tp's ranks share the tokens, each computes its
             # slice of every expert (full recomputation runs the op's all-reduce again)
             (dict(tp=2, sp=False), "sgd"), (dict(tp=2, sp=False, recompute="full"), "adamw"),
             # capacity per sequence: the routes past it drop alike however the batch splits
             (dict(dp=2, ep=2, num_microbatches=2), "adamw", None, CAPACITY),
             # checkpointed blocks: the op's saved rows dropped and recomputed
             (dict(dp=2, ep=2, recompute="full"), "sgd")])


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_four_ranks():
    _run(4, [(dict(dp=4, ep=4), "adamw"), (dict(dp=4, ep=2), "sgd"),
             (dict(dp=2, ep=2, tp=2), "adamw"), (dict(dp=2, ep=2, tp=2, sp=False), "sgd"),
             (dict(pp=2, dp=2, ep=2, num_microbatches=2), "adamw"),
             (dict(dp=4, ep=2, zero=1), "adamw"), (dict(dp=4, ep=2, zero=2), "sgd"),
             (dict(dp=4, ep=4, moe_chunks=3, num_microbatches=2), "adamw"),
             (dict(dp=4, ep=2, zero=1), "sgd", 0.05),
             (dict(dp=4, ep=4), "sgd", None, CAPACITY),
             (dict(pp=2, dp=2, ep=2, num_microbatches=2), "sgd", None, CAPACITY),
             (dict(dp=2, ep=2, tp=2), "sgd", None, CAPACITY),
             (dict(dp=2, tp=2, sp=False, ep=1, zero=1), "adamw"),
             # ep's expert slices cut again over tp (expert tensor parallelism under ep)
             (dict(dp=2, ep=2, tp=2, sp=False, zero=1), "adamw"),
             (dict(dp=2, ep=2, tp=2, sp=False), "sgd", 0.05),   # the norm over both axes
             (dict(tp=4, sp=False), "sgd", None, CAPACITY)])


#: the plans of the checkpoint test per world size, and the moves between them
CHECKPOINT_PLANS = {
    2: ({"ep2": dict(dp=2, ep=2), "dp2": dict(dp=2, ep=1), "etp2": dict(dp=1, tp=2, sp=False)},
        (("ep2", "dp2"), ("dp2", "ep2"), ("ep2", "etp2"), ("etp2", "ep2"))),
    4: ({"ep2etp2": dict(dp=2, ep=2, tp=2, sp=False, zero=1), "dp4": dict(dp=4, ep=1)},
        (("ep2etp2", "dp4"), ("dp4", "ep2etp2")))}


def _checkpoint_rank(rank: int, directory: str, world: int) -> list[str]:
    """Train a step under one plan, save; load into another: both must then take the same
    next step (AdamW: its state travels too). Between ep=2 and dp-only, both ways, and
    between ep=2 and tp=2 without sp (every expert split along its intermediate size); on
    4 ranks between ep=2 × tp=2 without sp (ep's slices cut again over tp, ZeRO-1) and
    dp=4."""
    batches = zoo_batches("moe-tiny", 8, steps=2)
    plans, moves = CHECKPOINT_PLANS[world]
    compiled = {}
    for seed, (name, pinned) in enumerate(plans.items()):
        torch.manual_seed(seed)      # different starting weights: the load must replace them
        model = ah.models.preset("moe-tiny").double()
        compiled[name] = ah.compile(model, ah.Cluster.local(world), batches[0][0],
                                    loss_fn=zoo_loss, example_targets=batches[0][1],
                                    optimizer=OPTIMIZERS["adamw"],
                                    constraints=ah.Constraints(**pinned))
    problems = []
    for source, target in moves:
        compiled[source].train_step(*batches[0])
        path = f"{directory}/from_{source}_to_{target}"
        compiled[source].save(path)
        compiled[target].load(path)
        losses = [float(compiled[e].train_step(*batches[1])) for e in (source, target)]
        states = [compiled[e].full_state_dict() for e in (source, target)]
        # tp sums in another order: float64 roundings, which AdamW's second step
        # magnifies (1e-11 here); dp and ep sum alike, to the last bit
        tol = dict(rtol=1e-7, atol=1e-7) if any("etp2" in e for e in (source, target)) \
            else dict(rtol=1e-12, atol=1e-14)
        if not math.isclose(*losses, rel_tol=tol["rtol"]):
            problems.append(f"{source} -> {target}: next losses {losses}")
        problems += [f"{source} -> {target}: {k} differs after the next step by "
                     f"{(states[0][k] - states[1][k]).abs().max():.2e}"
                     for k in states[0] if not torch.allclose(states[0][k], states[1][k], **tol)]
    return problems


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_checkpoints_move_between_expert_parallel_and_data_parallel_plans(tmp_path, world):
    results = pool_launch(_checkpoint_rank, world, args=(str(tmp_path), world),
                          timeout_s=guard(200))
    assert results == [[]] * world, results


def _hf_rank(rank: int, world: int, cases: list[tuple[str, dict, str]]) -> Failures:
    """Hugging Face MoE models from tiny configs (their experts captured as the op)."""
    import copy

    from _equiv import compare_training
    from autohybrid.models import coverage

    fails = Failures()
    for name, pinned, optimizer in cases:
        case = coverage.build(name)
        ref = copy.deepcopy(case.model)
        inputs, targets = case.batches[0]
        compiled = ah.compile(case.model, ah.Cluster.local(world), inputs,
                              loss_fn=case.loss_fn, example_targets=targets,
                              optimizer=OPTIMIZERS[optimizer],
                              constraints=ah.Constraints(**pinned))
        what = f"{name} {pinned} {optimizer}"
        axis = "ep" if pinned.get("ep", 1) > 1 else "tp"
        fails.check(f"{what}: experts not split over {axis} ({compiled.plan.mesh})",
                    compiled.plan.mesh.ep == pinned.get("ep", 1)
                    and bool(_expert_slices(compiled, axis)))
        if axis == "ep" and pinned.get("tp", 1) > 1 and pinned.get("sp") is False:
            fails.check(f"{what}: ep's expert slices not cut again over tp",
                        all(compiled.sharded.specs[n].inner is not None
                            for n in _expert_slices(compiled, "ep")))
        compare_training(fails, what, compiled, ref, OPTIMIZERS[optimizer](
            list(ref.parameters())), case.batches[:2], case.eager_loss)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.skipif(not __import__("autohybrid.models.coverage", fromlist=["x"])
                    .have_transformers(), reason="transformers")
@pytest.mark.parametrize("world, cases", [
    (2, [("mixtral", dict(dp=2, ep=2), "sgd"), ("qwen2_moe", dict(dp=2, ep=2, zero=1), "sgd")]),
    (4, [("mixtral", dict(dp=4, ep=4), "sgd"), ("qwen2_moe", dict(dp=2, ep=2, tp=2), "sgd"),
         ("qwen2_moe", dict(dp=4, ep=2), "sgd"), ("mixtral", dict(dp=2, tp=2, sp=False, ep=1), "sgd"),
         ("mixtral", dict(dp=2, tp=2, sp=False, ep=2), "sgd"),
         ("mixtral", dict(pp=2, dp=2, ep=2, num_microbatches=2), "sgd")]),
], ids=["2-ranks", "4-ranks"])
def test_hugging_face_moe_under_expert_parallelism(world, cases):
    """SGD only, as the model coverage sweep: Hugging Face's routers compute their softmax
    in float32 (`router_logits.float()`) even in a float64 model, so a batch split changes
    gradient elements by float32 roundings (1e-10 absolute here, inside the gradient
    tolerance), which AdamW's first step, g / (|g| + eps), turns into parameter
    differences above it — under dp=4 without expert parallelism as much as with it.
    AdamW under ep runs on the zoo's MoE model above (float64 throughout)."""
    results = pool_launch(_hf_rank, world, args=(world, cases), timeout_s=guard(200))
    assert results == [[]] * world, "\n".join(line for r in results for line in r)


def _hf_aux_rank(rank: int, world: int, cases: list[tuple[str, dict, str]]) -> Failures:
    """Hugging Face MoE models with their load-balancing loss (`output_router_logits`):
    the tokens each expert received over the whole batch's routing, every layer's, times
    the mean router probability, added to the cross-entropy. Split over dp and ep, each
    rank adds the shards' partial sums (autohybrid::batch_sum) and trains like eager; with
    microbatches, whose backward starts before the next one's sums exist, and with a
    pipeline, the sums are added up in a forward before the step's
    (runtime/whole_batch.py)."""
    import copy

    from _equiv import compare_training
    from autohybrid.models import coverage

    fails = Failures()
    for name, pinned, optimizer in cases:
        case = coverage.build(name)
        case.model.config.output_router_logits = True
        case.model.config.router_aux_loss_coef = 0.5   # large: a wrong term shows
        ref = copy.deepcopy(case.model)
        inputs, targets = case.batches[0]
        kw = dict(loss_fn=None, example_targets=targets, optimizer=OPTIMIZERS[optimizer],
                  constraints=ah.Constraints(**pinned))
        what = f"{name} + balance loss {pinned} {optimizer}"
        compiled = ah.compile(case.model, ah.Cluster.local(world), inputs, **kw)
        plan = compiled.plan
        fails.check(f"{what}: plan {plan.summary()}",
                    (plan.mesh.ep, plan.mesh.dp, plan.mesh.pp, plan.num_microbatches)
                    == tuple(pinned.get(k, 1) for k in ("ep", "dp", "pp", "num_microbatches")))
        compare_training(fails, what, compiled, ref, OPTIMIZERS[optimizer](
            list(ref.parameters())), case.batches[:2], _model_loss)
    return fails


def _model_loss(model, inputs, targets):
    """Eager: the model's own loss, cross-entropy plus the balance term (checked there)."""
    out = model(*inputs, labels=targets)
    assert out.aux_loss is not None and float(out.aux_loss) > 0
    return out.loss


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.skipif(not __import__("autohybrid.models.coverage", fromlist=["x"])
                    .have_transformers(), reason="transformers")
@pytest.mark.parametrize("world, cases", [
    (2, [("mixtral", dict(dp=2, ep=2), "sgd"), ("mixtral", dict(dp=2), "sgd"),
         ("qwen2_moe", dict(dp=2, ep=2, zero=1), "sgd"),
         ("mixtral", dict(dp=2, ep=2, num_microbatches=2), "sgd"),
         ("mixtral", dict(pp=2, num_microbatches=4, schedule="interleaved", virtual_stages=2),
          "sgd")]),
    (4, [("mixtral", dict(dp=4, ep=4), "sgd"), ("qwen2_moe", dict(dp=2, ep=2, tp=2), "sgd"),
         ("mixtral", dict(pp=2, dp=2, ep=2, num_microbatches=2), "sgd")]),
], ids=["2-ranks", "4-ranks"])
def test_hugging_face_balance_loss_over_the_whole_batch_under_expert_parallelism(world, cases):
    results = pool_launch(_hf_aux_rank, world, args=(world, cases), timeout_s=guard(200))
    assert results == [[]] * world, "\n".join(line for r in results for line in r)


def _check_rank(rank: int, world: int, pinned: dict, check: str, inject: bool) -> str:
    if inject:   # expert slices summed over dp like every other gradient: wrong
        from autohybrid.runtime import reducer
        reducer.GradReducer._bucket = lambda self, params: reducer.Bucket(params,
                                                                          group=self.group)
    torch.manual_seed(0)
    model = ah.models.preset("moe-tiny").double()
    (batch,) = zoo_batches("moe-tiny", 8, steps=1)
    compiled = ah.compile(model, ah.Cluster.local(world), batch[0], loss_fn=zoo_loss,
                          example_targets=batch[1], optimizer=OPTIMIZERS["sgd"],
                          constraints=ah.Constraints(**pinned), check=check)
    try:
        compiled.train_step(*batch)      # raises NumericsError where a gradient differs
    except ah.NumericsError as exc:
        return "caught" if "blocks.0.mlp.experts.gate_up_proj" in str(exc) else str(exc)
    return compiled.plan.mesh.describe()


@pytest.mark.procs
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, pinned, check", [
    (2, dict(dp=2, ep=2), "whole"),
    (4, dict(pp=2, dp=2, ep=2, num_microbatches=2), "stage"),
], ids=["whole", "stage"])
def test_check_true_under_expert_parallelism(world, pinned, check):
    """check=True compares the first step with a reference (eager, or the captured graph
    stage by stage) on every rank, the expert slices gathered back: a right plan passes,
    and with the expert gradients summed over dp instead of the ranks holding the same
    experts it raises NumericsError naming the expert weight."""
    for inject, expected in ((False, "(ep2)"), (True, "caught")):
        results = pool_launch(_check_rank, world, args=(world, pinned, check, inject),
                              timeout_s=guard(200))
        assert len(set(results)) == 1 and expected in results[0], results


# ------------------------------------------------------------------ a hand-written MoE
def _loop_rank(rank: int, world: int, cases: list[tuple[dict, str]]) -> Failures:
    fails = Failures()
    g = torch.Generator().manual_seed(3)
    batches = [((torch.randint(0, 64, (8, 12), generator=g),),
                torch.randint(0, 64, (8, 12), generator=g)) for _ in range(2)]
    for pinned, optimizer, *variant in cases:
        torch.manual_seed(0)
        moe = {"as written": lambda: LoopMoE(bias=True), "qwen": QwenLoopMoE}.get(
            variant[0] if variant else "", lambda: None)()
        model = LoopLM(moe).double()
        name = f"hand-written MoE {' '.join(variant)} {pinned} {optimizer}"
        compiled, _ = train_and_compare(fails, name, model, batches, world, loss_fn=lm_loss,
                                        optimizer=OPTIMIZERS[optimizer],
                                        constraints=ah.Constraints(**pinned))
        fails.check(f"{name}: plan {compiled.plan.summary()}",
                    all(getattr(compiled.plan.mesh, k) == v for k, v in pinned.items()
                        if k in ("dp", "tp", "sp", "pp", "ep")))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_hand_written_moe_loop_trains_like_eager():
    """Mixtral's original loop over experts (torch.where, index_add_), folded at capture
    into one MoE op whose weights are the experts' separate parameters stacked
    (tests/test_moe_loop.py), trains like eager under dp, dp with microbatches, tp with
    and without sp (the experts whole on every tp rank), a pipeline, and expert
    parallelism: ep=2 (each rank its half of the stacks, every rank every parameter),
    with the tokens in two chunks, with ZeRO-1 and with ZeRO-3; and transformers 4.4x's
    Qwen2-MoE block (a shared expert beside the loop) under ep=2 with microbatches. With
    biases on its experts the loop is not folded and runs as written (data-dependent
    sizes, priced at their largest): under dp (each shard's torch.where picks its own
    tokens: batch_flow.py) with microbatches, and a pipeline whose stages exchange no
    data-sized value (tests/test_pp_equivalence.py: a boundary that would is refused)."""
    results = pool_launch(_loop_rank, 2, args=(2, [
        (dict(dp=2), "sgd"), (dict(dp=2, num_microbatches=2), "adamw"),
        (dict(tp=2, sp=True), "adamw"), (dict(tp=2, sp=False), "sgd"),
        (dict(pp=2, num_microbatches=2), "sgd"), (dict(ep=2), "adamw"),
        (dict(ep=2, moe_chunks=2), "sgd"), (dict(ep=2, zero=1), "adamw"),
        (dict(ep=2, zero=3), "sgd"), (dict(ep=2, num_microbatches=2), "adamw", "qwen"),
        (dict(dp=2, num_microbatches=2), "adamw", "as written"),
        (dict(pp=2, num_microbatches=2), "sgd", "as written")]), timeout_s=guard(300))
    assert results == [[], []], "\n".join(line for r in results for line in r)
