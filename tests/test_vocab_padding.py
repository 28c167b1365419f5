"""Tensor parallelism with `padding_idx`: the vocabulary-parallel embedding computes eager's.

`F.embedding(ids, w, padding_idx=p)` is a plain lookup whose backward gives row p no
gradient (`aten.embedding_dense_backward`), however often token p occurs. Split over the
vocabulary, row p lives on one rank's shard (local row p - start) and no other rank holds
it. The op test runs every "rank" of the split in this process (the op communicates
nothing: `tp_reduce` sums its partials), the model test trains under tp = 2 beside eager
with batches full of pad tokens, and the refusal test checks what tp still cannot do names
the module, the mesh axis and a fix (a dry run: no processes).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from _limits import guard
from _pool import launch as pool_launch
from _equiv import OPTIMIZERS, Failures, lm_loss, report, train_and_compare
from autohybrid.graph import op_name
from autohybrid.ops.vocab_parallel import vocab_parallel_embedding

D = torch.float64
VOCAB, PADDED, WAYS, DIM = 13, 16, 4, 6
LAUNCH_TIMEOUT_S = guard(180)


def _ids_with_pads(pad: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (4, 7), generator=torch.Generator().manual_seed(6))
    ids[:, -3:] = pad                        # trailing padding, as a tokenizer pads
    ids[0, :3] = torch.tensor([0, VOCAB - 1, pad])
    return ids


# ============================================================== the op
@pytest.mark.parametrize("pad", [0, 5, VOCAB - 1, -1])
def test_vocab_parallel_embedding_padding_idx_matches_f_embedding(pad):
    """Vocabulary 13 padded to 16 over 4 shards of 4 rows; padding_idx on shard 0 (row 0),
    inside shard 1 (row 5, local 1), the last real row (shard 3), and -1 (none): the
    partials sum to F.embedding, the shards' gradients concatenate to its weight gradient
    (row p zero although token p is in the batch; pad rows of the vocabulary zero)."""
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(PADDED, DIM, dtype=D, generator=g)
    weight[VOCAB:] = 1e3
    ids = _ids_with_pads(pad if pad >= 0 else 3)
    gy = torch.randn(*ids.shape, DIM, dtype=D, generator=g)
    full = weight[:VOCAB].clone().requires_grad_()
    ref = F.embedding(ids, full, padding_idx=None if pad == -1 else pad)
    ref.backward(gy)
    rows = PADDED // WAYS
    partials, grads = [], []
    for rank in range(WAYS):
        shard = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_()
        out = vocab_parallel_embedding(ids, shard, rank * rows, "tp", pad)
        out.backward(gy)
        partials.append(out.detach())
        grads.append(shard.grad)
    torch.testing.assert_close(sum(partials), ref.detach(), rtol=0, atol=0)
    grad = torch.cat(grads)
    torch.testing.assert_close(grad[:VOCAB], full.grad, rtol=1e-12, atol=1e-12)
    assert (grad[VOCAB:] == 0).all()
    if pad >= 0:
        assert (grad[pad] == 0).all()
        # not vacuous: without padding_idx, row p would get the pad tokens' gradient
        plain = full.detach().clone().requires_grad_()
        F.embedding(ids, plain).backward(gy)
        assert plain.grad[pad].abs().sum() > 0


def test_vocab_parallel_embedding_padding_idx_traces():
    """The fake impl and a joint trace take the padding_idx argument."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def joint(ids, shard):
        out = vocab_parallel_embedding(ids, shard, 4, "tp", 5)
        return torch.autograd.grad((out.sum(),), (shard,))[0]

    shard = torch.randn(4, DIM, dtype=D, requires_grad=True)
    gm = make_fx(joint, tracing_mode="fake")(_ids_with_pads(5), shard)
    calls = [n for n in gm.graph.nodes
             if op_name(n) == "autohybrid.vocab_parallel_embedding.default"]
    assert len(calls) == 1 and calls[0].args[-1] == 5
    assert joint(_ids_with_pads(5), shard)[1].abs().sum() == 0  # local row 1 = global 5


# ============================================================== a model under tp = 2
class _PaddedLM(nn.Module):
    """Embedding with padding_idx → MLP block (column, row) → LayerNorm → vocabulary head."""

    def __init__(self, vocab: int = 97, hidden: int = 32, pad: int = 0, tie: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden, padding_idx=pad)
        self.fc, self.proj = nn.Linear(hidden, 64), nn.Linear(64, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.head.weight = self.embed_tokens.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(tokens)
        h = h + self.proj(F.gelu(self.fc(h)))
        return self.head(self.norm(h))


def _padded_batches(pad: int, vocab: int, steps: int = 3, low: int = 0) -> list:
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        tokens = torch.randint(low, vocab, (8, 12), generator=g)
        tokens[:, -4 - step:] = pad          # every sequence ends in pad tokens
        targets = torch.randint(low, vocab, (8, 12), generator=g)
        out.append(((tokens,), targets))
    return out


def _bert_tiny() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM
    config = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0, use_cache=False)
    config._attn_implementation = "sdpa"
    return BertForMaskedLM(config).double().train()


