"""Capture per distinct block (autohybrid/capture_blocks.py) gives the graph a full export gives.

Pure graph tests, no processes. Each model is captured twice — block by block (the
default) and with `AUTOHYBRID_CAPTURE=full` — and the two must be the same graph: graph
hash, node by node (op, name, target, argument wiring, `nn_module_stack`), every
CapturedGraph field, and the same loss and gradients after one step run through
`CapturedGraph.run` (at a batch and sequence length other than the example's), equal to
eager. Models: the zoo's GPT and Llama (replication used), a Hugging Face Llama of 12
layers from a tiny config (replication used, after torch.export's names settle), a model
with two kinds of block (sliding window on every other layer), and models that must fall
back to the full export: one odd layer, a head that depends on the depth, a hook.
"""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autohybrid as ah
from autohybrid.capture import CapturedGraph, capture
from autohybrid.capture_blocks import CAPTURE_ENV, export_by_blocks
from autohybrid.graph import MODULE_STACK
from autohybrid.models.coverage import have_transformers


@pytest.fixture(autouse=True)
def _export_every_time(monkeypatch):
    """Each capture here exports (the memo would hand back an earlier test's graph), block
    by block wherever the blocks allow it: these models are too small for the default
    to find two small exports cheaper than the full one (capture_blocks.WORTH)."""
    monkeypatch.setenv("AUTOHYBRID_CAPTURE_CACHE", "0")
    monkeypatch.setenv(CAPTURE_ENV, "blocks")


LOGGER = "autohybrid.capture"


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def _tokens(seed: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _both(model: nn.Module, loss_fn, vocab: int, caplog, monkeypatch
          ) -> tuple[CapturedGraph, CapturedGraph, str]:
    """(block-by-block capture, full capture, what the capture logger said)."""
    inputs, targets = _tokens(0, 2, 8, vocab), _tokens(1, 2, 8, vocab)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        blocks = capture(model, (inputs,), loss_fn, targets)
    said = " | ".join(r.getMessage() for r in caplog.records if r.name == LOGGER)
    monkeypatch.setenv(CAPTURE_ENV, "full")
    full = capture(model, (inputs,), loss_fn, targets)
    monkeypatch.setenv(CAPTURE_ENV, "blocks")
    return blocks, full, said


def _wiring(node: torch.fx.Node) -> str:
    return str(torch.fx.node.map_arg((node.args, node.kwargs), lambda a: f"%{a.name}"))


def _assert_same_graph(a: CapturedGraph, b: CapturedGraph) -> None:
    assert a.hash == b.hash
    na, nb = list(a.gm.graph.nodes), list(b.gm.graph.nodes)
    assert len(na) == len(nb)
    for x, y in zip(na, nb):
        assert (x.op, x.name, x.target, _wiring(x)) == (y.op, y.name, y.target, _wiring(y))
        assert x.meta.get(MODULE_STACK) == y.meta.get(MODULE_STACK), x.name
        vx, vy = x.meta.get("val"), y.meta.get("val")
        if isinstance(vx, torch.Tensor):
            assert (str(vx.shape), vx.stride(), vx.dtype) == (str(vy.shape), vy.stride(), vy.dtype)
    for field in ("param_fqns", "buffer_fqns", "canonical", "mutated_buffers", "user_outputs",
                  "num_inputs", "num_targets", "method", "with_loss", "example_shapes"):
        assert getattr(a, field) == getattr(b, field), field
    assert list(a.constants) == list(b.constants)
    roles = lambda cap: {str(s): r for s, r in cap.dim_roles.items()}  # noqa: E731
    assert roles(a) == roles(b)


def _step(model: nn.Module, cap: CapturedGraph, inputs, targets) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = cap.run(cap.default_state(model), (inputs,), (targets,))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def _assert_same_step(model: nn.Module, a: CapturedGraph, b: CapturedGraph, vocab: int,
                      eager) -> None:
    """One step at batch 3, sequence 5 (not the example's): equal losses and gradients."""
    inputs, targets = _tokens(2, 3, 5, vocab), _tokens(3, 3, 5, vocab)
    loss_a, grads_a = _step(model, a, inputs, targets)
    loss_b, grads_b = _step(model, b, inputs, targets)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(loss_a, eager(model, inputs, targets).detach())


def _eager_lm(model, inputs, targets):
    return _lm_loss(model(inputs), targets)


# ----------------------------------------------------------------------------- zoo
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_zoo_models_are_replicated_and_equal_a_full_export(kind, caplog, monkeypatch):
    torch.manual_seed(0)
    if kind == "gpt":
        model = ah.models.gpt(layers=6, hidden=32, heads=4, vocab=64, seq=16)
    else:
        model = ah.models.llama(layers=6, hidden=32, heads=4, kv_heads=2, vocab=64, seq=16)
    blocks, full, said = _both(model, _lm_loss, 64, caplog, monkeypatch)
    assert "captured" in said and "6 units of 1 block" in said, said   # not the fallback
    _assert_same_graph(blocks, full)
    _assert_same_step(model, blocks, full, 64, _eager_lm)
    assert len(model.blocks) == 6 and all("forward" not in b.__dict__ for b in model.blocks)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_meta_forward_graph_for_planning(caplog, monkeypatch):
    """The plan path: a model on the meta device, forward graph (no loss)."""
    model = ah.models.gpt(layers=8, hidden=64, heads=4, vocab=128, seq=32, device="meta")
    tokens = torch.randint(0, 128, (2, 16), device="meta")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        blocks = capture(model, (tokens,), with_loss=False)
    assert any("captured" in r.getMessage() for r in caplog.records if r.name == LOGGER)
    monkeypatch.setenv(CAPTURE_ENV, "full")
    _assert_same_graph(blocks, capture(model, (tokens,), with_loss=False))


# ----------------------------------------------------------------------------- Hugging Face
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not have_transformers(), reason="transformers is not installed")
def test_hugging_face_llama_of_12_layers(caplog, monkeypatch):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    blocks, full, said = _both(model, None, 96, caplog, monkeypatch)
    # torch.export names units 0 and 2 of this model out of step: six units are exported
    assert "captured" in said and "exports of 5 and 6 blocks" in said, said
    _assert_same_graph(blocks, full)
    _assert_same_step(model, blocks, full, 96,
                      lambda m, i, t: m(i, labels=t).loss)


