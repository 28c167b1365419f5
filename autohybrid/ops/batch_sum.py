"""The sum of per-shard partial sums over a mesh axis: whole-batch statistics in a loss.

A loss term built from statistics of the whole batch — Hugging Face's MoE load-balancing
loss divides the tokens routed to each expert, summed over every token of the batch, by
the batch's token count — is not a sum of per-sample terms, so data-parallel shards cannot
each compute their part (passes/global_loss.py). Each shard can compute its *partial* sum
(the sum over its own samples); `autohybrid::batch_sum(x, axis)` adds the partial sums of
every rank of `axis` (an all-reduce), after which every rank holds the whole batch's value,
as eager computes it.

Backward: whole-batch statistic y = Σ_r x_r, every rank computes the rest of the loss from
the same y, and rank r's share of dL/dy is what its own backward brings; so dL/dx_r = Σ_r'
(rank r' share) — the same all-reduce of the incoming gradients (runtime/executor.py sums
the ranks' parameter gradients, each rank having back-propagated its part of the loss:
passes/global_loss.py seeds the term by the rank's share of the loss denominator).
"""
from __future__ import annotations

import torch

from . import groups


@torch.library.custom_op("autohybrid::batch_sum", mutates_args=())
def batch_sum(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Σ over the ranks of `axis` of `x` (each rank's partial sum over its samples)."""
    return groups.all_reduce(x.clone(), axis)


@batch_sum.register_fake
def _(x, axis):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    ctx.axis = inputs[1]


def _backward(ctx, grad):
    return batch_sum(grad.contiguous(), ctx.axis), None


batch_sum.register_autograd(_backward, setup_context=_setup_context)
