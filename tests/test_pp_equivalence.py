"""Pipeline-parallel training through `ah.compile` equals single-process eager training.

Every rank trains the compiled model (plans pinned to a pipeline schedule) and an eager
float64 copy on the whole batch, and compares the loss, the gathered gradients and the
gathered parameters after every step (tests/_equiv.py), under plain SGD and AdamW. Every
schedule at pp 2 and 4, alone and composed with dp and tp, is in tests/test_matrix.py's
sample; here pp×dp and pp×tp with gradient clipping across stages and shards (the GPTs
tie their embedding and output weights, which the first and last stage then both hold),
and Hugging Face GPT-2. Then the split itself: what crosses stages, the
tied weights' gradient groups, and the errors for bad boundaries; last, graphs that are not
pure dataflow (tensors written in place: BART's shifted labels, a block writing into its
input, a forward writing into the batch) and stage outputs made from parameters alone
(zero-bubble's split backward), with torch's nn.Transformer.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import (OPTIMIZERS, Failures, lm_loss, report, train_and_compare, zoo_batches,
                    zoo_loss, zoo_model)
from autohybrid.capture import capture
from autohybrid.errors import PlanError
from autohybrid.graph import VIEW_OPS, op_name
from autohybrid.passes import PassContext, passes_for, run_passes

LAUNCH_TIMEOUT_S = guard(240)
def _launch(fn, world: int, *args):
    return pool_launch(fn, world, args=(world, *args),
                     timeout_s=LAUNCH_TIMEOUT_S)


def _assert_no_failures(results) -> None:
    assert not any(results), report(results)


# ============================================================================ schedules
# Every schedule at pp 2 and pp 4, alone and with dp and tp, on every zoo model under
# SGD and AdamW, is proven by the all-pairs sample of tests/test_matrix.py
# (test_ci_sample_covers_every_schedule_at_pp_2_and_4 checks that it stays so); this
# file proves what the sample does not: clipping across stages, the forward, Hugging
# Face models, in-place writes, the split itself.


# ============================================================================ composed
def _composed_rank(rank: int, world: int) -> list[str]:
    """pp 2 × dp 2 and pp 2 × tp 2 (with and without sp) on 4 ranks, with gradient
    clipping (the global norm spans stages and shards), then the forward output:
    gpt-tiny (its tied embedding and output weight on the first and last stage, counted
    once in the norm) under pp×dp and pp×tp+sp, llama-tiny under pp×tp and pp×tp+sp."""
    fails = Failures()
    for name, meshes in (("gpt-tiny", ((2, 1, False, "1f1b", 1, "adamw"),
                                       (1, 2, True, "interleaved", 2, "sgd"))),
                         ("llama-tiny", ((1, 2, True, "interleaved", 2, "sgd"),
                                         (1, 2, False, "zbv", 2, "adamw")))):
        batches = zoo_batches(name, 8, steps=2)
        for dp, tp, sp, schedule, v, optimizer in meshes:
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


@pytest.mark.procs
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
        shared = compiled.programs["train"].pipeline.shared_params
        fails.check(f"hf-gpt2 {schedule}: tied wte/lm_head shared by the first and last "
                    f"stage ({shared})", "transformer.wte.weight" in shared)
    return fails


@pytest.mark.procs
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
    (tokens,), targets = batches[0]   # the best plan with tp: the search ranked it too
    with_tp = ah.plan(zoo_model("gpt-tiny"), ah.Cluster.local(world), (tokens,),
                      loss_fn=lm_loss, example_targets=targets, optimizer="adam",
                      constraints=ah.Constraints(tp=2), executable_only=True)
    return {"fails": list(fails), "chosen_s": compiled.plan.predicted.step_time_s,
            "tp_mesh": (with_tp.mesh.dp, with_tp.mesh.tp, with_tp.mesh.pp),
            "tp_s": with_tp.predicted.step_time_s,
            "mesh": [(p.mesh.dp, p.mesh.tp, p.mesh.pp) for p in plans],
            "boundaries": pinned.plan.stage_boundaries, "stages": pinned.plan.num_stages,
            "executable": [p.executable for p in plans],
            "alternatives": [(a.summary, a.executable) for a in compiled.plan.alternatives]}


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_compile_chooses_among_dp_tp_and_pp_plans_on_four_local_ranks():
    """The search ranks executable plans of every shape, pp ones included (the best with
    tp, planned apart, is predicted no faster than the choice); the chosen one and a
    pp-only one (boundaries from the planner's balanced partition) match eager."""
    results = _launch(_choose_rank, 4)
    assert not any(r["fails"] for r in results), report([r["fails"] for r in results])
    r = results[0]
    assert all(r["executable"])
    shape = re.compile(r"pp(\d+)×dp(\d+)×tp(\d+)")
    shapes = set(r["mesh"][:1])
    for summary, executable in r["alternatives"]:
        assert executable is None, summary  # runnable features; passes not tried
        pp, dp, tp = map(int, shape.match(summary).groups())
        shapes.add((dp, tp, pp))
    assert any(pp > 1 for _, _, pp in shapes) and any(pp == 1 for _, _, pp in shapes), shapes
    assert any(dp > 1 for dp, _, _ in shapes), shapes
    assert r["tp_mesh"][1] == 2 and r["tp_s"] >= r["chosen_s"] * (1 - 1e-9), r
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


# ============================================================================ in place
class _Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.a = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x)
        return x + torch.tanh(h if memory is None else h + memory)


