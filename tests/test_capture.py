"""Tests of autohybrid.capture: model (+ loss) → one ATen training-IR graph.

Pure graph tests (no processes): every tiny zoo preset on a real and on the meta device,
with and without a loss; Hugging Face GPT-2 and Llama; a nanoGPT-style model that returns
(logits, loss); GPT-3 175B on meta; the torch.fx.symbolic_trace fallback; and the
readable CaptureErrors for data-dependent control flow and for inputs of the wrong shape.
Numerics are always compared with eager PyTorch on the same parameters, at a batch (and
sequence) size different from the example's, so the symbolic dims are exercised.
"""
from __future__ import annotations

import copy
import inspect
import operator
import resource
import sys
import time

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from autohybrid import models
from autohybrid.capture import CapturedGraph, capture
from autohybrid.graph import AH_ROLE, SYM_SIZE_OPS, graph_hash, placeholders, verify

TINY = ["gpt-tiny", "llama-tiny", "mlp-tiny", "resnet-tiny"]
ROLES = {"param", "buffer", "constant", "input", "target"}


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim, for (batch, classes) and (batch, seq, vocab)."""
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def _check_format(cap: CapturedGraph, model: nn.Module) -> None:
    """ATen only, every placeholder with a role, counts matching the signature."""
    verify(cap.gm)
    for node in cap.gm.graph.nodes:
        assert node.op in ("placeholder", "call_function", "output", "get_attr"), node.format_node()
        if node.op == "call_function":
            assert (isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))
                    or node.target is operator.getitem
                    or node.target in SYM_SIZE_OPS), node.format_node()
    roles = [n.meta.get(AH_ROLE) for n in placeholders(cap.gm)]
    assert set(roles) <= ROLES and None not in roles
    assert roles.count("param") == len(cap.param_fqns)
    assert roles.count("buffer") == len(cap.buffer_fqns)
    assert roles.count("input") == cap.num_inputs
    assert roles.count("target") == cap.num_targets
    # parameter names are the model's own; the unique ones are exactly its parameters
    assert set(cap.canonical.values()) == {n for n, _ in model.named_parameters()}
    assert set(cap.buffer_fqns) <= {n for n, _ in model.named_buffers()}


def _symbols(cap: CapturedGraph, role: str) -> list:
    return [s for s, r in cap.dim_roles.items() if r == role]


def _other_batch(name: str, batch: int, seq: int | None = None):
    return models.example_batch(name, batch, seq=seq, seed=7)


# --------------------------------------------------------------------------- zoo presets


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("with_loss", [True, False], ids=["loss", "forward"])
def test_zoo_preset_capture_matches_eager_at_other_sizes(name: str, with_loss: bool) -> None:
    torch.manual_seed(0)
    model = models.preset(name)
    inputs, targets = models.example_batch(name, 4)
    if with_loss:
        cap = capture(model, inputs, _loss, targets)
    else:
        cap = capture(model, inputs, with_loss=False)
    _check_format(cap, model)
    assert cap.method == "export" and cap.with_loss == with_loss
    assert len(_symbols(cap, "batch")) >= 1
    tokens = model.kind in ("gpt", "llama")
    assert bool(_symbols(cap, "seq")) == tokens  # seq is symbolic for token inputs only
    # batch symbols are the dim-0 sizes of the input placeholders, seq the dim-1 sizes
    for node in placeholders(cap.gm, "input"):
        val = node.meta["val"]
        assert cap.dim_roles[val.shape[0].node.expr] == "batch"
        if tokens:
            assert cap.dim_roles[val.shape[1].node.expr] == "seq"

    (x,), y = _other_batch(name, 3, seq=11 if tokens else None)
    eager_model = copy.deepcopy(model)  # BatchNorm running stats: both sides update once
    state = cap.default_state(model)
    if with_loss:
        got = cap.run(state, (x,), (y,))
        want = _loss(eager_model(x), y)
    else:
        got = cap.run(state, (x,))
        want = eager_model(x)
    torch.testing.assert_close(got, want)
    for (bname, buf), (_, eager_buf) in zip(model.named_buffers(), eager_model.named_buffers()):
        torch.testing.assert_close(buf, eager_buf, msg=f"buffer {bname}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TINY)
def test_zoo_preset_capture_on_meta(name: str) -> None:
    meta = models.preset(name, device="meta")
    inputs, targets = models.example_batch(name, 4, device="meta")
    for with_loss in (True, False):
        cap = capture(meta, inputs, _loss, targets, with_loss=with_loss)
        _check_format(cap, meta)
        assert cap.method == "export"
        assert len(_symbols(cap, "batch")) >= 1
        assert bool(_symbols(cap, "seq")) == (meta.kind in ("gpt", "llama"))
        assert all(n.meta["val"].device.type == "meta" for n in placeholders(cap.gm))
    # the same model on the CPU has the same graph hash: a plan made on meta serves it
    real = models.preset(name)
    real_inputs, _ = models.example_batch(name, 4)
    assert capture(real, real_inputs, with_loss=False).hash == cap.hash


@pytest.mark.timeout(60)
def test_tied_weights_map_to_one_canonical_parameter_and_sum_gradients() -> None:
    torch.manual_seed(0)
    model = models.preset("gpt-tiny")
    assert model.lm_head.weight is model.tok_emb.weight
    inputs, targets = models.example_batch("gpt-tiny", 4)
    cap = capture(model, inputs, _loss, targets)
    assert cap.canonical["lm_head.weight"] == cap.canonical["tok_emb.weight"] == "tok_emb.weight"
    state = cap.default_state(model)
    assert "lm_head.weight" not in state and state["tok_emb.weight"] is model.tok_emb.weight

    (x,), y = _other_batch("gpt-tiny", 2, seq=9)
    eager = copy.deepcopy(model)
    cap.run(state, (x,), (y,)).backward()
    _loss(eager(x), y).backward()
    for (pname, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=f"gradient of {pname}")


@pytest.mark.timeout(60)
def test_graph_hash_is_stable_and_changes_with_sizes() -> None:
    inputs, _ = models.example_batch("gpt-tiny", 4)

    def hash_of(**overrides) -> str:
        torch.manual_seed(len(overrides))  # parameter values must not matter
        model = models.preset("gpt-tiny", **overrides)
        cap = capture(model, inputs, with_loss=False)
        assert cap.hash == graph_hash(cap.gm)
        return cap.hash

    base = hash_of()
    assert hash_of() == base
    other_batch, _ = models.example_batch("gpt-tiny", 6, seq=12)
    assert capture(models.preset("gpt-tiny"), other_batch, with_loss=False).hash == base
    changed = {hash_of(hidden=64), hash_of(layers=3), hash_of(vocab=128)}
    assert base not in changed and len(changed) == 3
    assert capture(models.preset("gpt-tiny", dtype=torch.float64), inputs,
                   with_loss=False).hash != base


# --------------------------------------------------------------------------- Hugging Face


def _hf_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _hf_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                         max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


class _Logits(nn.Module):
    """A Hugging Face causal LM as a module that returns `.logits`."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("build", [_hf_gpt2, _hf_llama], ids=["gpt2", "llama"])
