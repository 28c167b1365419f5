"""Hand-written MoE loops folded into `autohybrid::moe_experts` at capture
(autohybrid/capture_moe_loop.py), process-free.

Models we did not write as the zoo writes MoE: transformers 4.4x's Mixtral and Qwen2-MoE
sparse blocks (one_hot mask, torch.where, index_add_; Qwen's shared expert beside the
loop) and a DeepSeek / nanoGPT-MoE style loop
(`torch.where(index == e)`, gelu experts, the experts visited in another order). Each
folds into one op, and the folded graph computes eager's loss and every parameter's
gradient (each expert's three weights included: the stacks' backward). Loops the op does
not compute — experts with biases, a loop that skips an expert, a loop value read
outside it, an expert that is not a gated MLP — stay as written, and still compute
eager's loss. The planner then sees one MoE layer of separate parameters (no expert
tensor parallelism) and the ep pass gives the op its slice of the stacks.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._sympy.symbol import SymT, symbol_is_type

import autohybrid as ah
from autohybrid.capture import capture
from autohybrid.graph import op_name
from autohybrid.passes import PassContext, passes_for, run_passes
from autohybrid.report.text import experts_text
from autohybrid.search.space import profile

MOE = "autohybrid.moe_experts.default"


class LoopExpert(torch.nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False, act=F.silu):
        super().__init__()
        self.w1 = torch.nn.Linear(hidden, inter, bias=bias)
        self.w2 = torch.nn.Linear(inter, hidden, bias=bias)
        self.w3 = torch.nn.Linear(hidden, inter, bias=bias)
        self.act = act

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class LoopMoE(torch.nn.Module):
    """Mixtral's original sparse block, as Hugging Face wrote it before its experts
    interface: a loop over the experts, each taking its tokens by torch.where over the
    routing mask and adding its output back with index_add_ (data-dependent sizes)."""

    def __init__(self, hidden: int = 32, inter: int = 48, experts: int = 4, k: int = 2,
                 bias: bool = False, skip: int | None = None):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(LoopExpert(hidden, inter, bias)
                                           for _ in range(experts))
        self.k, self.num_experts, self.skip = k, experts, skip

    def forward(self, hidden_states):   # (transformers 4.4x's MixtralSparseMoeBlock)
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim),
                                          dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            if expert_idx == self.skip:
                continue
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = self.experts[expert_idx](current_state) \
                * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x,
                                           current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


class WhereEqMoE(torch.nn.Module):
    """A DeepSeek / nanoGPT-MoE style loop: `torch.where(index == e)` gives (rows, slot),
    gelu experts, visited last to first; `counted`: the rows each expert took also
    leave the loop (a statistic added to the output)."""

    def __init__(self, hidden: int = 32, inter: int = 40, experts: int = 4, k: int = 2,
                 counted: bool = False):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(
            LoopExpert(hidden, inter, act=lambda t: F.gelu(t, approximate="tanh"))
            for _ in range(experts))
        self.k, self.counted = k, counted

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, indices = torch.topk(self.router(x).softmax(-1), self.k, dim=-1)
        y = torch.zeros_like(x)
        extra = 0.0
        for i in reversed(range(len(self.experts))):
            rows, top = torch.where(indices == i)
            y.index_add_(0, rows, self.experts[i](x[rows]) * weights[rows, top].unsqueeze(-1))
            if self.counted:
                extra = extra + rows.float().mean()
        return (y + extra).view(shape)


class QwenMLP(torch.nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenLoopMoE(torch.nn.Module):
    """transformers 4.4x's Qwen2MoeSparseMoeBlock: the Mixtral loop without renormalized
    top-k weights, beside a shared expert scaled by its own sigmoid gate."""

    def __init__(self, hidden: int = 32, inter: int = 24, experts: int = 4, k: int = 2):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(QwenMLP(hidden, inter) for _ in range(experts))
        self.shared_expert = QwenMLP(hidden, 2 * inter)
        self.shared_expert_gate = torch.nn.Linear(hidden, 1, bias=False)
        self.num_experts, self.top_k = experts, k

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros((batch_size * sequence_length, hidden_dim),
                                          dtype=hidden_states.dtype,
                                          device=hidden_states.device)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        for expert_idx in range(self.num_experts):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) \
                * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x,
                                           current_hidden_states.to(hidden_states.dtype))
        shared_expert_output = self.shared_expert(hidden_states)
        shared_expert_output = F.sigmoid(self.shared_expert_gate(hidden_states)) \
            * shared_expert_output
        final_hidden_states = final_hidden_states + shared_expert_output
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


class LoopLM(torch.nn.Module):
    def __init__(self, moe: torch.nn.Module | None = None, vocab: int = 64, hidden: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.moe = moe if moe is not None else LoopMoE(hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(h + self.moe(self.norm(h)))


class LoopBlock(torch.nn.Module):
    """A decoder block of torch-native attention and the Mixtral loop."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.attn = torch.nn.MultiheadAttention(hidden, 4, batch_first=True)
        self.moe = LoopMoE(hidden)

    def forward(self, x):
        a = self.ln1(x)
        x = x + self.attn(a, a, a, need_weights=False)[0]
        return x + self.moe(self.ln2(x))