def _model_rank(rank: int, world: int) -> list[str]:
    fails = Failures()
    tp2 = ah.Constraints(tp=world, pp=1)
    cases = [("padding_idx=0 untied", dict(pad=0), "sgd"),
             ("padding_idx=0 untied", dict(pad=0), "adamw"),
             # row 70 lives on rank 1's shard (98 rows padded, 49 a rank); the tied head
             # still gives it a gradient, the embedding must add none
             ("padding_idx=70 tied", dict(pad=70, tie=True), "adamw")]
    for name, kw, opt in cases:
        torch.manual_seed(0)
        model = _PaddedLM(**kw).double()
        case = f"{name}/{opt}/tp{world}"
        compiled, _ = train_and_compare(fails, case, model, _padded_batches(kw["pad"], 97),
                                        world, loss_fn=lm_loss, optimizer=OPTIMIZERS[opt],
                                        constraints=tp2)
        fails.check(f"{case}: embedding not vocabulary-parallel",
                    "embed_tokens.weight" in compiled.programs["train"].param_shards)
    if importlib.util.find_spec("transformers") is not None:
        torch.manual_seed(0)
        batches = [((x,), y.masked_fill(x == 0, -100)) for (x,), y in
                   _padded_batches(0, 96, low=1)]
        train_and_compare(fails, f"HF BERT padding_idx=0/adamw/tp{world}", _bert_tiny(),
                          batches, world, loss_fn=None, optimizer=OPTIMIZERS["adamw"],
                          constraints=tp2,
                          eager_loss=lambda m, i, t: m(input_ids=i[0], labels=t).loss)
    return fails


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_padding_idx_models_under_tp2_match_eager():
    """A small LM with nn.Embedding(padding_idx=0) (SGD and AdamW), the same tied with
    padding_idx on rank 1's shard, and BERT-tiny (pad_token_id=0), every batch with pad
    tokens: losses, gradients and parameters equal eager's after every step."""
    results = pool_launch(_model_rank, 2, args=(2,), timeout_s=LAUNCH_TIMEOUT_S)
    assert not any(results), report(results)


# ============================================================== what tp still refuses
class _Wrapped(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(97, 32, **kw)
        self.head = nn.Linear(32, 97)

    def forward(self, tokens):
        return self.head(self.model.embed_tokens(tokens))


def test_sparse_embedding_tp_cannot_compute_is_refused_naming_the_module():
    """With padding_idx accepted, what the vocabulary-parallel embedding still does not
    compute (sparse gradients) is refused before anything runs, naming the module (not
    the F.embedding call), the mesh axis and a fix."""
    from autohybrid.runtime.dry_run import dry_run

    ids = torch.randint(0, 97, (4, 8))
    with pytest.raises(ah.PlanError) as info:
        dry_run(_Wrapped(padding_idx=0, sparse=True), ah.Cluster.local(2), (ids,),
                lm_loss, ids, constraints=ah.Constraints(tp=2, pp=1, sp=False))
    message = str(info.value)
    assert "'model.embed_tokens'" in message and "has sparse=True," in message, message
    assert "mesh axis 'tp'" in message and "pin tp=1" in message, message


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("flag,value", [("scale_grad_by_freq", True), ("max_norm", 1.0)])
def test_embedding_that_needs_its_whole_table_stays_replicated_under_tp(flag, value, tied):
    """Frequency-scaled gradients and max_norm's in-place renormalization read the whole
    table (search/sharding.whole_table_embeddings): under tp = 2 the embedding, and a
    head tied to it, stay replicated and run as eager on every tp rank (once refused;
    tests/test_batch_effects.py trains such models against eager)."""
    from autohybrid.runtime.dry_run import dry_run

    model = _Wrapped(padding_idx=0, **{flag: value})
    if tied:
        model.head.weight = model.model.embed_tokens.weight
    ids = torch.randint(0, 97, (4, 8))
    report = dry_run(model, ah.Cluster.local(2), (ids,), lm_loss, ids,
                     constraints=ah.Constraints(tp=2, pp=1, sp=False))
    names = {op_name(n) for n in report.gm.graph.nodes if n.op == "call_function"}
    assert "aten.embedding.default" in names, names
    assert "autohybrid.vocab_parallel_embedding.default" not in names, names
    table = next(n for n in report.gm.graph.nodes if op_name(n) == "aten.embedding.default")
    assert tuple(table.args[0].meta["val"].shape) == (97, 32)  # the whole table
    assert not report.shape_mismatches