class ShiftedSeq2Seq(nn.Module):
    """BART's pattern in small: encoder blocks; the decoder's inputs built in place from
    the labels (`shift_tokens_right`: new_zeros, a slice written, a column filled,
    masked_fill_), embedded by the embedding the encoder and the head share (tied) plus
    learned positions; every decoder block reads the encoder's output; the model computes
    its own loss from `labels=`."""

    def __init__(self, vocab: int = 24, hidden: int = 16, seq: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.enc = nn.ModuleList(_Block(hidden) for _ in range(2))
        self.dec_pos = nn.Embedding(seq, hidden)
        self.dec = nn.ModuleList(_Block(hidden) for _ in range(2))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.enc:
            x = block(x)
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 2
        shifted.masked_fill_(shifted == -100, 0)
        y = self.embed(shifted) + self.dec_pos(torch.arange(labels.shape[1]))
        for block in self.dec:
            y = block(y, x)
        return F.cross_entropy(self.head(y).flatten(0, 1), labels.flatten())


class _WritesItsInput(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.a = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, 0] = 0.0  # in place, into the previous block's output
        return x + torch.tanh(self.a(x))


class WritesActivation(nn.Module):
    """A block that writes into the activation it receives, which the model also read
    before the write (`skip`)."""

    def __init__(self, hidden: int = 12):
        super().__init__()
        self.first = _Block(hidden)
        self.blocks = nn.ModuleList([_WritesItsInput(hidden), _Block(hidden)])
        self.head = nn.Linear(hidden, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.first(x)
        skip = a * 0.5
        for block in self.blocks:
            a = block(a)
        return self.head(a + skip).mean(1)


class WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)
        for block in self.blocks:
            x = block(x)
        return x


def _seq2seq_batches(steps: int = 2, batch: int = 4) -> list:
    g = torch.Generator().manual_seed(5)
    return [((torch.randint(1, 24, (batch, 8), generator=g),),
             torch.randint(1, 24, (batch, 8), generator=g)) for _ in range(steps)]


def _labels_loss(model, inputs, targets):
    return model(*inputs, labels=targets)


def _in_place_rank(rank: int, world: int) -> list[str]:
    """The in-place / parameter-only-output patterns and torch's nn.Transformer at pp 2,
    trained against eager: the shifted decoder inputs read in a later stage than the one
    the writes were attributed to (GPipe), the decoder embedding alone in a stage that
    forwards the encoder's output (its output has no received activation upstream: the
    zero-bubble weight step used to drop the tied embedding's and the positions'
    gradients), a write into a received activation, and nn.Transformer under zero-bubble
    (its cross-attention hands back the encoder output's gradient transposed)."""
    from autohybrid.models import coverage
    fails = Failures()
    cases = [
        ("shifted-labels/gpipe", ShiftedSeq2Seq, ("model.embed#2",), "gpipe", 1, 2, "sgd"),
        ("shifted-labels/zero-bubble", ShiftedSeq2Seq,
         ("model.enc.1", "model.embed#2", "model.dec.0"), "zero-bubble", 2, 2, "adamw"),
    ]
    for case, cls, boundaries, schedule, v, m, optimizer in cases:
        torch.manual_seed(0)
        constraints = ah.Constraints(pp=2, dp=1, tp=1, schedule=schedule, virtual_stages=v,
                                     num_microbatches=m, stage_boundaries=boundaries)
        train_and_compare(fails, case, cls().double(), _seq2seq_batches(), world,
                          loss_fn=None, eager_loss=_labels_loss,
                          optimizer=OPTIMIZERS[optimizer], constraints=constraints)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(6)
    batches = [((torch.randn(4, 3, 12, generator=g, dtype=torch.float64),),
                torch.randint(0, 5, (4,), generator=g)) for _ in range(2)]
    train_and_compare(fails, "writes-activation/1f1b", WritesActivation().double(), batches,
                      world, loss_fn=F.cross_entropy, optimizer=OPTIMIZERS["sgd"],
                      constraints=ah.Constraints(pp=2, dp=1, tp=1, schedule="1f1b",
                                                 num_microbatches=2,
                                                 stage_boundaries=("model.blocks.0",)))
    # ZB-V puts stages 1 and 2 on pp rank 1: a max pool and a tanh, weightless, so that
    # rank trains nothing and builds no optimizer (torch's refuse an empty list)
    for optimizer in ("sgd", "adamw"):
        torch.manual_seed(0)
        weightless_middle = nn.Sequential(nn.Linear(12, 12), nn.MaxPool1d(2), nn.Tanh(),
                                          nn.Flatten(), nn.Linear(18, 5)).double()
        compiled, _ = train_and_compare(
            fails, f"weightless stages/{optimizer}", weightless_middle, batches, world,
            loss_fn=F.cross_entropy, optimizer=OPTIMIZERS[optimizer],
            constraints=ah.Constraints(pp=2, dp=1, tp=1, schedule="zbv", virtual_stages=2,
                                       num_microbatches=4,
                                       stage_boundaries=("model.1", "model.2", "model.3")))
        fails.check(f"weightless stages/{optimizer}: rank {rank} optimizer "
                    f"{type(compiled.optimizer).__name__}",
                    (compiled.optimizer is None) == (rank == 1))
    case = coverage.build("transformer")
    train_and_compare(fails, "nn.Transformer/zero-bubble", case.model, case.batches[:2], world,
                      loss_fn=case.loss_fn, optimizer=OPTIMIZERS["sgd"],
                      constraints=ah.Constraints(pp=2, dp=1, tp=1, schedule="zero-bubble",
                                                 virtual_stages=2, num_microbatches=2))
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_in_place_writes_parameter_only_outputs_and_nn_transformer_at_pp2_match_eager():
    _assert_no_failures(_launch(_in_place_rank, 2))


def _chain(split, args: list, inputs: tuple) -> tuple:
    """The stages run one after the other in this process (no pipeline runtime)."""
    values = list(inputs)
    for stage in split.stages:
        values = list(stage.gm(*values, *[args[i] for i in stage.local_placeholders]))
    return tuple(values)


@pytest.mark.timeout(120)
def test_split_replays_in_place_writes_of_batch_values_at_every_boundary():
    """The decoder inputs built in place from the labels: each stage that reads them
    computes them again with all their writes, wherever the boundary falls (the split
    used to recompute `new_zeros` and `masked_fill_` in the reading stage but leave the
    slice writes in the stage of their layer: the decoder embedded zeros). The stages
    chained in one process give the whole graph's loss and gradients."""
    import dataclasses

    from autohybrid.passes.pipeline_split import assign_stages
    from autohybrid.search.layers import segment

    torch.manual_seed(0)
    model = ShiftedSeq2Seq().double()
    (tokens,), labels = _seq2seq_batches(1)[0]
    cap = capture(model, (tokens,), None, (labels,))
    plan = ah.plan(model, ah.Cluster.local(2), (tokens,), example_targets=(labels,),
                   constraints=ah.Constraints(pp=2, dp=1, tp=1, schedule="gpipe",
                                              num_microbatches=1))
    state = cap.default_state(model)
    params = [p for p in state.values() if p.requires_grad]
    args = cap.flat_args(state, (tokens,), (labels,))
    names = [layer.name for layer in segment(cap.gm)]
    for boundary in names[1:]:
        ctx = PassContext(plan=dataclasses.replace(plan, stage_boundaries=(boundary,)),
                          rank=0, coords=(0, 0, 0))
        ctx.notes["loss_output_index"] = cap.user_outputs[0]
        gm = run_passes(cap.gm, ctx, passes_for("train"))
        split = ctx.notes["pipeline"]
        whole, piped = gm(*args), _chain(split, args, (tokens,))
        for what, i in (("numerator", cap.user_outputs[0]), ("denominator", -1)):
            torch.testing.assert_close(piped[i], whole[i], msg=f"{boundary}: loss {what}")
        want = torch.autograd.grad(whole[cap.user_outputs[0]], params)
        got = torch.autograd.grad(piped[cap.user_outputs[0]], params, allow_unused=True)
        for p, w, g in zip(state, want, got):
            torch.testing.assert_close(g if g is not None else torch.zeros_like(w), w,
                                       msg=f"{boundary}: gradient of {p}")
        # the writes and what they write into share a stage: the one that reads them first
        stage_of = assign_stages(gm, (boundary,), 2)
        writes = {stage_of[n] for n in gm.graph.nodes if n.op == "call_function"
                  and n.name.startswith(("new_zeros", "copy_", "fill_", "masked_fill_"))}
        assert len(writes) == 1, (boundary, writes)


@pytest.mark.timeout(60)
def test_split_keeps_a_written_activation_with_its_writes_and_earlier_readers():
    """`a` (made by model.first) is written in place by model.blocks.0 and read before the
    write (`skip = a * 0.5`): with the boundary at blocks.0, `a`, `skip` and the write run
    in stage 1 in graph order (stage 0 sends what `a` is computed from), never a write
    into a tensor received from another stage."""
    torch.manual_seed(0)
    model = WritesActivation().double()
    x = torch.randn(4, 3, 12, dtype=torch.float64)
    y = torch.randint(0, 5, (4,))
    cap = capture(model, (x,), F.cross_entropy, (y,))
    plan = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=F.cross_entropy,
                   example_targets=(y,),
                   constraints=ah.Constraints(pp=2, dp=1, tp=1, schedule="gpipe",
                                              num_microbatches=1,
                                              stage_boundaries=("model.blocks.0",)))
    ctx = PassContext(plan=plan, rank=0, coords=(0, 0, 0))
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    gm = run_passes(cap.gm, ctx, passes_for("train"))
    first, second = ctx.notes["pipeline"].stages
    ops = [n.name for n in second.gm.graph.nodes if n.op == "call_function"]
    assert any(o.startswith("fill_") or o.startswith("copy_") for o in ops), ops
    assert not any(n.name.startswith(("fill_", "copy_"))
                   for n in first.gm.graph.nodes), first.gm.code
    for node in second.gm.graph.nodes:
        if node.name.startswith(("fill_", "copy_")):
            base = node.args[0]
            while base.op == "call_function" and op_name(base) in VIEW_OPS:
                base = base.args[0]
            assert base.op != "placeholder", f"{node.name} writes into received {base.name}"
    args = cap.flat_args(cap.default_state(model), (x.clone(),), (y,))
    whole = gm(*args)
    args = cap.flat_args(cap.default_state(model), (x.clone(),), (y,))
    torch.testing.assert_close(_chain(ctx.notes["pipeline"], args, (x.clone(),))[0], whole[0])