class LoopDecoder(torch.nn.Module):
    def __init__(self, layers: int = 3, vocab: int = 64, hidden: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(LoopBlock(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _loss(out, t):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))


FOLDED = {"mixtral_4_4x": LoopMoE, "where_eq_gelu_reversed": WhereEqMoE,
          "qwen2_moe_4_4x_with_a_shared_expert": QwenLoopMoE,
          "mixtral_8_experts_top_3": lambda: LoopMoE(experts=8, k=3)}
AS_WRITTEN = {"experts_with_biases": lambda: LoopMoE(bias=True),
              "an_expert_skipped": lambda: LoopMoE(skip=2),
              "rows_read_outside_the_loop": lambda: WhereEqMoE(counted=True)}


def _batch(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (4, 12), generator=g), torch.randint(0, 64, (4, 12), generator=g)


def _graph_against_eager(model: torch.nn.Module):
    """(captured graph, the captured graph's loss and gradients against eager's)."""
    ids, t = _batch()
    cap = capture(model, (ids,), _loss, (t,))
    eager = copy.deepcopy(model)
    want = _loss(eager(ids), t)
    want.backward()
    state = {k: v.detach().clone().requires_grad_() for k, v in cap.default_state(model).items()}
    got = cap.run(state, (ids,), (t,))
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for name, p in eager.named_parameters():
        assert (state[name].grad is None) == (p.grad is None), name
        if p.grad is None:   # an expert the loop skips
            continue
        torch.testing.assert_close(state[name].grad, p.grad, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"{name}: {m}")
    return cap


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(FOLDED))
def test_a_hand_written_expert_loop_folds_into_one_op_computing_eagers_loss_and_grads(name):
    torch.manual_seed(0)
    model = LoopLM(FOLDED[name]()).double()
    cap = _graph_against_eager(model)
    ops = [op_name(n) for n in cap.gm.graph.nodes]
    assert ops.count(MOE) == 1, ops
    assert not {"aten.where.default", "aten.index_add_.default", "aten.nonzero.default"} \
        & set(ops), ops
    node = next(n for n in cap.gm.graph.nodes if op_name(n) == MOE)
    experts = len(model.moe.experts)
    assert node.args[5] == experts and tuple(node.args[3].meta["val"].shape)[0] == experts
    assert node.args[6] == ("gelu_tanh" if name == "where_eq_gelu_reversed" else "silu")
    # the loop's data-dependent row counts left the program with its nodes
    assert not [s for s in cap.exported.range_constraints
                if symbol_is_type(s, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))], \
        cap.exported.range_constraints


@pytest.mark.timeout(120)
def test_every_layer_of_a_decoder_of_loops_folds():
    torch.manual_seed(0)
    cap = _graph_against_eager(LoopDecoder(layers=3).double())
    ops = [op_name(n) for n in cap.gm.graph.nodes]
    assert ops.count(MOE) == 3 and "aten.where.default" not in ops


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(AS_WRITTEN))
def test_a_loop_the_op_does_not_compute_stays_as_written(name):
    torch.manual_seed(0)
    cap = _graph_against_eager(LoopLM(AS_WRITTEN[name]()).double())
    ops = [op_name(n) for n in cap.gm.graph.nodes]
    assert MOE not in ops and "aten.where.default" in ops


@pytest.mark.timeout(120)
def test_a_loop_captured_under_autocast_stays_as_written():
    """Autocast computes the experts in bfloat16 and adds them into float32 rows: the
    op would not round alike, so the loop is not folded."""
    torch.manual_seed(0)
    ids, t = _batch()
    cap = capture(LoopLM(), (ids,), _loss, (t,), autocast=torch.bfloat16)
    ops = [op_name(n) for n in cap.gm.graph.nodes]
    assert MOE not in ops and "aten.where.default" in ops


@pytest.mark.timeout(120)
def test_the_folded_loop_is_planned_as_one_moe_layer_of_separate_parameters():
    """The profile sees its experts (ep candidates: 1 and 2 on 2 ranks) but no expert
    tensor parallelism (tp cannot cut separate parameters stacked in the graph); its
    expert compute is priced by the routes (k of E experts per token), not every expert
    over every token; ep=2's pass gives each rank its half of the stacks."""
    torch.manual_seed(0)
    model = LoopLM().double()
    ids, t = _batch()
    cap = capture(model, (ids,), _loss, (t,))
    prof = profile(cap.gm, cap.dim_roles)
    assert prof.experts == (4,) and prof.experts_stacked
    assert not prof.expert_tp(2, False)
    moe = [v for v in (layer.values(4, 12) for layer in prof.layers) if v["moe_flops"]]
    tokens, hidden, inter, k = 48, 32, 48, 2
    assert len(moe) == 1 and moe[0]["moe_flops"] == pytest.approx(
        2 * tokens * k * 3 * hidden * inter, rel=0.05)
    plan = ah.plan(model, ah.Cluster.local(2), (ids,), loss_fn=_loss, example_targets=(t,),
                   constraints=ah.Constraints(ep=2, dp=2))
    assert plan.mesh.ep == 2 and plan.experts_stacked
    said = experts_text(plan)
    assert "separate parameters" in said and "holds 1/2" not in said, said
    assert ah.Plan.from_json(plan.to_json()).experts_stacked
    for rank in (0, 1):
        ctx = PassContext(plan=plan, rank=rank, coords=(0, rank, 0))
        ctx.notes["loss_output_index"] = cap.user_outputs[0]
        gm = run_passes(cap.gm, ctx, passes_for("train"))
        node = next(n for n in gm.graph.nodes if op_name(n) == MOE)
        assert node.args[7] == "ep"
        for weight in node.args[3:5]:
            assert op_name(weight) == "aten.slice.Tensor"
            assert weight.args[2:4] == (2 * rank, 2 * rank + 2)
