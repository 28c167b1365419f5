"""Llama-style decoder-only transformer (Llama 2/3 architecture).

RMSNorm (pre-norm), rotary position embedding, grouped-query attention (``kv_heads``
divides ``heads``; kv heads are repeated with expand+reshape before SDPA), SwiGLU MLP
(``down(silu(gate(x)) * up(x))``), no biases anywhere, untied LM head by default.

The rotary tables (``inv_freq``, cos, sin) are computed in ``forward`` from
``torch.arange(T)``, so the model holds no buffers: a model built on the meta device
still exports with ``torch.export.export(..., strict=False)`` and dynamic batch/sequence.
The rotation uses the "rotate half" layout (as Hugging Face's Llama).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from ._common import (RMSNorm, build_on, factory_kwargs, format_config, init_transformer_,
                      upcast)


def llama_ffn_hidden(hidden: int, multiple_of: int | None = None) -> int:
    """Llama's SwiGLU width: ``int(8·hidden/3)`` rounded up to a multiple of ``multiple_of``.

    ``multiple_of`` defaults to 256 for real sizes and 8 when ``int(8h/3) < 1024`` (tiny
    test models), so ``hidden=32`` gives 88 and ``hidden=4096`` gives 11008.
    """
    base = int(8 * hidden / 3)
    m = multiple_of if multiple_of is not None else (256 if base >= 1024 else 8)
    return m * ((base + m - 1) // m)


def rotary_cos_sin(t: int, head_dim: int, theta: float, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos``/``sin`` tables of shape ``(t, head_dim)`` for positions ``0..t-1``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device,
                                             dtype=torch.float32) / head_dim))
    pos = torch.arange(t, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(b, heads, t, head_dim)`` by the tables; computed in at least fp32,
    cast back."""
    xf = upcast(x)
    return (xf * cos + _rotate_half(xf) * sin).type_as(x)


class GQAttention(nn.Module):
    """Grouped-query causal self-attention: ``wq``, ``wk``, ``wv``, ``wo`` without biases."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, rope_theta: float,
                 dd: dict[str, Any]):
        super().__init__()
        self.hidden = hidden
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = hidden // heads
        self.rope_theta = rope_theta
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False, **dd)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **dd)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False, **dd)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False, **dd)

    def _repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        rep = self.heads // self.kv_heads
        if rep == 1:
            return x
        b, kvh, t, d = x.shape
        return x[:, :, None, :, :].expand(b, kvh, rep, t, d).reshape(b, kvh * rep, t, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(t, self.head_dim, self.rope_theta, x.device)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v),
                                           is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, hidden: int, ffn_hidden: int, dd: dict[str, Any]):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False, **dd)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False, **dd)
        self.down = nn.Linear(ffn_hidden, hidden, bias=False, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn_hidden: int,
                 rope_theta: float, norm_eps: float, dd: dict[str, Any]):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps=norm_eps, **dd)
        self.attn = GQAttention(hidden, heads, kv_heads, rope_theta, dd)
        self.mlp_norm = RMSNorm(hidden, eps=norm_eps, **dd)
        self.mlp = SwiGLU(hidden, ffn_hidden, dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama decoder: ids ``(batch, T)`` with ``T <= seq`` -> logits ``(batch, T, vocab)``.

    ``seq`` is the maximum context (recorded in ``config``; RoPE needs no table of it).
    ``config`` holds the constructor kwargs (without device/dtype); ``kind`` is ``"llama"``.
    """

    kind = "llama"

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
                 seq: int, ffn_hidden: int | None = None, device: Any = None,
                 dtype: torch.dtype | None = None, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-5, tie_embeddings: bool = False):
        super().__init__()
        if hidden % heads != 0:
            raise ModelError(f"llama: hidden={hidden} is not divisible by heads={heads}")
        if kv_heads < 1 or heads % kv_heads != 0:
            raise ModelError(f"llama: kv_heads={kv_heads} must divide heads={heads}")
        if (hidden // heads) % 2 != 0:
            raise ModelError(f"llama: head_dim={hidden // heads} must be even for RoPE")
        ffn = llama_ffn_hidden(hidden) if ffn_hidden is None else int(ffn_hidden)
        self.config: dict[str, Any] = dict(
            layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
            seq=seq, ffn_hidden=ffn, rope_theta=rope_theta, norm_eps=norm_eps,
            tie_embeddings=tie_embeddings)
        dd = factory_kwargs(device, dtype)
        with build_on(device):
            self.tok_emb = nn.Embedding(vocab, hidden, **dd)
            self.blocks = nn.ModuleList(
                LlamaBlock(hidden, heads, kv_heads, ffn, rope_theta, norm_eps, dd)
                for _ in range(layers))
            self.norm = RMSNorm(hidden, eps=norm_eps, **dd)
            if tie_embeddings:
                self.lm_head = nn.Linear(hidden, vocab, bias=False, device="meta", dtype=dtype)
                self.lm_head.weight = self.tok_emb.weight
            else:
                self.lm_head = nn.Linear(hidden, vocab, bias=False, **dd)
        init_transformer_(self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def extra_repr(self) -> str:
        return format_config(self.config)


def llama(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, seq: int,
          ffn_hidden: int | None = None, device: Any = None, dtype: torch.dtype | None = None,
          rope_theta: float = 10000.0, norm_eps: float = 1e-5,
          tie_embeddings: bool = False) -> Llama:
    """Build a Llama-style decoder directly on ``device``/``dtype`` (see :class:`Llama`).

    ``ffn_hidden=None`` uses :func:`llama_ffn_hidden`. Weights ~ N(0, 0.02), norm weights
    one; nothing is initialized on the meta device.
    """
    return Llama(layers, hidden, heads, kv_heads, vocab, seq, ffn_hidden=ffn_hidden,
                 device=device, dtype=dtype, rope_theta=rope_theta, norm_eps=norm_eps,
                 tie_embeddings=tie_embeddings)