# ----------------------------------------------------------------------------- kinds, fallbacks
class WindowBlock(nn.Module):
    """Residual MLP block; with `window`, also mixes each position with the `window`
    positions before it (a sliding-window average), as layers with local attention do."""

    def __init__(self, hidden: int, window: int | None):
        super().__init__()
        self.window = window
        self.norm = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.norm(x))
        if self.window is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            near = (pos[:, None] - pos[None, :] >= 0) & (pos[:, None] - pos[None, :] < self.window)
            h = h + (near.to(h.dtype) @ h) / self.window
        return x + torch.tanh(h)


class Stack(nn.Module):
    def __init__(self, windows: list[int | None], hidden: int = 16, vocab: int = 32,
                 depth_scaled: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(WindowBlock(hidden, w) for w in windows)
        self.head = nn.Linear(hidden, vocab)
        self.depth_scaled = depth_scaled

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        out = self.head(x)
        return out / len(self.blocks) if self.depth_scaled else out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_kinds_of_block_alternating(caplog, monkeypatch):
    torch.manual_seed(0)
    model = Stack([None if i % 2 == 0 else 3 for i in range(12)])
    blocks, full, said = _both(model, _lm_loss, 32, caplog, monkeypatch)
    assert "captured" in said and "6 units of 2 block(s)" in said, said
    _assert_same_graph(blocks, full)
    _assert_same_step(model, blocks, full, 32, _eager_lm)


class NormBlock(nn.Module):
    """A block with BatchNorm: its running statistics are buffers the graph mutates."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.norm = nn.BatchNorm1d(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.fc(x).transpose(1, 2)).transpose(1, 2))


@pytest.mark.timeout(600)
def test_blocks_with_buffers_batch_norm(caplog, monkeypatch):
    """Blocks with buffers (BatchNorm in training updates its statistics in the graph):
    buffers lifted block by block after all parameters; the probe's fake forward leaves
    the real statistics alone (it counted one batch before it ran on fake copies)."""
    torch.manual_seed(0)
    model = Stack([None] * 8)
    model.blocks = nn.ModuleList(NormBlock(16) for _ in range(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    blocks, full, said = _both(model, _lm_loss, 32, caplog, monkeypatch)
    assert "captured" in said, said
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert len(blocks.buffer_fqns) == 3 * 8
    _assert_same_graph(blocks, full)
    _assert_same_step(model, blocks, full, 32, _eager_lm)


def _odd_layer() -> nn.Module:
    return Stack([3 if i == 4 else None for i in range(10)])


def _depth_scaled() -> nn.Module:
    return Stack([None] * 10, depth_scaled=True)


def _hooked() -> nn.Module:
    model = Stack([None] * 10)
    model.blocks[2].register_forward_hook(lambda module, args, out: out * 2)
    return model


@pytest.mark.timeout(600)
@pytest.mark.parametrize("build, reason", [
    (_odd_layer, "do not repeat"),
    (_depth_scaled, "depends on their number"),
    (_hooked, "has hooks"),
])
def test_falls_back_to_the_full_export(build, reason, caplog, monkeypatch):
    torch.manual_seed(0)
    model = build()
    blocks, full, said = _both(model, _lm_loss, 32, caplog, monkeypatch)
    assert "full export of Stack" in said and reason in said and "captured" not in said, said
    _assert_same_graph(blocks, full)
    _assert_same_step(model, blocks, full, 32, _eager_lm)


def test_by_default_few_blocks_are_exported_whole(caplog, monkeypatch):
    """Without `AUTOHYBRID_CAPTURE=blocks`, 6 blocks are exported in one piece: two
    exports of 2 and 3 of them would cost about as much (capture_blocks.WORTH)."""
    monkeypatch.delenv(CAPTURE_ENV)
    model = ah.models.gpt(layers=6, hidden=32, heads=4, vocab=64, seq=16)
    wrapper = nn.Module()
    wrapper.model = model
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert export_by_blocks(wrapper, (), ()) is None   # before any probe or export
    assert "6 blocks, fewer than 2 times the 5" in caplog.text


def test_env_forces_the_full_export(monkeypatch):
    monkeypatch.setenv(CAPTURE_ENV, "full")
    wrapper = nn.Module()
    wrapper.model = Stack([None] * 10)
    assert export_by_blocks(wrapper, (), ()) is None   # before any probe or export