def test_hugging_face_models(build) -> None:
    torch.manual_seed(0)
    lm = build()
    ids, labels = torch.randint(0, 96, (4, 12)), torch.randint(0, 96, (4, 12))
    ids2, labels2 = torch.randint(0, 96, (3, 9)), torch.randint(0, 96, (3, 9))

    wrapped = _Logits(lm)
    cap = capture(wrapped, (ids,), _loss, (labels,))
    _check_format(cap, wrapped)
    assert _symbols(cap, "batch") and _symbols(cap, "seq")
    torch.testing.assert_close(cap.run(cap.default_state(wrapped), (ids2,), (labels2,)),
                               _loss(wrapped(ids2), labels2))

    # loss_fn=None: the model computes its own loss from labels= (HF shifts them itself)
    own = capture(lm, (ids,), None, (labels,))
    _check_format(own, lm)
    assert _symbols(own, "batch") and _symbols(own, "seq")
    torch.testing.assert_close(own.run(own.default_state(lm), (ids2,), (labels2,)),
                               lm(ids2, labels=labels2).loss)
    tied = [n for n in own.param_fqns if own.canonical[n] != n]
    if lm.config.tie_word_embeddings:
        assert tied == ["lm_head.weight"]
        assert lm.get_parameter(own.canonical["lm_head.weight"]) is lm.lm_head.weight


