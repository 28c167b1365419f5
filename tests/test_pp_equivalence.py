"""Pipeline-parallel training through `ah.compile` equals single-process eager training.

Every rank trains the compiled model (plans pinned to a pipeline schedule) and an eager
float64 copy on the whole batch, and compares the loss, the gathered gradients and the
gathered parameters after every step (tests/_equiv.py), under plain SGD and AdamW. The
schedules are all seven of torch.distributed.pipelining's, at pp 2 and 4, alone and
composed with dp and tp; the GPTs tie their embedding and output weights, which the
first and last stage then both hold. Then the split itself: what crosses stages, the
tied weights' gradient groups, and the errors for bad boundaries.
"""
from __future__ import annotations

import re

import pytest
import torch

import autohybrid as ah
from _equiv import (OPTIMIZERS, Failures, lm_loss, report, train_and_compare, zoo_batches,
                    zoo_loss, zoo_model)
from autohybrid.capture import capture
from autohybrid.errors import PlanError
from autohybrid.passes import PassContext, passes_for, run_passes

LAUNCH_TIMEOUT_S = 240
#: (schedule, virtual stages, microbatches per rank at pp 2, at pp 4)
SCHEDULES = [("gpipe", 1, 2, 4), ("1f1b", 1, 2, 4), ("interleaved", 2, 2, 4),
             ("looped-bfs", 2, 2, 4), ("zero-bubble", 2, 2, 4), ("zbv", 2, 4, 8),
             ("dualpipev", 2, 4, 8)]


def _launch(fn, world: int, *args):
    return ah.launch(fn, ah.Cluster.local(world), args=(world, *args),
                     timeout_s=LAUNCH_TIMEOUT_S)


def _assert_no_failures(results) -> None:
    assert not any(results), report(results)


def _model(name: str, pp: int):
    """The zoo model, deep enough for pp × 2 stages (a stage holds at least one layer:
    an embedding, a block, a norm, a head, an mlp linear or activation)."""
    deeper = {2: {"mlp-tiny": dict(layers=3)},
              4: {"mlp-tiny": dict(layers=6), "gpt-tiny": dict(layers=4),
                  "llama-tiny": dict(layers=5)}}[pp].get(name)
    if deeper is None:
        return zoo_model(name)
    torch.manual_seed(0)
    return ah.models.preset(name, **deeper).double()


def _check_plan(fails: Failures, case: str, compiled, pp: int, schedule: str, v: int) -> None:
    plan = compiled.plan
    fails.check(f"{case}: plan is {plan.mesh.describe()} {plan.schedule}×{plan.virtual_stages}",
                (plan.mesh.pp, plan.schedule, plan.virtual_stages) == (pp, schedule, v))
    fails.check(f"{case}: {len(plan.stage_boundaries)} boundaries",
                len(plan.stage_boundaries) == pp * v - 1)


