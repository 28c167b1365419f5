"""Pure-graph tests of the passes and the pass manager (no processes).

`global_loss`: for random splits of the batch into shards, Σ numerator / Σ denominator
(kind "mean") or Σ numerator (kind "sum") of the rewritten graph equals the eager loss of
the whole batch in fp64, and so do the gradients; losses it cannot split are accepted with
one shard and refused (PlanError naming the node) with more. `sync_batch_norm` replaces
training-mode batch norms when dp > 1 only. The manager: disabling passes by name, debug
dumps, and the captured graph left untouched.
"""
from __future__ import annotations

import copy
import dataclasses
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from autohybrid import models, ops
from autohybrid.capture import CapturedGraph, capture
from autohybrid.graph import AH_PASS, GraphFormatError, graph_hash, output_node, verify
from autohybrid.passes import PassContext, passes_for, run_passes
from autohybrid.passes.global_loss import global_loss
from autohybrid.passes.sync_batch_norm import training_batch_norms
from autohybrid.plan import Mesh, Plan, RankPlacement

CLASSES, BATCH = 5, 12
IGNORE = -1


def make_plan(dp: int = 1, num_microbatches: int = 1, microbatch_size: int = 2) -> Plan:
    return Plan(model_hash="test", cluster="test", cluster_hash="test", mesh=Mesh(dp=dp),
                placement=tuple(RankPlacement(rank=r, node=0, device=r) for r in range(dp)),
                global_batch=dp * num_microbatches * microbatch_size,
                microbatch_size=microbatch_size, num_microbatches=num_microbatches)


def train_context(cap: CapturedGraph, plan: Plan, rank: int = 0) -> PassContext:
    ctx = PassContext(plan=plan, rank=rank, coords=plan.mesh.coords(rank), graph_kind="train")
    ctx.notes["loss_output_index"] = cap.user_outputs[0]
    return ctx


def rewritten(cap: CapturedGraph, ctx: PassContext, gm: fx.GraphModule) -> CapturedGraph:
    """The captured program with the rewritten graph; the denominator is the last output."""
    outputs = [*cap.user_outputs, len(cap.mutated_buffers) + len(cap.user_outputs)]
    return dataclasses.replace(cap, gm=gm, user_outputs=outputs)


class Net(nn.Module):
    def __init__(self, out_features: int = CLASSES):
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class SeqNet(nn.Module):
    """(batch, seq, 6) -> (batch, seq, classes), for token-style losses."""

    def __init__(self):
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _weights() -> torch.Tensor:
    return torch.linspace(0.2, 2.0, CLASSES, dtype=torch.float64)


def _classes(g: torch.Generator, ignored: bool = False, shape=(BATCH,)) -> torch.Tensor:
    t = torch.randint(0, CLASSES, shape, generator=g)
    if ignored:
        t[:3] = IGNORE        # a whole leading shard can be ignored
        t[5::4] = IGNORE
    return t


def _probabilities(g: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(BATCH, CLASSES, generator=g, dtype=torch.float64), -1)


def _reals(g: torch.Generator) -> torch.Tensor:
    return torch.randn(BATCH, CLASSES, generator=g, dtype=torch.float64)


def _binary(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (BATCH, CLASSES), generator=g).double()