class NanoGPT(nn.Module):
    """nanoGPT's interface: forward(idx, targets=None) -> (logits, loss)."""

    def __init__(self, vocab: int = 50, hidden: int = 16, seq: int = 16):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.block = nn.TransformerEncoderLayer(hidden, 2, 32, dropout=0.0, batch_first=True)
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        logits = self.lm_head(self.ln_f(self.block(x, src_mask=mask, is_causal=True)))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1)
        return logits, loss


@pytest.mark.timeout(60)
def test_nanogpt_style_model_returning_logits_and_loss() -> None:
    torch.manual_seed(0)
    model = NanoGPT()
    ids, tg = torch.randint(0, 50, (4, 10)), torch.randint(0, 50, (4, 10))
    cap = capture(model, (ids,), None, (tg,))
    _check_format(cap, model)
    assert cap.with_loss and _symbols(cap, "batch") and _symbols(cap, "seq")
    ids2, tg2 = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7))
    tg2[0, :3] = -1  # ignored positions
    got = cap.run(cap.default_state(model), (ids2,), (tg2,))
    torch.testing.assert_close(got, model(ids2, tg2)[1])


# --------------------------------------------------------------------------- GPT-3 175B


@pytest.fixture(scope="module")
def gpt3_175b_capture():
    """One capture of GPT-3 175B on meta, with the time and peak-RSS growth it took."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    model = ah.models.preset("gpt3-175b", device="meta")
    ids = torch.empty(8, 2048, dtype=torch.long, device="meta")
    cap = capture(model, (ids,), with_loss=False)
    seconds = time.perf_counter() - start
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return model, cap, seconds, (rss_after - rss_before) * scale


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_gpt3_175b_on_meta_captures_without_allocating(gpt3_175b_capture) -> None:
    """The capture's time is printed (benchmarks/search_scaling.py records it); the
    timeout only catches a hang."""
    model, cap, seconds, rss_growth = gpt3_175b_capture
    print(f"GPT-3 175B captured on meta in {seconds:.1f} s")
    assert rss_growth < 3 * 2**30, f"peak RSS grew by {rss_growth / 2**30:.2f} GiB"
    _check_format(cap, model)
    assert len(_symbols(cap, "batch")) == 1 and len(_symbols(cap, "seq")) == 1
    l, h, v, s = 96, 12288, 51200, 2048  # GPT-3 paper, tied head
    unique = {cap.canonical[f] for f in cap.param_fqns}
    count = sum(model.get_parameter(f).numel() for f in unique)
    assert count == 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h


# --------------------------------------------------------------------------- fallback


class PlainTensorAttribute(nn.Module):
    """Branches on a plain tensor attribute (not a buffer): torch.export (non-strict) sees
    a fake tensor there and rejects the data-dependent `if`; torch.fx.symbolic_trace reads
    the real value, keeps the taken branch, and the traced graph exports."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 12)
        self.fc2 = nn.Linear(12, 4)
        self.scale = torch.tensor(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.fc1(x))
        if self.scale > 1:
            y = y * self.scale
        return self.fc2(y)


