"""Vocabulary-parallel embedding and cross-entropy (Megatron style), as custom ops.

The vocabulary rows of the embedding (or columns of the output projection) are split
contiguously over the ranks of a tp axis: rank r holds global rows
[vocab_start, vocab_start + V_local). The vocabulary may be padded up to a multiple of
the axis size; rows at global index >= vocab_size are padding and take no part.

- `autohybrid::vocab_parallel_embedding(ids, weight_shard, vocab_start, axis,
  padding_idx=-1)`: the rows this rank holds, zeros for ids outside its range: this
  rank's PARTIAL sum (the pass adds `tp_reduce` after it; nothing is reduced here, `axis`
  only names the axis the shard is split over). Backward: the gradient of the local
  weight shard (rows in range get their scatter-added gradient, pad rows zero); ids get
  none. `padding_idx` is a GLOBAL row index, as `aten.embedding` takes it (-1: none): the
  forward is a plain lookup, and tokens equal to it give no gradient, as in
  `aten.embedding_dense_backward` (ids compared to it as given, so the one rank whose
  shard holds that row leaves it zero and the others never see it). No `max_norm`, no
  `scale_grad_by_freq`, no `sparse` (the tp pass refuses them); ids are not
  range-checked.
- `autohybrid::vocab_parallel_cross_entropy(logits_shard, target, vocab_start,
  vocab_size, ignore_index, label_smoothing, axis)` -> (loss, lse): the per-token loss of
  `F.cross_entropy(full_logits[..., :vocab_size], target, reduction="none",
  ignore_index=ignore_index, label_smoothing=label_smoothing)` (dtype of the logits, 0
  for ignored tokens) without gathering the logits. Forward all-reduces the per-token
  MAX over `axis`, then one SUM of [sum of exp, target logit (from the rank holding the
  target), sum of the real logits (label smoothing)]. With lse = log-sum-exp over the
  real vocabulary and C = vocab_size,
      loss = (1 - eps) (lse - x_t) + eps (lse - sum_c x_c / C).
  The second output is lse (float32 or wider, non-differentiable), returned because
  a custom op's autograd only sees its inputs and outputs; backward recomputes the local
  softmax from the saved logits and lse, without communication:
      d logits = (softmax - (1 - eps) one_hot(t) - eps / C) * grad, 0 in pad columns and
  for ignored tokens. Targets are not range-checked.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import groups


def _local_index(ids: torch.Tensor, start: int, rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids - start with out-of-range entries set to 0, mask of in-range entries)."""
    local = ids - start
    inside = (local >= 0) & (local < rows)
    return local.masked_fill(~inside, 0), inside


# ------------------------------------------------------------------ embedding

@torch.library.custom_op("autohybrid::vocab_parallel_embedding", mutates_args=())
def vocab_parallel_embedding(ids: torch.Tensor, weight_shard: torch.Tensor,
                             vocab_start: int, axis: str, padding_idx: int = -1
                             ) -> torch.Tensor:
    """Rows of the local shard for ids in range, zeros elsewhere (a partial sum over axis);
    no gradient for ids equal to `padding_idx` (global; -1: none)."""
    local, inside = _local_index(ids, vocab_start, weight_shard.shape[0])
    return F.embedding(local, weight_shard).masked_fill_(~inside.unsqueeze(-1), 0)


@vocab_parallel_embedding.register_fake
def _(ids, weight_shard, vocab_start, axis, padding_idx=-1):
    return weight_shard.new_empty((*ids.shape, weight_shard.shape[1]))


def _embedding_setup(ctx, inputs, output) -> None:
    ids, weight_shard, vocab_start, _axis, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.vocab_start, ctx.rows, ctx.padding_idx = vocab_start, weight_shard.shape[0], padding_idx


def _embedding_backward(ctx, grad):
    (ids,) = ctx.saved_tensors
    local, inside = _local_index(ids, ctx.vocab_start, ctx.rows)
    if ctx.padding_idx != -1:  # aten.embedding_dense_backward: -1 means none
        inside = inside & (ids != ctx.padding_idx)
    dim = grad.shape[-1]
    grad = grad.masked_fill(~inside.unsqueeze(-1), 0).reshape(-1, dim)
    grad_weight = grad.new_zeros((ctx.rows, dim)).index_add_(0, local.reshape(-1), grad)
    return None, grad_weight, None, None, None


vocab_parallel_embedding.register_autograd(_embedding_backward, setup_context=_embedding_setup)


# ------------------------------------------------------------------ cross-entropy

def _real_logits(logits: torch.Tensor, start: int, vocab_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits in float32 or wider with pad columns at -inf, and the pad column mask."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    pad = torch.arange(logits.shape[-1], device=logits.device) + start >= vocab_size
    return logits.to(dtype).masked_fill(pad, float("-inf")), pad


def _target_index(target: torch.Tensor, start: int, cols: int, ignore_index: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    local, inside = _local_index(target, start, cols)
    hit = inside & (target != ignore_index)
    return local.masked_fill(~hit, 0), hit


@torch.library.custom_op("autohybrid::vocab_parallel_cross_entropy", mutates_args=())
def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 vocab_start: int, vocab_size: int, ignore_index: int,
                                 label_smoothing: float, axis: str
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy over the vocabulary split on `axis`; returns (loss, lse)."""
    x, pad = _real_logits(logits_shard, vocab_start, vocab_size)
    group = groups.peers(axis)
    top = x.amax(-1)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    local, hit = _target_index(target, vocab_start, x.shape[-1], ignore_index)
    sums = torch.stack([
        (x - top.unsqueeze(-1)).exp().sum(-1),
        x.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~hit, 0),
        x.masked_fill(pad, 0).sum(-1)])
    if group is not None:
        dist.all_reduce(sums, group=group)
    sum_exp, target_logit, logit_sum = sums.unbind(0)
    lse = top + sum_exp.log()
    eps = label_smoothing
    loss = (1 - eps) * (lse - target_logit) + eps * (lse - logit_sum / vocab_size)
    return loss.masked_fill(target == ignore_index, 0).to(logits_shard.dtype), lse


@vocab_parallel_cross_entropy.register_fake
def _(logits_shard, target, vocab_start, vocab_size, ignore_index, label_smoothing, axis):
    dtype = torch.promote_types(logits_shard.dtype, torch.float32)
    return (logits_shard.new_empty(target.shape),
            logits_shard.new_empty(target.shape, dtype=dtype))


def _ce_setup(ctx, inputs, output) -> None:
    logits_shard, target, vocab_start, vocab_size, ignore_index, eps, _axis = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits_shard, target, output[1])
    ctx.consts = vocab_start, vocab_size, ignore_index, eps


def _ce_backward(ctx, grad_loss, _grad_lse):
    logits_shard, target, lse = ctx.saved_tensors
    start, vocab_size, ignore_index, eps = ctx.consts
    x, pad = _real_logits(logits_shard, start, vocab_size)
    grad = (x - lse.unsqueeze(-1)).exp()  # the local softmax; 0 in pad columns
    local, hit = _target_index(target, start, x.shape[-1], ignore_index)
    grad.scatter_add_(-1, local.unsqueeze(-1), hit.to(grad.dtype).unsqueeze(-1) * (eps - 1))
    if eps:
        grad = grad - (eps / vocab_size) * (~pad).to(grad.dtype)
    scale = grad_loss.masked_fill(target == ignore_index, 0).unsqueeze(-1)
    return (grad * scale).to(logits_shard.dtype), None, None, None, None, None, None


vocab_parallel_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)