# name -> (model class, loss_fn, target maker, expected kind)
LOSSES = {
    "cross_entropy_ignore_index": (Net, lambda o, t: F.cross_entropy(o, t, ignore_index=IGNORE),
                                   lambda g: _classes(g, ignored=True), "mean"),
    "cross_entropy_class_weights": (Net, lambda o, t: F.cross_entropy(o, t, weight=_weights()),
                                    _classes, "mean"),
    "cross_entropy_weights_and_ignore": (
        Net, lambda o, t: F.cross_entropy(o, t, weight=_weights(), ignore_index=IGNORE),
        lambda g: _classes(g, ignored=True), "mean"),
    "cross_entropy_label_smoothing": (
        Net, lambda o, t: F.cross_entropy(o, t, label_smoothing=0.1, ignore_index=IGNORE),
        lambda g: _classes(g, ignored=True), "mean"),
    "cross_entropy_probabilities": (Net, F.cross_entropy, _probabilities, "mean"),
    "cross_entropy_tokens": (
        SeqNet, lambda o, t: F.cross_entropy(o.flatten(0, 1), t.flatten(), ignore_index=IGNORE),
        lambda g: _classes(g, ignored=True, shape=(BATCH, 3)), "mean"),
    "cross_entropy_sum": (Net, lambda o, t: F.cross_entropy(o, t, reduction="sum"), _classes,
                          "sum"),
    "nll_loss": (Net, lambda o, t: F.nll_loss(F.log_softmax(o, -1), t, weight=_weights(),
                                              ignore_index=IGNORE),
                 lambda g: _classes(g, ignored=True), "mean"),
    "mse_loss": (Net, F.mse_loss, _reals, "mean"),
    "l1_loss": (Net, F.l1_loss, _reals, "mean"),
    "bce_with_logits": (Net, F.binary_cross_entropy_with_logits, _binary, "mean"),
    "half_mse": (Net, lambda o, t: 0.5 * F.mse_loss(o, t), _reals, "mean"),
    "mean_of_expression": (Net, lambda o, t: ((o - t) ** 2).mean(), _reals, "mean"),
    "mean_over_all_dims": (Net, lambda o, t: (o - t).abs().mean(dim=(0, 1)), _reals, "mean"),
    "mean_of_expression_scaled": (Net, lambda o, t: ((o - t) ** 2 + (o - t).abs()).mean() / 4,
                                  _reals, "mean"),
    "sum_of_expression": (Net, lambda o, t: ((o - t) ** 2).sum(), _reals, "sum"),
}