@pytest.mark.timeout(60)
def test_symbolic_trace_fallback_for_a_model_export_rejects() -> None:
    """A real model non-strict torch.export rejects (checked here), captured by the
    torch.fx.symbolic_trace fallback into the same ATen format, equal to eager."""
    torch.manual_seed(0)
    model = PlainTensorAttribute()
    x, y = torch.randn(4, 6), torch.randint(0, 4, (4,))
    with pytest.raises(Exception):
        torch.export.export(model, (x,), strict=False)
    for with_loss in (True, False):
        cap = capture(model, (x,), F.cross_entropy, (y,), with_loss=with_loss)
        assert cap.method == "symbolic_trace"
        _check_format(cap, model)
        assert cap.buffer_fqns == []  # the plain attribute stays a constant, not a buffer
        assert [n.meta[AH_ROLE] for n in placeholders(cap.gm)].count("constant") == 1
        assert _symbols(cap, "batch")
        x2, y2 = torch.randn(7, 6), torch.randint(0, 4, (7,))
        if with_loss:
            torch.testing.assert_close(cap.run(cap.default_state(model), (x2,), (y2,)),
                                       F.cross_entropy(model(x2), y2))
        else:
            torch.testing.assert_close(cap.run(cap.default_state(model), (x2,)), model(x2))
    assert "scale" not in dict(model.named_buffers())  # the model itself is unchanged


class _RowsOf(nn.Module):
    """Reads rows of its second input at positions counted from the first's batch (as
    Hugging Face's causal mask indexes the padding mask by `arange(batch)` of the ids)."""

    def __init__(self, fixed_batch: int | None = None):
        super().__init__()
        self.lin = nn.Linear(6, 4)
        self.fixed_batch = fixed_batch

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(x.shape[0] if self.fixed_batch is None else self.fixed_batch)
        out = self.lin(x) * mask[rows].unsqueeze(-1)
        return out if self.fixed_batch is None else out.view(self.fixed_batch, -1)


def _batch_sizes(cap: CapturedGraph) -> list:
    """Dim 0 of each input and target: an int, or the symbol (after the ShapeEnv's
    replacements) its size is."""
    sizes = [n.meta["val"].shape[0] for n in placeholders(cap.gm)
             if n.meta[AH_ROLE] in ("input", "target")]
    return [s.node.expr if isinstance(s, torch.SymInt) else s for s in sizes]