@pytest.mark.timeout(60)
def test_in_place_writes_into_an_input_are_never_pipelined():
    """Each stage holds its own copy of the batch: a forward that writes into its input
    cannot be split. The planner does not choose pp for it, a pinned pp=2 is refused
    before anything runs, and the pass refuses such a plan naming the node."""
    torch.manual_seed(0)
    model = WritesItsInput().double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    loss = lambda out, t: F.mse_loss(out, t)  # noqa: E731
    chosen = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=loss, example_targets=(y,),
                     executable_only=True)
    assert chosen.mesh.pp == 1
    pinned = ah.Constraints(pp=2, dp=1, tp=1)
    with pytest.raises(ah.NotExecutableError, match=r"mul_.*writes in place into the input"):
        ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=loss, example_targets=(y,),
                executable_only=True, constraints=pinned)
    plan = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=loss, example_targets=(y,),
                   constraints=pinned)
    assert not plan.executable and "writes in place" in " ".join(plan.not_executable_because)
    cap = capture(model, (x,), loss, (y,))
    ctx = PassContext(plan=plan, rank=0, coords=(0, 0, 0))
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    with pytest.raises(PlanError, match=r"node 'mul_' \(aten\.mul_\.Tensor"):
        run_passes(cap.gm, ctx, passes_for("train"))


