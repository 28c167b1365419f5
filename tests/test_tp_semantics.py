"""The gradient semantics of tp layouts (issue 17: E2, E7, Qwen2-MoE's shared expert gate).

Process-free: every layout the sharding search returns carries a proof that each
collective's backward contract holds for its consumers (search/tp_gradients.py) — the
Megatron rules alone would split a residual stream into a hand-written RMSNorm, whose
statistics then feed a `tp_gather` with a partial gradient; the search refuses that layout
and replicates the linear instead, and the tp pass refuses to run such a layout if handed
one. Fused projections split by slices (`qkv[..., :q]`, Phi-3) and `chunk` (gate_up),
including unequal blocks (grouped-query q | k | v), become column-parallel pairs; a linear
with one output feature is replicated, not a reason to refuse tp.

With processes (one launch, tp = 2): those models, Gemma-style norms under sequence
parallelism (`1 + weight` broadcast over the sequence slices: its gradient is summed over
them), LSTM / GRU language models (float64 and float32) and Hugging Face Phi-3 train
exactly like eager (losses, gathered gradients and parameters after every step, SGD and
AdamW).
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import OPTIMIZERS, Failures, lm_loss, report, train_and_compare
from autohybrid.planning import make_plan
from autohybrid.capture import capture
from autohybrid.models.coverage import RNNLM
from autohybrid.search.sharding import linear_parts, param_key, propagate_layout
from autohybrid.search.space import profile
from autohybrid.search.tp_choice import Rates, choose_layout
from autohybrid.search.tp_gradients import gradient_problems, megatron_layout

VOCAB, HIDDEN, SEQ = 96, 32, 8
A100 = Rates.of(ah.Cluster.preset("dgx-a100-80gb"))


# ============================================================================ models
class RMSNorm(nn.Module):
    """Written out, as Hugging Face's Llama / Phi-3 norms are: element-wise ops only.
    `offset`: Gemma's, whose scale is `1 + weight` — a value computed from a parameter,
    broadcast over the sequence slices under sequence parallelism."""

    def __init__(self, width: int, offset: bool = False):
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter((0 if offset else 1) + 0.1 * torch.randn(width))

    def forward(self, x):
        scale = 1.0 + self.weight if self.offset else self.weight
        return scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n, t, d).reshape(b, h * n, t, d)


class FusedBlock(nn.Module):
    """Phi-3's block: one qkv projection sliced apart (q | k | v, grouped-query: unequal
    blocks), one gate_up projection chunked in two."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, inter: int = 64,
                 offset: bool = False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, HIDDEN // heads
        self.norm1, self.norm2 = RMSNorm(HIDDEN, offset), RMSNorm(HIDDEN, offset)
        self.qkv_proj = nn.Linear(HIDDEN, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.gate_up_proj = nn.Linear(HIDDEN, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, HIDDEN, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv_proj(self.norm1(x))
        q_pos, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shape = (b, t, -1, self.head_dim)
        q = qkv[..., :q_pos].view(shape).transpose(1, 2)
        k = qkv[..., q_pos:q_pos + kv].view(shape).transpose(1, 2)
        v = qkv[..., q_pos + kv:].view(shape).transpose(1, 2)
        n = self.heads // self.kv_heads
        a = F.scaled_dot_product_attention(q, _repeat_kv(k, n), _repeat_kv(v, n), is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up_proj(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down_proj(up * F.silu(gate))


class FusedLM(nn.Module):
    def __init__(self, kv_heads: int = 2, offset: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(FusedBlock(kv_heads=kv_heads, offset=offset)
                                    for _ in range(2))
        self.norm = RMSNorm(HIDDEN, offset)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class ResidualNormLM(nn.Module):
    """A linear on a replicated input whose output reaches a linear (Megatron: column) and
    a hand-written RMSNorm through the residual: split, the norm's statistics would feed a
    tp_gather with a partial gradient (the Phi-3 E2 layout, in miniature)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)
        self.norm = RMSNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        h = x + self.mix(x)
        return self.head(h + self.down(F.silu(self.up(self.norm(h)))))


class SharedExpertGateLM(nn.Module):
    """Qwen2-MoE's shared expert: its output scaled by sigmoid(Linear(hidden, 1))."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 64), nn.Linear(64, HIDDEN)
        self.shared_expert_gate = nn.Linear(HIDDEN, 1, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        shared = self.down(F.silu(self.up(x)))
        return self.head(x + torch.sigmoid(self.shared_expert_gate(x)) * shared)


def _tokens(seed: int, batch: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def _batches(steps: int = 3) -> list:
    return [((_tokens(100 + s),), _tokens(200 + s)) for s in range(steps)]


def _model(cls, *args) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args).double()


def _graph(model: nn.Module):
    (tokens,), targets = _batches(1)[0]
    return capture(model, (tokens,), lm_loss, targets)


def _roles(gm, layout) -> dict[str, str]:
    """Linear roles by weight name."""
    return {param_key(p.weight): layout.linear_roles[n.name] for n in gm.graph.nodes
            if (p := linear_parts(n)) is not None}


# ============================================================================ process-free
@pytest.mark.timeout(60)
def test_a_gather_into_a_non_replicated_consumer_is_not_a_layout():
    """Megatron's rules alone split `mix` (its output reaches `up`), so the residual is
    split on the hidden dim and the norm's mean all-gathers x², whose consumer gets a
    partial gradient (rsqrt(...) times a hidden-split x sums over one rank's slice): the
    proof finds it; the layouts the search returns replicate `mix` and keep the proof."""
    gm = _graph(_model(ResidualNormLM)).gm
    unproven = propagate_layout(gm, {})
    assert _roles(gm, unproven)["mix.weight"] == "column"
    problems = gradient_problems(gm, unproven)
    assert [p.kind for p in problems] == ["tp_gather"], problems
    text = problems[0].describe(gm)
    assert "partial gradient" in text and "mesh axis 'tp'" in text and "norm" in text, text
    nodes = {n.name: n for n in gm.graph.nodes}
    assert "mean" in nodes[problems[0].contract].target.__name__, problems[0]
    assert unproven.partial_grads  # the statistics' gradient is partial

    for layout in (megatron_layout(gm), choose_layout(gm, A100)):
        roles = _roles(gm, layout)
        assert roles["mix.weight"] == "replicate", roles
        assert (roles["up.weight"], roles["down.weight"], roles["head.weight"]) == \
            ("column", "row", "column"), roles
        assert gradient_problems(gm, layout) == [] and not layout.partial_grads
        assert not [c for c in layout.collectives if c.kind == "all_gather"]
        [(linear, why)] = layout.replicated_for_gradients.items()
        assert "tp_gather" in why and nodes[linear].meta["val"].shape[-1] == HIDDEN


@pytest.mark.timeout(120)
def test_tp_pass_refuses_an_unproven_layout_before_it_runs(monkeypatch):
    """Handed the unproven layout, the tp pass refuses (PlanError naming the split op, its
    module, the mesh axis and what to do) instead of building a program that trains
    wrongly."""
    from autohybrid.rewrite import rewrite
    tp_pass = importlib.import_module("autohybrid.passes.tensor_parallel")

    model = _model(ResidualNormLM)
    (tokens,), targets = _batches(1)[0]
    train = capture(model, (tokens,), lm_loss, targets)
    plan = make_plan(train, train, model, ah.Cluster.local(2), (tokens,), None, None,
                     ah.Constraints(dp=1, tp=2, pp=1, sp=False), "sgd", True)
    rewrite(train, plan, 0, fake_groups=True)  # the proven layout builds
    monkeypatch.setattr(tp_pass, "megatron_layout",
                        lambda gm, choices=None: propagate_layout(gm, choices or {}))
    with pytest.raises(ah.PlanError, match=r"broadcast along the shard dim on mesh axis 'tp'") \
            as info:
        rewrite(train, plan, 0, fake_groups=True)
    assert "module norm" in str(info.value) and "pin tp=1" in str(info.value)


@pytest.mark.timeout(60)
def test_fused_projections_split_by_slices_and_chunk_are_column_parallel():
    """Phi-3's qkv_proj (sliced into q | k | v: 32 | 16 | 16 with 2 of 4 KV heads) and
    gate_up_proj (chunked: 64 | 64) are column-parallel block by block, o_proj and
    down_proj row-parallel: the residual stream stays replicated, nothing is gathered."""
    gm = _graph(_model(FusedLM)).gm
    layout = megatron_layout(gm)
    roles = _roles(gm, layout)
    for i in range(2):
        p = f"blocks.{i}."
        assert (roles[p + "qkv_proj.weight"], roles[p + "o_proj.weight"],
                roles[p + "gate_up_proj.weight"], roles[p + "down_proj.weight"]) == \
            ("column", "row", "column", "row"), roles
        assert layout.fused_params[p + "qkv_proj.weight"] == (32, 16, 16)
        assert layout.fused_params[p + "gate_up_proj.weight"] == (64, 64)
    assert not [c for c in layout.collectives if c.kind == "all_gather"]
    assert gradient_problems(gm, layout) == [] and not layout.replicated_for_gradients


@pytest.mark.timeout(60)
def test_unequal_fused_blocks_shard_and_gather_back():
    """ShardSpec over q | k | v blocks of 32 | 16 | 16 rows: rank r holds its half of each
    block, and gathering every rank's shard gives the parameter back."""
    from autohybrid.program import ShardSpec

    full = torch.arange(64 * 3, dtype=torch.float64).view(64, 3)
    specs = [ShardSpec(0, 64, 64, 3, 2, r, (32, 16, 16)) for r in range(2)]
    shards = [s.local(full) for s in specs]
    assert shards[0].shape == (32, 3) and specs[0].shard_size == 32
    torch.testing.assert_close(shards[1], torch.cat([full[16:32], full[40:48], full[56:64]]))
    torch.testing.assert_close(specs[0].gather(shards), full)


@pytest.mark.timeout(60)
def test_a_linear_with_one_output_feature_is_replicated_not_a_reason_to_refuse_tp():
    """Qwen2-MoE's shared_expert_gate (hidden → 1) cannot be split: it is replicated and
    tp=2 stays possible; the shared expert around it keeps Megatron's pair."""
    cap = _graph(_model(SharedExpertGateLM))
    prof = profile(cap.gm, cap.dim_roles, A100)
    roles = _roles(cap.gm, prof.layout)
    assert roles["shared_expert_gate.weight"] == "replicate", roles
    assert (roles["up.weight"], roles["down.weight"]) == ("column", "row"), roles
    assert prof.tp_problem(2) is None and prof.tp_problem(4) is None


@pytest.mark.timeout(120)
def test_an_open_linear_tp_does_not_divide_is_replicated_by_the_pass():
    """mlp 16→32→32→6, the last linear open (its output reaches the loss, not a row
    linear): a plan that splits it runs it split at tp 2 and replicated at tp 4 (6 rows do
    not divide) — never refused for it."""
    from dataclasses import replace

    from autohybrid.plan import NodeSharding
    from autohybrid.rewrite import rewrite

    torch.manual_seed(0)
    model = ah.models.mlp(16, 32, 6, layers=3).double()
    x, y = torch.randn(8, 16, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    train = capture(model, (x,), F.mse_loss, y)
    assert megatron_layout(train.gm).open == ["linear_2"]
    for tp, split in ((2, True), (4, False)):
        plan = make_plan(train, train, model, ah.Cluster.local(tp), (x,), None, None,
                         ah.Constraints(dp=1, tp=tp, pp=1), "sgd", True)
        plan = replace(plan, shardings=(*plan.shardings,
                                        NodeSharding("layers.2.weight", "shard(0)")))
        shards = rewrite(train, plan, 0, fake_groups=True).param_shards
        assert ("layers.2.weight" in shards) == split, (tp, sorted(shards))
        assert "layers.0.weight" in shards  # Megatron's pair stays split


# ============================================================================ with processes
def _hf_phi3() -> nn.Module:
    import transformers
    config = transformers.Phi3Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4,
                                     intermediate_size=64, max_position_embeddings=64,
                                     pad_token_id=None, bos_token_id=0, eos_token_id=0)
    config.use_cache = False
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config).double().train()


def _rank(rank: int) -> list[str]:
    fails = Failures()
    batches = _batches()
    cases = [("phi3-style fused", _model(FusedLM), "sgd", False),
             ("phi3-style fused", _model(FusedLM), "adamw", False),
             ("phi3-style fused", _model(FusedLM), "adamw", True),
             ("residual norm (replicated for gradients)", _model(ResidualNormLM), "adamw",
              False),
             ("shared expert gate", _model(SharedExpertGateLM), "sgd", True),
             ("gemma-style norms (1 + weight)", _model(FusedLM, 2, True), "sgd", True),
             ("lstm lm", _model(RNNLM, "LSTM"), "sgd", False),
             ("lstm lm float32", _model(RNNLM, "LSTM").float(), "sgd", True),
             ("gru lm", _model(RNNLM, "GRU"), "sgd", True)]
    for name, model, optimizer, sp in cases:
        case = f"{name}/{optimizer}/tp2{'+sp' if sp else ''}"
        compiled, _ = train_and_compare(fails, case, model, batches, 2, loss_fn=lm_loss,
                                        optimizer=OPTIMIZERS[optimizer],
                                        constraints=ah.Constraints(tp=2, pp=1, sp=sp))
        fails.check(f"{case}: nothing split", bool(compiled.programs["train"].param_shards))
    if importlib.util.find_spec("transformers") is not None:
        train_and_compare(fails, "HF Phi3ForCausalLM labels= tp2", _hf_phi3(), batches, 2,
                          loss_fn=None, optimizer=OPTIMIZERS["sgd"], example_targets=False,
                          constraints=ah.Constraints(tp=2, pp=1, sp=False),
                          eager_loss=lambda m, i, t: m(input_ids=i[0], labels=t).loss)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(420)
def test_fused_projections_rnns_and_replicated_regions_train_like_eager_at_tp2():
    results = pool_launch(_rank, 2, timeout_s=guard(400))
    assert not any(results), report(results)