@pytest.mark.timeout(60)
def test_inputs_and_targets_of_one_batch_size_share_one_batch_symbol() -> None:
    """Tensors whose dim 0 is as long as the first input's get one symbol (the runtime
    splits them into the same samples): an op reading one's rows by positions counted from
    another's stays provably per-sample; a tensor of another length is free to relate to
    it (targets of batch·seq rows); a model that fixes the batch size is captured as
    before (Dim.AUTO specializes it)."""
    torch.manual_seed(0)
    x, mask, y = torch.randn(4, 3, 6), torch.randint(0, 2, (4, 3)), torch.randn(4, 3, 4)
    model = _RowsOf()
    cap = capture(model, (x, mask), F.mse_loss, (y,))
    sizes = _batch_sizes(cap)
    assert isinstance(sizes[0], sympy.Symbol) and len(set(sizes)) == 1
    assert _symbols(cap, "batch") == [sizes[0]]
    x2, mask2, y2 = torch.randn(5, 3, 6), torch.randint(0, 2, (5, 3)), torch.randn(5, 3, 4)
    torch.testing.assert_close(cap.run(cap.default_state(model), (x2, mask2), (y2,)),
                               F.mse_loss(model(x2, mask2), y2))

    flat = capture(model, (x, mask), lambda out, t: F.mse_loss(out.flatten(0, 1), t),
                   (torch.randn(12, 4),))       # targets [batch·seq, 4]: not one sample a row
    sizes = _batch_sizes(flat)
    assert sizes[0] == sizes[1] and sizes[2] == 3 * sizes[0]

    fixed = capture(_RowsOf(fixed_batch=4), (x, mask), F.mse_loss, (torch.randn(4, 12),))
    assert _batch_sizes(fixed) == [4, 4, 4] and fixed.method == "export"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_padded_hugging_face_batch_is_proven_per_sample() -> None:
    """Llama fed token ids and their padding mask (its causal mask indexes the padding
    mask by `arange(batch)` of the ids): dp and microbatching are proven to give eager's
    result, so the planner offers them (session 33 found every such plan refused)."""
    pytest.importorskip("transformers")
    from autohybrid.models import coverage

    case = coverage.build("llama_padded")
    (inputs, targets) = case.batches[0]
    for constraints in (ah.Constraints(dp=2, tp=1, pp=1),
                        ah.Constraints(dp=1, tp=1, pp=2, num_microbatches=4)):
        plan = ah.plan(case.model, ah.Cluster.local(2), inputs, example_targets=targets,
                       constraints=constraints, executable_only=True)
        assert plan.executable and (plan.mesh.dp, plan.num_microbatches) == (
            constraints.dp, constraints.num_microbatches or 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_multiple_choice_model_splits_on_equal_choices_checked_on_every_batch() -> None:
    """BertForMultipleChoice flattens ids and mask (batch, choices, seq) to batch·choices
    rows and picks the mask's rows by positions counted in the ids': each input's
    choices are their own symbol, so dp was refused. The split is proven on condition
    that the two are equal (RankProgram.batch_equalities), and the batch check refuses
    a batch where they differ, naming both dims; without the plan's condition that
    batch fits the graph."""
    pytest.importorskip("transformers")
    from autohybrid.batch_spec import BatchSpec
    from autohybrid.models import coverage
    from autohybrid.rewrite import rewrite

    case = coverage.build("bert_mc")
    (inputs, targets) = case.batches[0]
    plan = ah.plan(case.model, ah.Cluster.local(2), inputs, example_targets=targets,
                   constraints=ah.Constraints(dp=2, tp=1, pp=1), executable_only=True)
    cap = capture(case.model, inputs, None, targets)
    equal = rewrite(cap, plan, 0, fake_groups=True).batch_equalities
    assert len(equal) == 1
    spec = BatchSpec.of(cap)
    assert spec.problem([*inputs, *targets], equal) is None
    ids, mask = inputs
    three = torch.cat([mask, mask[:, :1]], dim=1)   # the mask of 3 choices, the ids' 2
    why = spec.problem([ids, three, *targets], equal)
    assert "dim 1 of inputs[0]" in why and "dim 1 of inputs[1]" in why, why
    assert "are 2 and 3" in why and "pin dp=1" in why, why
    assert spec.problem([ids, three, *targets]) is None


class _GradReverse(torch.autograd.Function):
    """A gradient-reversal layer (domain-adversarial training): identity forward, its
    backward not the forward's derivative."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -0.5 * grad


class _FusedTanh(torch.autograd.Function):
    """A hand-written backward that is the forward's derivative (as fused kernels are)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class _WithFunction(nn.Module):
    def __init__(self, function: type):
        super().__init__()
        self.fc1, self.fc2, self.bn = nn.Linear(8, 16), nn.Linear(16, 3), nn.BatchNorm1d(16)
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.function.apply(self.bn(self.fc1(x))))