# ============================================================================ schedules
def _schedules_rank(rank: int, world: int) -> list[str]:
    """Each schedule on each model at pp 2; at pp 4 on one model each, gpt-tiny (whose
    tied weights span the first and last stage) for every other schedule and llama-tiny
    or mlp in turn for the rest (tests/test_matrix.py pairs every schedule with the other
    options): 2 steps, alternating SGD and AdamW (each model meets both), 2 samples per
    microbatch."""
    fails = Failures()
    pp = world
    for i, (schedule, v, m2, m4) in enumerate(SCHEDULES):
        m = m2 if pp == 2 else m4
        names = (("gpt-tiny", "llama-tiny", "mlp-tiny") if pp == 2
                 else ("gpt-tiny",) if i % 2 == 0 else (("llama-tiny", "mlp-tiny")[i // 2 % 2],))
        for j, name in enumerate(names):
            optimizer = ("sgd", "adamw")[(i + j + (i // 2 if pp == 4 else 0)) % 2]
            case = f"{name}/{optimizer}/pp{pp} {schedule}×{v} m={m}"
            batches = zoo_batches(name, 2 * m, steps=2)
            constraints = ah.Constraints(pp=pp, dp=1, tp=1, schedule=schedule,
                                         virtual_stages=v, num_microbatches=m)
            compiled, _ = train_and_compare(fails, case, _model(name, pp), batches, world,
                                            loss_fn=zoo_loss(name),
                                            optimizer=OPTIMIZERS[optimizer],
                                            constraints=constraints)
            _check_plan(fails, case, compiled, pp, schedule, v)
    return fails


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4], ids=["pp2", "pp4"])
def test_every_schedule_matches_eager(world):
    """gpt-tiny (tied embeddings), llama-tiny and mlp under all seven schedules at pp 2;
    every schedule on one of them at pp 4 (up to 8 stages)."""
    _assert_no_failures(_launch(_schedules_rank, world))


# ============================================================================ composed
def _composed_rank(rank: int, world: int) -> list[str]:
    """pp 2 × dp 2 and pp 2 × tp 2 (with and without sp) on 4 ranks, with gradient
    clipping (the global norm spans stages and shards), then the forward output."""
    fails = Failures()
    for name in ("gpt-tiny", "llama-tiny"):
        batches = zoo_batches(name, 8, steps=2)
        for dp, tp, sp, schedule, v, optimizer in (
                (2, 1, False, "1f1b", 1, "adamw"), (1, 2, True, "interleaved", 2, "sgd"),
                (1, 2, False, "zbv", 2, "adamw")):
            m = 4 if schedule == "zbv" else 2
            case = f"{name}/{optimizer}/pp2×dp{dp}×tp{tp}{'+sp' if sp else ''} {schedule}"
            constraints = ah.Constraints(pp=2, dp=dp, tp=tp, sp=sp, schedule=schedule,
                                         virtual_stages=v, num_microbatches=m)
            compiled, ref = train_and_compare(
                fails, case, zoo_model(name), batches, world,
                loss_fn=zoo_loss(name), optimizer=OPTIMIZERS[optimizer],
                constraints=constraints, max_grad_norm=0.5)
            fails.check(f"{case}: mesh {compiled.plan.mesh.describe()}",
                        (compiled.plan.mesh.dp, compiled.plan.mesh.tp) == (dp, tp))
            (x,), _ = batches[0]
            fails.close(f"{case} forward", compiled((x,)), ref(x).detach())
    (x,), y = batches[0]
    try:  # 6 samples: 3 per dp rank, not 2 equal microbatches
        compiled.train_step(x[:6], y[:6])
        fails.append("a batch that does not split into equal microbatches was accepted")
    except ah.AutohybridError as exc:
        fails.check(f"unequal microbatches: {exc}", "equal microbatches" in str(exc))
    return fails


@pytest.mark.timeout(300)
def test_pp_x_dp_and_pp_x_tp_match_eager_on_four_ranks():
    _assert_no_failures(_launch(_composed_rank, 4))


# ============================================================================ Hugging Face
def _hf_rank(rank: int, world: int) -> list[str]:
    """GPT2LMHeadModel (tied wte / lm_head) on the zoo's token batches, its logits in a
    float64 loss, under 1F1B and the interleaved zero-bubble schedule."""
    from transformers import GPT2Config, GPT2LMHeadModel
    fails = Failures()
    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    batches = zoo_batches("gpt-tiny", 8, steps=2)
    for schedule, v in (("1f1b", 1), ("zero-bubble", 2)):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).double()
        compiled, _ = train_and_compare(
            fails, f"hf-gpt2/pp2 {schedule}", model, batches, world,
            loss_fn=lambda out, t: lm_loss(out["logits"], t), optimizer=OPTIMIZERS["adamw"],
            eager_loss=lambda m, i, t: lm_loss(m(input_ids=i[0]).logits, t),
            constraints=ah.Constraints(pp=2, dp=1, tp=1, schedule=schedule,
                                       virtual_stages=v, num_microbatches=2))
        shared = compiled.notes["train"]["pipeline"].shared_params
        fails.check(f"hf-gpt2 {schedule}: tied wte/lm_head shared by the first and last "
                    f"stage ({shared})", "transformer.wte.weight" in shared)
    return fails


@pytest.mark.timeout(300)
def test_hugging_face_gpt2_at_pp2_matches_eager():
    _assert_no_failures(_launch(_hf_rank, 2))


# ============================================================================ planner
def _choose_rank(rank: int, world: int) -> dict:
    """ah.compile(plan=None) on gpt-tiny, trained against eager; and with dp = tp = 1
    pinned, the planner's balanced pp plan (stage boundaries from its partition)."""
    fails = Failures()
    batches = zoo_batches("gpt-tiny", 8, steps=2)
    compiled, _ = train_and_compare(fails, "gpt-tiny/searched", zoo_model("gpt-tiny"), batches,
                                    world, loss_fn=lm_loss, optimizer=OPTIMIZERS["adamw"])
    pinned, _ = train_and_compare(fails, "gpt-tiny/pp only", zoo_model("gpt-tiny"), batches,
                                  world, loss_fn=lm_loss, optimizer=OPTIMIZERS["sgd"],
                                  constraints=ah.Constraints(dp=1, tp=1))
    plans = (compiled.plan, pinned.plan)
    return {"fails": list(fails),
            "mesh": [(p.mesh.dp, p.mesh.tp, p.mesh.pp) for p in plans],
            "boundaries": pinned.plan.stage_boundaries, "stages": pinned.plan.num_stages,
            "executable": [p.executable for p in plans],
            "alternatives": [(a.summary, a.executable) for a in compiled.plan.alternatives]}


@pytest.mark.timeout(180)
def test_compile_chooses_among_dp_tp_and_pp_plans_on_four_local_ranks():
    """The search ranks executable plans of every shape, pp ones included; the chosen one
    and a pp-only one (boundaries from the planner's balanced partition) match eager."""
    results = _launch(_choose_rank, 4)
    assert not any(r["fails"] for r in results), report([r["fails"] for r in results])
    r = results[0]
    assert all(r["executable"])
    shape = re.compile(r"pp(\d+)×dp(\d+)×tp(\d+)")
    shapes = set(r["mesh"][:1])
    for summary, executable in r["alternatives"]:
        assert executable, summary
        pp, dp, tp = map(int, shape.match(summary).groups())
        shapes.add((dp, tp, pp))
    assert any(pp > 1 for _, _, pp in shapes) and any(pp == 1 for _, _, pp in shapes), shapes
    assert any(tp > 1 for _, tp, _ in shapes) and any(dp > 1 for dp, _, _ in shapes), shapes
    assert r["mesh"][1][2] > 1 and len(r["boundaries"]) == r["stages"] - 1


# ============================================================================ the split
def _split(name: str, pp: int, schedule: str, v: int, boundaries=None):
    model = zoo_model(name)
    inputs, targets = ah.models.example_batch(name, 8, dtype=torch.float64)
    cap = capture(model, inputs, zoo_loss(name), targets)
    plan = ah.plan(model, ah.Cluster.local(pp), inputs,
                   constraints=ah.Constraints(pp=pp, dp=1, tp=1, schedule=schedule,
                                              virtual_stages=v, num_microbatches=4,
                                              stage_boundaries=boundaries))
    ctx = PassContext(plan=plan, rank=0, coords=(0, 0, 0))
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    run_passes(cap.gm, ctx, passes_for("train"))
    return plan, ctx.notes["pipeline"]


@pytest.mark.timeout(60)
def test_split_sends_activations_only_and_ties_first_and_last_stage():
    plan, split = _split("gpt-tiny", 2, "1f1b", 1)
    first, last = split.stages
    assert first.received == ("args_0",)                # the tokens, positionally
    assert len(first.sent) == 1 and first.sent == last.received   # the residual stream
    hidden = first.sent_vals[0]
    assert hidden.dim() == 3 and hidden.dtype == torch.float64 and first.sent_requires_grad[0]
    # every parameter is read by exactly the stages of its layers; the tied embedding by both
    assert split.shared_params == {"tok_emb.weight": (0, 1)}
    assert "blocks.0.attn.qkv.weight" in first.params
    assert "ln_f.weight" in last.params and "ln_f.weight" not in first.params
    # the last stage returns the loss numerator and denominator
    assert len(last.sent) == 2 and all(v.dim() == 0 for v in last.sent_vals)
    # V-shaped placement: stages 0 and 3 (embedding and head) on pp rank 0, no group needed
    plan_v, split_v = _split("gpt-tiny", 2, "zbv", 2)
    assert plan_v.stage_ranks() == (0, 1, 1, 0)
    assert split_v.shared_params["tok_emb.weight"] == (0, 3)


@pytest.mark.timeout(60)
def test_bad_stage_boundaries_are_refused_with_the_layer_names():
    with pytest.raises(PlanError, match="model.blocks.0"):
        _split("gpt-tiny", 2, "1f1b", 1, boundaries=("model.no_such_layer",))


@pytest.mark.timeout(60)
def test_batch_norm_models_are_not_pipelined():
    """BatchNorm in training mode updates buffers in its stage: refused, with the reason."""
    model = zoo_model("resnet-tiny")
    inputs, _ = ah.models.example_batch("resnet-tiny", 8, dtype=torch.float64)
    with pytest.raises(ah.NotExecutableError, match="BatchNorm"):
        ah.plan(model, ah.Cluster.local(2), inputs, executable_only=True,
                constraints=ah.Constraints(pp=2))
    assert ah.plan(model, ah.Cluster.local(2), inputs, executable_only=True).mesh.pp == 1