@pytest.mark.timeout(30)
def test_split_backward_keeps_gradients_of_outputs_made_from_parameters_alone():
    """torch's split backward (zero-bubble: input step, then weight step) computes a
    parameter's gradient from what it saved where the parameter's paths meet the stage
    inputs'; an output made from parameters alone has no such place, so torch drops its
    gradient on every stage but the first. runtime.pipeline._param_only_grads adds it in
    the input step: the same gradients as one full backward."""
    from torch.distributed.pipelining._backward import (stage_backward_input,
                                                        stage_backward_weight)

    from autohybrid.runtime.pipeline import _param_only_grads

    def run(fix: bool) -> tuple:
        torch.manual_seed(0)
        w, pos = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(4, 3))
        received = torch.randn(4, 3, requires_grad=True)
        outs = [received @ w, pos @ w + pos]          # the second has no input upstream
        grads = [torch.randn(4, 3), torch.randn(4, 3)]
        if fix:
            _param_only_grads(outs, grads, [received], [w, pos])
        dinputs, groups = stage_backward_input(outs, grads, [received], iter([w, pos]))
        stage_backward_weight(iter([w, pos]), groups)
        return dinputs[0], w.grad, pos.grad

    torch.manual_seed(0)
    w, pos = nn.Parameter(torch.randn(3, 3)), nn.Parameter(torch.randn(4, 3))
    received = torch.randn(4, 3, requires_grad=True)
    outs = [received @ w, pos @ w + pos]
    torch.autograd.backward(outs, [torch.randn(4, 3), torch.randn(4, 3)])
    full = (received.grad, w.grad, pos.grad)
    for got, want in zip(run(fix=True), full):
        torch.testing.assert_close(got, want)
    dropped = run(fix=False)
    assert dropped[2] is None or not torch.allclose(dropped[2], full[2])  # torch's own