@pytest.mark.timeout(60)
def test_a_custom_autograd_function_whose_backward_is_not_its_derivative_is_refused():
    """torch.export keeps a Function's forward and drops its backward: a gradient-reversal
    layer trained silently wrong under every plan (gradient ×-2 below it). Capture checks
    the graph's gradients against eager's and refuses where they differ, naming the
    Function; one whose backward is the derivative is captured (its running statistics
    left as they were), and on the meta device the check cannot run: refused."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    with pytest.raises(ah.CaptureError, match=r"(?s)_GradReverse.*fc1\.(weight|bias).*"
                                              r"custom_op with register_autograd"):
        capture(_WithFunction(_GradReverse), (x,), F.cross_entropy, (y,))
    model = _WithFunction(_FusedTanh)
    before = copy.deepcopy(model.bn.state_dict())
    cap = capture(model, (x,), F.cross_entropy, (y,))
    for key, value in model.bn.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    x2, y2 = torch.randn(5, 8), torch.randint(0, 3, (5,))
    torch.testing.assert_close(cap.run(cap.default_state(copy.deepcopy(model)), (x2,), (y2,)),
                               F.cross_entropy(copy.deepcopy(model)(x2), y2))
    with torch.device("meta"):
        on_meta = _WithFunction(_FusedTanh)
    with pytest.raises(ah.CaptureError, match="meta device"):
        capture(on_meta, (x,), F.cross_entropy, (y,))


# --------------------------------------------------------------------------- errors


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.lin(x)
        return -x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Identity(), Gate()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.timeout(60)
def test_data_dependent_control_flow_names_module_file_line_and_fix() -> None:
    lines, first = inspect.getsourcelines(Gate.forward)
    line = first + next(i for i, text in enumerate(lines) if "if x.sum() > 0" in text)
    with pytest.raises(ah.CaptureError) as err:
        capture(Gated(), (torch.randn(4, 8),), with_loss=False)
    text = str(err.value)
    assert "blocks.1" in text
    assert f"{__file__}:{line}" in text
    assert "torch.where" in text and "torch.cond" in text


class _PackedLSTM(nn.Module):
    """An LSTM over pack_padded_sequence of the padded batch and its lengths."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True,
                                                   enforce_sorted=False)
        return self.rnn(packed)[1][0][-1]


@pytest.mark.timeout(60)
def test_a_packed_sequence_is_refused_with_what_to_do_instead() -> None:
    """Its batch sizes are a tensor used as a size: the shapes given are right, and the
    advice says so (found 2026-12-07: it said to check the example shapes)."""
    x, lengths = torch.randn(4, 6, 8), torch.tensor([6, 3, 5, 2])
    with pytest.raises(ah.CaptureError) as err:
        capture(_PackedLSTM(), (x, lengths), F.mse_loss, (torch.randn(4, 8),))
    text = str(err.value)
    assert "rnn (LSTM)" in text and "pack_padded_sequence" in text
    assert "have the shapes" not in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", [None, "meta"], ids=["cpu", "meta"])
def test_inputs_of_the_wrong_shape_name_the_layer(device) -> None:
    model = models.preset("mlp-tiny", device=device)  # Linear(16 -> 32) first
    with pytest.raises(ah.CaptureError) as err:
        capture(model, (torch.randn(4, 17),), F.cross_entropy, (torch.randint(0, 8, (4,)),))
    text = str(err.value)
    assert "layers.0" in text and "Linear" in text
    assert "17" in text and "example_inputs" in text


@pytest.mark.timeout(30)
def test_bad_arguments_are_capture_errors() -> None:
    model = models.preset("mlp-tiny")
    with pytest.raises(ah.CaptureError, match="nn.Module"):
        capture(lambda x: x, (torch.randn(2, 16),))
    with pytest.raises(ah.CaptureError, match="example_inputs is empty"):
        capture(model, ())
    with pytest.raises(ah.CaptureError, match=r"example_inputs\[0\] is a scalar"):
        capture(model, (torch.tensor(1.0),))
    with pytest.raises(ah.CaptureError, match=r"example_targets\[0\] must be a tensor"):
        capture(model, (torch.randn(2, 16),), F.cross_entropy, ([0, 1],))
    with pytest.raises(ah.CaptureError, match="did not return a loss"):
        capture(_NoLoss(), (torch.randn(2, 16),), None, (torch.randint(0, 8, (2,)),))


class _NoLoss(nn.Module):
    """Takes targets but returns logits: loss_fn=None cannot work."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.lin(x)
