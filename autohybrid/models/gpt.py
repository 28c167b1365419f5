"""GPT-2/GPT-3 style decoder-only transformer.

Token embedding + learned position embedding, ``layers`` pre-LayerNorm blocks (causal
self-attention through ``F.scaled_dot_product_attention(is_causal=True)`` with a fused
qkv projection, then a GELU MLP), a final LayerNorm and an LM head that is tied to the
token embedding by default. Parameter count (tied):
``12·l·h² + 13·l·h + (V + s)·h + 2·h`` for the default 4h MLP.

The forward pass is free of data-dependent Python control flow, so
``torch.export.export(model, (ids,), dynamic_shapes=..., strict=False)`` captures it
with dynamic batch and sequence dims (sequence length ``T <= seq``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from ._common import build_on, factory_kwargs, format_config, init_transformer_, residual_std_for


def _dropout(p: float) -> nn.Module:
    return nn.Dropout(p) if p > 0 else nn.Identity()


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused ``qkv`` Linear and an output ``proj``."""

    def __init__(self, hidden: int, heads: int, dropout: float, dd: dict[str, Any]):
        super().__init__()
        self.hidden = hidden
        self.heads = heads
        self.head_dim = hidden // heads
        self.dropout = dropout
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True, **dd)
        self.proj = nn.Linear(hidden, hidden, bias=True, **dd)
        self.proj._ah_residual_proj = True
        self.resid_drop = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, heads, t, head_dim)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, self.hidden)
        return self.resid_drop(self.proj(y))


class GPTMLP(nn.Module):
    """``fc`` (h -> ffn) , GELU, ``proj`` (ffn -> h), with biases."""

    def __init__(self, hidden: int, ffn_hidden: int, dropout: float, dd: dict[str, Any]):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn_hidden, bias=True, **dd)
        self.act = nn.GELU()
        self.proj = nn.Linear(ffn_hidden, hidden, bias=True, **dd)
        self.proj._ah_residual_proj = True
        self.drop = _dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, hidden: int, heads: int, ffn_hidden: int, dropout: float,
                 dd: dict[str, Any]):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, **dd)
        self.attn = CausalSelfAttention(hidden, heads, dropout, dd)
        self.ln2 = nn.LayerNorm(hidden, **dd)
        self.mlp = GPTMLP(hidden, ffn_hidden, dropout, dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT decoder: ids ``(batch, T)`` with ``T <= seq`` -> logits ``(batch, T, vocab)``.

    ``config`` holds the constructor kwargs (without device/dtype); ``kind`` is ``"gpt"``.
    """

    kind = "gpt"

    def __init__(self, layers: int, hidden: int, heads: int, vocab: int, seq: int,
                 device: Any = None, dtype: torch.dtype | None = None, dropout: float = 0.0,
                 tie_embeddings: bool = True, ffn_hidden: int | None = None):
        super().__init__()
        if hidden % heads != 0:
            raise ModelError(f"gpt: hidden={hidden} is not divisible by heads={heads}")
        if min(layers, hidden, heads, vocab, seq) < 1:
            raise ModelError("gpt: layers, hidden, heads, vocab and seq must all be >= 1, got "
                             f"{layers=}, {hidden=}, {heads=}, {vocab=}, {seq=}")
        ffn = 4 * hidden if ffn_hidden is None else int(ffn_hidden)
        self.config: dict[str, Any] = dict(
            layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq,
            dropout=dropout, tie_embeddings=tie_embeddings, ffn_hidden=ffn)
        dd = factory_kwargs(device, dtype)
        with build_on(device):
            self.tok_emb = nn.Embedding(vocab, hidden, **dd)
            self.pos_emb = nn.Embedding(seq, hidden, **dd)
            self.drop = _dropout(dropout)
            self.blocks = nn.ModuleList(
                GPTBlock(hidden, heads, ffn, dropout, dd) for _ in range(layers))
            self.ln_f = nn.LayerNorm(hidden, **dd)
            if tie_embeddings:
                # Built on meta (nothing allocated, nothing initialized), then tied.
                self.lm_head = nn.Linear(hidden, vocab, bias=False, device="meta", dtype=dtype)
                self.lm_head.weight = self.tok_emb.weight
            else:
                self.lm_head = nn.Linear(hidden, vocab, bias=False, **dd)
        init_transformer_(self, residual_std=residual_std_for(layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def extra_repr(self) -> str:
        return format_config(self.config)


def gpt(layers: int, hidden: int, heads: int, vocab: int, seq: int, device: Any = None,
        dtype: torch.dtype | None = None, dropout: float = 0.0, tie_embeddings: bool = True,
        ffn_hidden: int | None = None) -> GPT:
    """Build a GPT-2/3 style decoder directly on ``device``/``dtype`` (see :class:`GPT`).

    Weights ~ N(0, 0.02) (residual projections N(0, 0.02/sqrt(2·layers)), as GPT-2),
    biases zero, LayerNorm weights one; nothing is initialized on the meta device.
    """
    return GPT(layers, hidden, heads, vocab, seq, device=device, dtype=dtype, dropout=dropout,
               tie_embeddings=tie_embeddings, ffn_hidden=ffn_hidden)