class _Picked(nn.Module):
    """Rows picked by torch.where (a data-dependent count) through two layers, added back."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 5)

    def forward(self, x):
        rows = torch.where(x.sum(-1) > 0)[0]
        picked = self.b(torch.tanh(self.a(x[rows])))
        return self.c(torch.zeros_like(x).index_add(0, rows, picked))


@pytest.mark.timeout(120)
def test_a_stage_boundary_a_data_sized_value_would_cross_is_refused():
    """A stage receives into buffers sized before the values arrive: a boundary where
    rows whose count only the data gives would travel is refused with the reason (it
    failed at the first step: sympy could not size the buffer); the other boundaries
    split, and the stages chained give the whole graph's loss."""
    import dataclasses

    from autohybrid.search.layers import segment

    x, t = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 5, (8,))
    model = _Picked().double()
    cap = capture(model, (x,), F.cross_entropy, (t,))
    plan = ah.plan(model, ah.Cluster.local(2), (x,), loss_fn=F.cross_entropy,
                   example_targets=(t,), constraints=ah.Constraints(
                       pp=2, dp=1, tp=1, schedule="gpipe", num_microbatches=1))
    args = cap.flat_args(cap.default_state(model), (x,), (t,))
    outcomes = {}
    for boundary in [layer.name for layer in segment(cap.gm)][1:]:
        ctx = PassContext(plan=dataclasses.replace(plan, stage_boundaries=(boundary,)),
                          rank=0, coords=(0, 0, 0))
        ctx.notes["loss_output_index"] = cap.user_outputs[0]
        try:
            gm = run_passes(cap.gm, ctx, passes_for("train"))
        except PlanError as exc:
            assert "depends on the data" in str(exc), (boundary, exc)
            outcomes[boundary] = "refused"
            continue
        whole, piped = gm(*args), _chain(ctx.notes["pipeline"], args, (x,))
        torch.testing.assert_close(piped[cap.user_outputs[0]], whole[cap.user_outputs[0]])
        outcomes[boundary] = "split"
    assert set(outcomes.values()) == {"refused", "split"}, outcomes


# ============================================================================ split backward
class _SharedTableBlock(nn.Module):
    """Attention against a raw table every block reads (DeBERTa's relative-position
    embeddings: `q(h) @ r.t()`, `softmax(s) @ r`)."""

    def __init__(self, d: int):
        super().__init__()
        self.lin, self.q = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, h, r):
        s = self.q(h) @ r.t()
        return h + torch.tanh(self.lin(h) + s.softmax(-1) @ r)