def _inputs(model_cls, g: torch.Generator) -> torch.Tensor:
    shape = (BATCH, 3, 6) if model_cls is SeqNet else (BATCH, 6)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _random_splits(g: torch.Generator, trials: int = 3) -> list[list[slice]]:
    splits = [[slice(0, 3), slice(3, BATCH)]]  # first shard: only ignored targets
    for _ in range(trials):
        count = int(torch.randint(2, 6, (1,), generator=g))
        cuts = sorted(set(torch.randperm(BATCH - 1, generator=g)[: count - 1].add(1).tolist()))
        bounds = [0, *cuts, BATCH]
        splits.append([slice(a, b) for a, b in zip(bounds, bounds[1:])])
    return splits


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(LOSSES))
def test_global_loss_shards_sum_to_the_eager_loss_and_gradients(name: str) -> None:
    model_cls, loss_fn, make_targets, kind = LOSSES[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    torch.manual_seed(0)
    model = model_cls().double()
    x, t = _inputs(model_cls, g), make_targets(g)
    cap = capture(model, (x[:4],), loss_fn, (t[:4],))
    ctx = train_context(cap, make_plan(dp=2, num_microbatches=2))
    program = rewritten(cap, ctx, run_passes(cap.gm, ctx, [("global_loss", global_loss)]))
    assert ctx.notes["loss_kind"] == kind
    assert any(n.meta.get(AH_PASS) == "global_loss" for n in program.gm.graph.nodes)

    eager = copy.deepcopy(model)
    want = loss_fn(eager(x), t)
    want.backward()
    state = cap.default_state(model)
    for split in _random_splits(g):
        model.zero_grad()
        numerator = denominator = 0.0
        for shard in split:
            num, den = program.run(state, (x[shard],), (t[shard],))
            num.backward()
            numerator, denominator = numerator + num.detach(), denominator + den.detach()
        if kind == "mean":
            got, scale = numerator / denominator, 1 / denominator
        else:
            got, scale = numerator, 1.0
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
        for (pname, p), (_, q) in zip(model.named_parameters(), eager.named_parameters()):
            torch.testing.assert_close(p.grad * scale, q.grad, rtol=1e-10, atol=1e-12,
                                       msg=f"{name}: gradient of {pname}, split {split}")


OPAQUE = {
    "divided_by_batch_size": (lambda o, t: ((o - t) ** 2).sum() / o.shape[0], "aten.div"),
    "logsumexp": (lambda o, t: torch.logsumexp((o - t).flatten(), 0), "aten.logsumexp"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(OPAQUE))
def test_opaque_losses_run_unsplit_and_are_refused_when_split(name: str) -> None:
    loss_fn, op = OPAQUE[name]
    g = torch.Generator().manual_seed(1)
    model = Net().double()
    x, t = _inputs(Net, g), _reals(g)
    cap = capture(model, (x[:4],), loss_fn, (t[:4],))
    loss_node = output_node(cap.gm).args[0][cap.user_outputs[0]]

    ctx = train_context(cap, make_plan())
    program = rewritten(cap, ctx, run_passes(cap.gm, ctx, [("global_loss", global_loss)]))
    assert ctx.notes["loss_kind"] == "opaque"
    num, den = program.run(cap.default_state(model), (x,), (t,))
    torch.testing.assert_close(num, loss_fn(model(x), t))
    assert float(den) == 1.0

    for dp, count in [(2, 1), (1, 2), (2, 2)]:
        ctx = train_context(cap, make_plan(dp=dp, num_microbatches=count))
        with pytest.raises(ah.PlanError) as err:
            run_passes(cap.gm, ctx, [("global_loss", global_loss)])
        text = str(err.value)
        assert repr(loss_node.name) in text and op in text and f"{dp * count} batch shards" in text


MIXING = {
    "centred_by_the_batch_mean": lambda o, t: F.mse_loss(o - o.mean(0), t),
    "normalized_by_the_batch_max": lambda o, t: ((o / o.abs().amax(0)) - t).pow(2).mean(),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(MIXING))
def test_losses_that_combine_samples_before_the_reduction_are_refused_when_split(name):
    """`F.mse_loss(o - o.mean(0), t)` ends in a splittable mean, but its input already
    mixes the shard's samples: split, the shards would not add up to eager's loss."""
    loss_fn = MIXING[name]
    g = torch.Generator().manual_seed(2)
    model = Net().double()
    x, t = _inputs(Net, g), _reals(g)
    cap = capture(model, (x[:4],), loss_fn, (t[:4],))
    ctx = train_context(cap, make_plan())
    program = rewritten(cap, ctx, run_passes(cap.gm, ctx, [("global_loss", global_loss)]))
    num, den = program.run(cap.default_state(model), (x,), (t,))
    torch.testing.assert_close(num / den, loss_fn(model(x), t))  # one shard: exact
    halves = [program.run(cap.default_state(model), (x[s],), (t[s],))
              for s in (slice(0, BATCH // 2), slice(BATCH // 2, None))]
    split = sum(n for n, _ in halves) / sum(d for _, d in halves)
    assert not torch.allclose(split, loss_fn(model(x), t))  # why splitting must be refused
    for dp, count in [(2, 1), (1, 2)]:
        ctx = train_context(cap, make_plan(dp=dp, num_microbatches=count))
        with pytest.raises(ah.PlanError, match="combines the samples"):
            run_passes(cap.gm, ctx, [("global_loss", global_loss)])


# ------------------------------------------------------- per-sample dataflow (batch_flow)
EXPERTS, HIDDEN, SEQ = 3, 6, 4


class TokenMoE(nn.Module):
    """(batch, seq, hidden) → (batch, seq, classes) through a top-2 mixture of experts
    dispatched as Hugging Face's `grouped_mm` experts do: the flattened token → expert ids
    sorted across the whole batch, `histc` tokens per expert, their `cumsum` as the
    offsets of a grouped matmul, `inv[perm] = arange` to restore the token order.

    `capacity`: an expert takes at most that many tokens of the batch (a token's slot is
    a cumsum over the tokens before it: combines samples). `leak`: the tokens-per-expert
    counts reach the output (as a load-balancing term would: combines samples)."""

    def __init__(self, capacity: int | None = None, leak: bool = False):
        super().__init__()
        self.capacity, self.leak = capacity, leak
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) * 0.5)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        weights, ids = self.router(tokens).softmax(-1).topk(2, dim=-1)
        weights, ids = weights.reshape(-1), ids.reshape(-1)
        if self.capacity is not None:
            one_hot = F.one_hot(ids, EXPERTS)
            slot = (one_hot.cumsum(0) * one_hot).sum(-1)
            weights = weights * (slot <= self.capacity)
        sorted_ids, perm = torch.sort(ids)
        rows = tokens[perm // 2]
        counts = torch.histc(sorted_ids.to(x.dtype), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        out = torch.ops.transformers.grouped_mm_fallback(rows, self.experts, offsets)
        out = out * weights[perm].unsqueeze(-1)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        mixed = out[inverse].view(batch * seq, 2, hidden).sum(1).view(batch, seq, hidden)
        if self.leak:
            mixed = mixed + 0.01 * counts[0]
        return self.head(torch.tanh(x + mixed))


class CausalMaskAttention(nn.Module):
    """Attention under a causal mask built as transformers' `create_causal_mask` does:
    position ids indexed by `arange(batch)`, `new_ones` of that indexed tensor (a
    batch-free scalar of a batched value), expanded to (batch, 1, seq, seq)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        positions = torch.arange(seq).unsqueeze(0).expand(batch, -1)
        rows = torch.arange(batch)[:, None, None, None]
        q_pos = positions[rows, torch.arange(seq)[None, None, :, None]]
        k_pos = positions[rows, torch.arange(seq)[None, None, None, :]]
        mask = q_pos.new_ones((), dtype=torch.bool) & (k_pos <= q_pos)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(batch, 1, seq, seq))
        return self.head(out.squeeze(1))


class Mixing(nn.Module):
    """SeqNet-shaped, with `fn` of its hidden values in the middle."""

    def __init__(self, fn):
        super().__init__()
        self.a, self.b, self.fn = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES), fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.fn(torch.tanh(self.a(x))))


def _token_loss(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o.flatten(0, 1), t.flatten())


def _split_numerators(cap, model, x, t, splits) -> list[torch.Tensor]:
    """Σ numerator / Σ denominator of the global_loss-rewritten graph for each split."""
    ctx = train_context(cap, make_plan())
    program = rewritten(cap, ctx, run_passes(cap.gm, ctx, [("global_loss", global_loss)]))
    state = cap.default_state(model)
    out = []
    for split in splits:
        parts = [program.run(state, (x[s],), (t[s],)) for s in split]
        out.append(sum(n for n, _ in parts) / sum(d for _, d in parts))
    return out


class WhereMoE(nn.Module):
    """(batch, seq, hidden) → (batch, seq, classes) through transformers 4.4x's Mixtral
    sparse block: a loop over the experts, each taking its tokens by torch.where over the
    routing mask (a data-dependent count) and adding its output back with index_add_."""

    def __init__(self, experts: int = 4, k: int = 2):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(experts))
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.k, self.num_experts = k, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.view(-1, h)
        weights, chosen = torch.topk(F.softmax(self.gate(flat), dim=1), self.k, dim=-1)
        out = torch.zeros((b * s, h), dtype=x.dtype, device=x.device)
        mask = F.one_hot(chosen, num_classes=self.num_experts).permute(2, 1, 0)
        for e in range(self.num_experts):
            slot, rows = torch.where(mask[e])
            y = torch.tanh(self.experts[e](flat[None, rows].reshape(-1, h)))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return self.head(out.reshape(b, s, h))


PER_SAMPLE = {"moe_per_token_dispatch": TokenMoE, "causal_mask_new_ones": CausalMaskAttention,
              "moe_loop_over_torch_where": WhereMoE,
              # a Hugging Face cache layer's first update: cat onto torch.tensor([])
              "cat_onto_an_empty_cache": lambda: Mixing(lambda h: torch.cat(
                  [torch.tensor([], dtype=h.dtype), h], dim=-2)),
              # ConvBERT's torch.multiply: an alias torch does not tag pointwise
              "torch_multiply": lambda: Mixing(lambda h: torch.multiply(h, h + 1))}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(PER_SAMPLE))
def test_per_token_dispatch_and_batch_free_masks_split_over_shards(name: str) -> None:
    """The analysis proves these per-sample (before: refused at `histc` / `new_ones`, the
    empty cache's `cat`, `multiply`), and the shards of any split add up to eager's loss."""
    if name == "moe_per_token_dispatch":
        pytest.importorskip("transformers.integrations.moe")  # registers grouped_mm_fallback
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    model = PER_SAMPLE[name]().double()
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64)
    t = torch.randint(0, CLASSES, (BATCH, SEQ), generator=g)
    cap = capture(model, (x[:4],), _token_loss, (t[:4],))
    for dp, count in [(2, 1), (1, 2), (2, 2)]:
        ctx = train_context(cap, make_plan(dp=dp, num_microbatches=count))
        run_passes(cap.gm, ctx, [("global_loss", global_loss)])  # no PlanError
        assert ctx.notes["loss_kind"] == "mean"
    want = _token_loss(copy.deepcopy(model)(x), t).detach()
    for got in _split_numerators(cap, model, x, t, _random_splits(g)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-12, atol=1e-12)


COMBINING = {
    "moe_capacity_limited": lambda: TokenMoE(capacity=3),
    "moe_counts_reach_the_output": lambda: TokenMoE(leak=True),
    "sorted_across_the_batch": lambda: Mixing(lambda h: h.sort(0).values),
    "cumsum_over_the_batch": lambda: Mixing(lambda h: h.cumsum(0)),
    "divided_by_the_batch_size": lambda: Mixing(lambda h: h / h.shape[0]),
    "first_sample_subtracted": lambda: Mixing(lambda h: h - h[:1]),
    "flipped_batch": lambda: Mixing(lambda h: h.flip(0)),
    # torch.where's picked rows: summed into every token, their count as a value
    "picked_rows_summed": lambda: Mixing(lambda h: h + h[torch.where(h.sum(-1) > 0)].sum(0)),
    "picked_count_divides": lambda: Mixing(
        lambda h: h / torch.where(h.sum(-1) > 0)[0].shape[0]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(COMBINING))
def test_batch_combinations_inside_the_model_are_refused_when_split(name: str) -> None:
    """Each combines samples (or uses the batch size as a value) before the loss: one
    shard is exact, a split is not, and dp > 1 or microbatches are refused naming the
    node (before: several had the batch dim in their shape and were let through)."""
    if name.startswith("moe"):
        pytest.importorskip("transformers.integrations.moe")
    g = torch.Generator().manual_seed(4)
    torch.manual_seed(0)
    model = COMBINING[name]().double()
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64)
    t = torch.randint(0, CLASSES, (BATCH, SEQ), generator=g)
    cap = capture(model, (x[:4],), _token_loss, (t[:4],))
    want = _token_loss(copy.deepcopy(model)(x), t).detach()
    whole, halves = _split_numerators(cap, model, x, t, [[slice(None)], [slice(0, 5),
                                                                          slice(5, None)]])
    torch.testing.assert_close(whole.detach(), want)
    assert not torch.allclose(halves.detach(), want)  # why splitting must be refused
    for dp, count in [(2, 1), (1, 2)]:
        ctx = train_context(cap, make_plan(dp=dp, num_microbatches=count))
        with pytest.raises(ah.PlanError, match="combines the samples"):
            run_passes(cap.gm, ctx, [("global_loss", global_loss)])


# --------------------------------------------------------------------------- batch norm


@pytest.fixture()
def dp_axis_unbound_group():
    """Bind the "dp" axis to no group: the collective ops then act on this process only."""
    ops.groups.bind("dp", None)
    yield
    ops.groups.clear()


def _resnet_capture(train: bool = True):
    torch.manual_seed(0)
    model = models.preset("resnet-tiny").train(train)
    inputs, targets = models.example_batch("resnet-tiny", 4)
    return model, inputs, targets, capture(model, inputs, F.cross_entropy, targets)


@pytest.mark.timeout(60)
def test_sync_batch_norm_only_when_data_parallel(dp_axis_unbound_group) -> None:
    model, inputs, targets, cap = _resnet_capture()
    norms = len(training_batch_norms(cap.gm))
    assert norms == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) > 0

    ctx = train_context(cap, make_plan(dp=1))
    gm = run_passes(cap.gm, ctx, passes_for("train"))
    assert len(training_batch_norms(gm)) == norms
    assert not any(n.meta.get(AH_PASS) == "sync_batch_norm" for n in gm.graph.nodes)

    ctx = train_context(cap, make_plan(dp=2))
    gm = run_passes(cap.gm, ctx, passes_for("train"))
    verify(gm, "test")
    assert training_batch_norms(gm) == []
    sync = [n for n in gm.graph.nodes
            if n.target is torch.ops.autohybrid.sync_batch_norm.default]
    assert len(sync) == norms
    created = [n for n in gm.graph.nodes if n.meta.get(AH_PASS) == "sync_batch_norm"]
    assert set(sync) <= set(created)
    assert all(n.target in (torch.ops.autohybrid.sync_batch_norm.default, operator.getitem,
                            torch.ops.autohybrid.update_running_stats.default) for n in created)
    assert all(n.args[-1] == "dp" for n in sync)

    # with one process holding the whole batch it computes what eager does, stats included
    eager = copy.deepcopy(model)
    num, den = rewritten(cap, ctx, gm).run(cap.default_state(model), inputs, (targets,))
    torch.testing.assert_close(num / den, F.cross_entropy(eager(*inputs), targets))
    for (name, b), (_, c) in zip(model.named_buffers(), eager.named_buffers()):
        torch.testing.assert_close(b, c, msg=name)


@pytest.mark.timeout(60)
def test_sync_batch_norm_leaves_eval_mode_batch_norm() -> None:
    _, _, _, cap = _resnet_capture(train=False)
    assert training_batch_norms(cap.gm) == []
    ctx = train_context(cap, make_plan(dp=2))
    gm = run_passes(cap.gm, ctx, passes_for("train"))
    assert not any(n.meta.get(AH_PASS) == "sync_batch_norm" for n in gm.graph.nodes)


# --------------------------------------------------------------------------- manager


@pytest.mark.timeout(60)
def test_disable_passes_by_name(monkeypatch) -> None:
    _, _, _, cap = _resnet_capture()
    norms = len(training_batch_norms(cap.gm))
    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "fusion, sync_batch_norm")
    ctx = train_context(cap, make_plan(dp=2))
    gm = run_passes(cap.gm, ctx, passes_for("train"))
    assert len(training_batch_norms(gm)) == norms
    assert ctx.notes["loss_kind"] == "mean"  # global_loss still ran
    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "global_loss,sync_batch_norm,fusion")
    ctx = train_context(cap, make_plan(dp=2))
    gm = run_passes(cap.gm, ctx, passes_for("train"))
    assert "loss_kind" not in ctx.notes and gm.code == cap.gm.code


@pytest.mark.timeout(60)
def test_debug_dumps_plan_and_one_graph_per_pass(monkeypatch, tmp_path) -> None:
    _, _, _, cap = _resnet_capture()
    monkeypatch.setenv("AUTOHYBRID_DEBUG", "1")
    monkeypatch.setenv("AUTOHYBRID_DUMP_DIR", str(tmp_path))
    plan = make_plan(dp=2)
    gm = run_passes(cap.gm, train_context(cap, plan, rank=1), passes_for("train"))
    dump = tmp_path / "rank1"
    assert Plan.from_json(dump / "plan.json") == plan
    names = sorted(p.name for p in dump.glob("*.py"))
    assert names == ["00_train_capture.py", "01_train_global_loss.py",
                     "02_train_spatial_parallel.py", "03_train_sync_batch_norm.py",
                     "04_train_expert_parallel.py", "05_train_tensor_parallel.py",
                     "06_train_sequence_parallel.py", "07_train_zero.py",
                     "08_train_collective_matmul.py", "09_train_pipeline_split.py",
                     "10_train_recompute.py", "11_train_overlap.py", "12_train_fusion.py"]
    assert "sync_batch_norm" in (dump / "03_train_sync_batch_norm.py").read_text()
    assert "sync_batch_norm" not in (dump / "02_train_spatial_parallel.py").read_text()
    last = (dump / "06_train_sequence_parallel.py").read_text()  # tp=1: nothing to split
    assert last == (dump / "03_train_sync_batch_norm.py").read_text()
    assert gm.print_readable(print_output=False) == (dump / "12_train_fusion.py").read_text()

    monkeypatch.setenv("AUTOHYBRID_DISABLE_PASSES", "sync_batch_norm")
    forward = capture(models.preset("mlp-tiny"), (torch.randn(4, 16),), with_loss=False)
    ctx = PassContext(plan=plan, rank=0, coords=(0, 0, 0), graph_kind="forward")
    run_passes(forward.gm, ctx, passes_for("forward"))
    assert sorted(p.name for p in (tmp_path / "rank0").glob("*.py")) == [
        "00_forward_capture.py", "01_forward_spatial_parallel.py",
        "03_forward_expert_parallel.py", "04_forward_tensor_parallel.py",
        "05_forward_sequence_parallel.py", "06_forward_zero.py",
        "07_forward_collective_matmul.py", "08_forward_pipeline_split.py",
        "09_forward_recompute.py", "10_forward_overlap.py", "11_forward_fusion.py"]  # 02: off


@pytest.mark.timeout(60)
def test_passes_never_modify_the_captured_graph() -> None:
    _, _, _, cap = _resnet_capture()
    code, digest = cap.gm.code, graph_hash(cap.gm)
    nodes = [(n.name, n.target, n.args, n.kwargs, dict(n.meta)) for n in cap.gm.graph.nodes]
    gm = run_passes(cap.gm, train_context(cap, make_plan(dp=2)), passes_for("train"))
    assert gm is not cap.gm and gm.graph is not cap.gm.graph and gm.code != code
    assert cap.gm.code == code and graph_hash(cap.gm) == digest == cap.hash
    assert [(n.name, n.target, n.args, n.kwargs, dict(n.meta))
            for n in cap.gm.graph.nodes] == nodes
    assert not any(AH_PASS in n.meta for n in cap.gm.graph.nodes)


@pytest.mark.timeout(60)
def test_manager_checks_what_a_pass_returns() -> None:
    cap = capture(models.preset("mlp-tiny"), (torch.randn(4, 16),), with_loss=False)
    ctx = PassContext(plan=make_plan(), rank=0, coords=(0, 0, 0), graph_kind="forward")
    with pytest.raises(TypeError, match="'returns_none'"):
        run_passes(cap.gm, ctx, [("returns_none", lambda gm, ctx: None)])

    def python_call(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        out = output_node(gm)
        with gm.graph.inserting_before(out):
            node = gm.graph.call_function(abs, (out.args[0][0],))
        node.meta[AH_PASS] = "python_call"
        return gm

    with pytest.raises(GraphFormatError, match="after pass 'python_call'"):
        run_passes(cap.gm, ctx, [("python_call", python_call)])


# ============================================================================ repeatable
@pytest.mark.timeout(120)
def test_a_rewrite_leaves_the_capture_as_it_found_it(monkeypatch):
    """Every rewrite of one capture gives the same program: the passes never specialize
    the capture's symbolic sizes. aten.gru's fake kernel reads numel(); before the passes
    ran with the ShapeEnv's guards suppressed, the first rewrite replaced the batch symbol
    by its example value, the next saw a static batch and chose another loss form, and a
    GRU under tp2 trained with wrong gradients wherever ranks had rewritten it a
    different number of times (rank 0 runs the planner's trial)."""
    from autohybrid.graph import fake_mode
    from autohybrid.models import coverage
    from autohybrid.rewrite import rewrite

    case = coverage.build("gru")
    (x,), y = case.batches[0]
    plan = ah.plan(case.model, ah.Cluster.local(2), (x,), loss_fn=case.loss_fn,
                   example_targets=(y,), constraints=ah.Constraints(tp=2, pp=1, dp=1))
    monkeypatch.setenv("AUTOHYBRID_CAPTURE_CACHE", "0")      # a capture no rewrite has seen
    cap = capture(case.model, (x,), case.loss_fn, (y,))
    env = fake_mode(cap.gm).shape_env
    before = (list(env.guards), dict(env.replacements))
    first, second = (rewrite(cap, plan, 0, fake_groups=True) for _ in range(2))
    assert (list(env.guards), dict(env.replacements)) == before
    assert first.runnable.gm.code == second.runnable.gm.code
    assert first.loss_kind == second.loss_kind == "mean"
