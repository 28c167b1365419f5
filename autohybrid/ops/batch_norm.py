"""Batch normalization whose statistics span a mesh axis (the global batch over dp).

`autohybrid::sync_batch_norm` is a custom op so graphs stay traceable: forward all-reduces
the per-channel sum and the centred sum of squares over the axis (two passes, for
accuracy) and normalizes; `autohybrid::update_running_stats` then updates the running
statistics in place exactly as eager BatchNorm does on the whole batch (unbiased variance
over the global count). Backward
all-reduces the two per-channel sums it needs; the weight and bias gradients stay local
sums, to be summed by the data-parallel gradient reduction like any other gradient.
"""
from __future__ import annotations

import torch

from . import groups


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _shape(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return c.view(1, -1, *([1] * (x.dim() - 2)))


@torch.library.custom_op("autohybrid::sync_batch_norm", mutates_args=())
def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    eps: float, axis: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalize with statistics over `axis`; returns (out, mean, invstd, unbiased var)."""
    dims = _reduce_dims(x)
    channels = x.shape[1]
    stats = torch.cat([x.sum(dims), x.new_tensor([x.numel() // channels])])
    groups.all_reduce(stats, axis)
    count = stats[-1]
    mean = stats[:-1] / count
    centred = x - _shape(x, mean)
    var = groups.all_reduce((centred * centred).sum(dims), axis) / count
    invstd = torch.rsqrt(var + eps)
    out = centred * _shape(x, invstd)
    if weight is not None:
        out = out * _shape(x, weight)
    if bias is not None:
        out = out + _shape(x, bias)
    unbiased = var * count / (count - 1).clamp(min=1)
    return out, mean, invstd, unbiased


@sync_batch_norm.register_fake
def _(x, weight, bias, eps, axis):
    c = x.shape[1]
    return torch.empty_like(x), x.new_empty(c), x.new_empty(c), x.new_empty(c)


@torch.library.custom_op("autohybrid::update_running_stats",
                         mutates_args=("running_mean", "running_var"))
def update_running_stats(running_mean: torch.Tensor, running_var: torch.Tensor,
                         mean: torch.Tensor, unbiased_var: torch.Tensor, momentum: float) -> None:
    """running = (1 - momentum) · running + momentum · batch statistic, as eager BatchNorm."""
    running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
    running_var.mul_(1 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)


@update_running_stats.register_fake
def _(running_mean, running_var, mean, unbiased_var, momentum):
    return None


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _eps, axis = inputs
    _, mean, invstd, unbiased = output
    ctx.mark_non_differentiable(mean, invstd, unbiased)
    ctx.save_for_backward(x, weight, mean, invstd)
    ctx.axis = axis
    ctx.has_bias = bias is not None


def _backward(ctx, grad_out, _grad_mean, _grad_invstd, _grad_var):
    x, weight, mean, invstd = ctx.saved_tensors
    dims = _reduce_dims(x)
    xhat = (x - _shape(x, mean)) * _shape(x, invstd)
    local_dy = grad_out.sum(dims)
    local_dy_xhat = (grad_out * xhat).sum(dims)
    channels = x.shape[1]
    sums = torch.cat([local_dy, local_dy_xhat, x.new_tensor([x.numel() // channels])])
    groups.all_reduce(sums, ctx.axis)
    sum_dy, sum_dy_xhat, count = sums[:channels], sums[channels:2 * channels], sums[-1]
    scale = invstd if weight is None else invstd * weight
    grad_x = _shape(x, scale) * (grad_out - _shape(x, sum_dy / count)
                                 - xhat * _shape(x, sum_dy_xhat / count))
    grad_w = local_dy_xhat if weight is not None else None
    grad_b = local_dy if ctx.has_bias else None
    return grad_x, grad_w, grad_b, None, None


sync_batch_norm.register_autograd(_backward, setup_context=_setup_context)
