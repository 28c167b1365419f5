"""Mixture-of-experts decoder: Llama blocks whose MLP is a routed set of SwiGLU experts.

Each MoE layer (``MoE``): a linear router scores every token against ``experts``
experts (``score="softmax"``, Mixtral / Qwen; ``"sigmoid"``, DeepSeek-V3), keeps the
``top_k`` best (weights renormalized to sum to one when ``norm_topk``, then times
``routed_scale``), and sums the chosen experts' SwiGLU outputs with those weights —
dropless, through ``autohybrid::moe_experts`` (ops/moe.py), whose 3-D weight layout is
Hugging Face's (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)). ``shared``
experts (DeepSeek / Qwen2-MoE) are one dense SwiGLU of ``shared · expert_hidden`` that
every token goes through. The first ``dense_layers`` blocks have a dense SwiGLU of
``ffn_hidden`` instead (DeepSeek-V3's first three).

Load balancing (``aux_loss_coef`` > 0): DeepSeek-V3's sequence-wise balance loss, per
sequence b and layer, ``coef · Σ_i f_i · P_i`` with ``f_i = E/(k·T) ·`` (routes of the
sequence's T tokens to expert i) and ``P_i`` the mean over its tokens of the normalized
scores. It is per sample — a shard of the batch computes its own samples' terms exactly —
so a split batch (data, expert parallelism, microbatches) gives eager's loss. The model
then returns ``(logits, aux)`` with ``aux`` of shape (batch,) summed over layers, and
``moe_loss`` (the zoo's loss for it) is the mean over tokens of cross-entropy plus the
token's sequence's ``aux``: cross-entropy's mean plus the mean of ``aux``.

Capacity (``capacity_factor``, default None: dropless): each expert takes at most
``ceil(capacity_factor · T · k / E)`` routes of each sequence, first choices before
second ones (GShard's priority); the routes past it are dropped. The capacity counts per
sequence, not per batch or per rank as Megatron and GShard's device groups do, so which
routes drop does not depend on how the plan splits the batch: every plan still trains
exactly like eager.

Attention is Llama's (GQA, RoPE): the DeepSeek-V3-style preset keeps DeepSeek's expert
layout (256 fine-grained experts, top-8, one shared, sigmoid scores) but not its latent
attention (MLA).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from ..ops.moe import moe_experts
from ._common import RMSNorm, build_on, factory_kwargs, format_config, init_transformer_
from .llama import GQAttention, SwiGLU, llama_ffn_hidden

SCORES = ("softmax", "sigmoid")


class Experts(nn.Module):
    """``experts`` SwiGLU MLPs as stacked weights (Hugging Face's layout)."""

    _ah_experts = True   # init.TransformerRule draws its 3-D weights as Linear weights

    def __init__(self, experts: int, hidden: int, expert_hidden: int, dd: dict[str, Any]):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * expert_hidden, hidden, **dd))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, expert_hidden, **dd))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return moe_experts(x, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                           self.num_experts, "silu", "")