class SharedTable(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 16, layers: int = 4):
        super().__init__()
        self.emb, self.rel = nn.Embedding(vocab, d), nn.Embedding(8, d)
        self.blocks = nn.ModuleList(_SharedTableBlock(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h, r = self.emb(x), self.rel.weight
        for b in self.blocks:
            h = b(h, r)
        return self.head(h)


class TiedCatHead(nn.Module):
    """MobileBERT's masked-LM head: logits = h @ cat([embedding.weight.t(), extra]) — the
    tied weight read transposed, so the head's stage computes its gradient transposed."""

    def __init__(self, vocab: int = 64, e: int = 8, d: int = 16):
        super().__init__()
        self.emb, self.up = nn.Embedding(vocab, e), nn.Linear(e, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.extra = nn.Parameter(torch.randn(d - e, vocab) * 0.1)

    def forward(self, x):
        h = self.up(self.emb(x))
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return h @ torch.cat([self.emb.weight.t(), self.extra], dim=0)


@pytest.mark.timeout(60)
def test_split_backward_is_unsafe_where_a_table_is_read_again_after_other_layers():
    """torch's weight step runs one autograd.grad per parameter group, freeing what it ran
    through: with a table read by two blocks, the table's group runs back through the
    second block's `q` linear (another group's start) and that group's call fails.
    `split_is_safe` sees it from the graph; one block, or a plain stack, is safe (their
    stages keep the split backward)."""
    from autohybrid.runtime.split_backward import split_is_safe

    def stage(layers: int, shared: bool):
        torch.manual_seed(0)
        model = SharedTable(layers=layers).double()
        received = torch.randn(2, 5, 16, dtype=torch.double, requires_grad=True)
        h, r = received, model.rel.weight
        for b in model.blocks:
            h = b(h, r) if shared else b(h, r.detach())
        return [h.pow(2).sum()], [received], list(model.parameters())

    assert split_is_safe(*stage(1, shared=True))
    assert not split_is_safe(*stage(2, shared=True))
    assert not split_is_safe(*stage(3, shared=True))
    assert split_is_safe(*stage(3, shared=False))


def _split_backward_rank(rank: int, world: int) -> list[str]:
    from transformers import (DebertaV2Config, DebertaV2ForMaskedLM, MobileBertConfig,
                              MobileBertForMaskedLM)

    vocab, seq = 64, 12
    g = torch.Generator().manual_seed(100)
    batches = [((torch.randint(2, vocab, (8, seq), generator=g),),
                torch.randint(0, vocab, (8, seq), generator=g)) for _ in range(2)]

    def deberta():
        return DebertaV2ForMaskedLM(DebertaV2Config(
            vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=seq, relative_attention=True,
            pos_att_type=["p2c", "c2p"], position_buckets=8, max_relative_positions=-1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def mobilebert():
        return MobileBertForMaskedLM(MobileBertConfig(
            vocab_size=vocab, embedding_size=8, hidden_size=16, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=16, intra_bottleneck_size=8,
            true_hidden_size=8, max_position_embeddings=seq, num_feedforward_networks=2,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    def logits_loss(out, t):
        logits = out if isinstance(out, torch.Tensor) else out["logits"]
        return lm_loss(logits, t)

    fails = Failures()
    for name, build in (("shared table", SharedTable), ("tied transposed head", TiedCatHead),
                        ("HF DeBERTa-v2", deberta), ("HF MobileBERT", mobilebert)):
        for schedule in ("zero-bubble", "zbv"):
            torch.manual_seed(0)
            try:
                train_and_compare(
                    fails, f"{name} pp2 {schedule}", build().double(), batches, world,
                    loss_fn=logits_loss, optimizer=OPTIMIZERS["sgd"],
                    eager_loss=lambda m, i, t: logits_loss(m(i[0]), t),
                    constraints=ah.Constraints(pp=2, tp=1, schedule=schedule))
            except PlanError as exc:   # zbv needs two stages per rank
                fails.check(f"{name} {schedule}: refused ({exc})", schedule == "zbv")
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_zero_bubble_schedules_train_shared_tables_and_transposed_tied_heads_like_eager():
    """Found on models the suite did not know (Hugging Face DeBERTa-v2 and MobileBERT,
    the planner's own pp2 choice for each): DeBERTa's shared relative-position table made
    torch's weight step fail ("backward through the graph a second time"); MobileBERT's
    tied embedding, read transposed by its head, got a silently wrong gradient (the head's
    stage held it transposed, the embedding's row-major, and the all-reduce summing them
    adds storage, not indices). Now a stage whose split is unsafe runs its backward whole
    in the input step (runtime/split_backward.py), and a tied gradient is made contiguous
    before it is summed."""
    _assert_no_failures(_launch(_split_backward_rank, 2))