class MoE(nn.Module):
    """Router, routed experts and optional shared experts over tokens ``(b, t, hidden)``;
    returns ``(output, aux)``, ``aux`` the per-sequence balance loss (b,) (zeros when
    ``aux_loss_coef`` is 0)."""

    def __init__(self, hidden: int, experts: int, top_k: int, expert_hidden: int,
                 shared: int, score: str, norm_topk: bool, routed_scale: float,
                 aux_loss_coef: float, dd: dict[str, Any],
                 capacity_factor: float | None = None):
        super().__init__()
        self.top_k, self.score, self.norm_topk = top_k, score, norm_topk
        self.capacity_factor = capacity_factor
        self.routed_scale, self.aux_loss_coef = routed_scale, aux_loss_coef
        self.router = nn.Linear(hidden, experts, bias=False, **dd)
        self.experts = Experts(experts, hidden, expert_hidden, dd)
        self.shared = SwiGLU(hidden, shared * expert_hidden, dd) if shared else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = x.flatten(0, 1)   # (no arithmetic on sizes: blocks capture alike)
        logits = self.router(flat).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        top, index = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk:
            top = top / (top.sum(-1, keepdim=True) + 1e-20)
        routed, weights = index, top * self.routed_scale
        if self.capacity_factor is not None:
            routed, weights = self._within_capacity(index, weights, x.shape[0], x.shape[1])
        y = self.experts(flat, routed, weights)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view_as(x), self._balance(index, scores, x.shape[0])

    def _within_capacity(self, index: torch.Tensor, weights: torch.Tensor, b: int, t: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routes past an expert's capacity in their sequence dropped (index = the "no
        expert" sentinel, weight 0: the token's other experts and the residual carry
        it). Capacity = ceil(capacity_factor · T · k / E) routes per expert and sequence;
        a sequence's first choices take their slots before its second choices, in token
        order within each (GShard's priority). Per sequence, so a split batch drops what
        the whole batch drops."""
        n, k = self.experts.num_experts, self.top_k
        capacity = math.ceil(self.capacity_factor * t * k / n)
        routes = index.view(b, t, k).transpose(1, 2).reshape(b, k * t)  # choice-major
        onehot = F.one_hot(routes, n)
        slot = (onehot.cumsum(1) * onehot).sum(-1)   # 1-based place in its expert's queue
        keep = (slot <= capacity).view(b, k, t).transpose(1, 2).reshape(b * t, k)
        return torch.where(keep, index, n), weights * keep

    def _balance(self, index: torch.Tensor, scores: torch.Tensor, b: int) -> torch.Tensor:
        n = scores.shape[-1]
        if not self.aux_loss_coef:
            return scores.new_zeros(b)
        experts = torch.arange(n, device=index.device)
        # f_i = E/(k·T) · routes to i = E · the share of the sequence's T·k routes
        f = (index.view(b, -1, 1) == experts).to(scores.dtype).mean(1) * n
        p = (scores / scores.sum(-1, keepdim=True)).view(b, -1, n).mean(1)
        return self.aux_loss_coef * (f * p).sum(-1)


class MoEBlock(nn.Module):
    """``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``, the MLP a MoE layer (or
    a dense SwiGLU)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, rope_theta: float,
                 norm_eps: float, mlp: nn.Module, dd: dict[str, Any]):
        super().__init__()
        self.attn_norm = RMSNorm(hidden, eps=norm_eps, **dd)
        self.attn = GQAttention(hidden, heads, kv_heads, rope_theta, dd)
        self.mlp_norm = RMSNorm(hidden, eps=norm_eps, **dd)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, the balance loss so far) → both after this block (the sum is carried
        through the blocks, so no op runs between them: capture per distinct block)."""
        x = x + self.attn(self.attn_norm(x))
        if isinstance(self.mlp, MoE):
            y, balance = self.mlp(self.mlp_norm(x))
            return x + y, aux + balance
        return x + self.mlp(self.mlp_norm(x)), aux


class MoETransformer(nn.Module):
    """MoE decoder: ids ``(batch, T)`` → logits ``(batch, T, vocab)``, or ``(logits, aux)``
    with the per-sequence balance loss ``aux`` (batch,) when ``aux_loss_coef`` > 0."""

    kind = "moe"

    def __init__(self, layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
                 seq: int, experts: int, top_k: int, expert_hidden: int, shared: int = 0,
                 score: str = "softmax", norm_topk: bool = True, routed_scale: float = 1.0,
                 aux_loss_coef: float = 0.01, dense_layers: int = 0,
                 capacity_factor: float | None = None,
                 ffn_hidden: int | None = None, rope_theta: float = 10000.0,
                 norm_eps: float = 1e-5, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
            raise ModelError(f"moe: hidden={hidden}, heads={heads}, kv_heads={kv_heads}: "
                             "heads must divide hidden (even head dim), kv_heads heads")
        if not 1 <= top_k <= experts:
            raise ModelError(f"moe: top_k={top_k} must lie in [1, experts={experts}]")
        if score not in SCORES:
            raise ModelError(f"moe: score={score!r} is not one of {SCORES}")
        if not 0 <= dense_layers <= layers:
            raise ModelError(f"moe: dense_layers={dense_layers} must lie in [0, {layers}]")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ModelError(f"moe: capacity_factor={capacity_factor} must be > 0 (None: "
                             "dropless)")
        ffn = llama_ffn_hidden(hidden) if ffn_hidden is None else int(ffn_hidden)
        self.config: dict[str, Any] = dict(
            layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=vocab,
            seq=seq, experts=experts, top_k=top_k, expert_hidden=expert_hidden,
            shared=shared, score=score, norm_topk=norm_topk, routed_scale=routed_scale,
            aux_loss_coef=aux_loss_coef, dense_layers=dense_layers,
            capacity_factor=capacity_factor, ffn_hidden=ffn,
            rope_theta=rope_theta, norm_eps=norm_eps)
        dd = factory_kwargs(device, dtype)
        with build_on(device):
            self.tok_emb = nn.Embedding(vocab, hidden, **dd)
            self.blocks = nn.ModuleList(
                MoEBlock(hidden, heads, kv_heads, rope_theta, norm_eps,
                         SwiGLU(hidden, ffn, dd) if i < dense_layers else
                         MoE(hidden, experts, top_k, expert_hidden, shared, score,
                             norm_topk, routed_scale, aux_loss_coef, dd, capacity_factor),
                         dd)
                for i in range(layers))
            self.norm = RMSNorm(hidden, eps=norm_eps, **dd)
            self.lm_head = nn.Linear(hidden, vocab, bias=False, **dd)
        init_transformer_(self)

    def forward(self, idx: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = self.tok_emb(idx)
        aux = x.new_zeros(idx.shape[0], dtype=torch.float32)
        for block in self.blocks:
            x, aux = block(x, aux)
        logits = self.lm_head(self.norm(x))
        if not self.config["aux_loss_coef"] or self.config["dense_layers"] == len(self.blocks):
            return logits
        return logits, aux

    def extra_repr(self) -> str:
        return format_config(self.config)


def moe(layers: int, hidden: int, heads: int, kv_heads: int, vocab: int, seq: int,
        experts: int, top_k: int, expert_hidden: int, device: Any = None,
        dtype: torch.dtype | None = None, **options: Any) -> MoETransformer:
    """Build a MoE decoder directly on ``device``/``dtype`` (see :class:`MoETransformer`
    for ``options``). Weights ~ N(0, 0.02) (experts' too), norm weights one."""
    return MoETransformer(layers, hidden, heads, kv_heads, vocab, seq, experts, top_k,
                          expert_hidden, device=device, dtype=dtype, **options)


def moe_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; with ``(logits, aux)``, the mean over tokens of each
    token's cross-entropy plus its sequence's balance loss."""
    if not isinstance(output, (tuple, list)):
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
    logits, aux = output
    # classes along dim 1, per-token losses shaped as the targets: torch's meta kernel of
    # a 1-D `reduction="none"` loss has the wrong size under symbolic shapes, so a model
    # built on the meta device would not capture with logits.reshape(-1, V) here
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (ce + aux.unsqueeze(-1)).mean()
