"""The sum of per-shard partial sums over a mesh axis: whole-batch statistics in a loss.

A loss term built from statistics of the whole batch — Hugging Face's MoE load-balancing
loss divides the tokens routed to each expert, summed over every token of the batch, by
the batch's token count — is not a sum of per-sample terms, so data-parallel shards cannot
each compute their part (passes/global_loss.py). Each shard can compute its *partial* sum
(the sum over its own samples); `autohybrid::batch_sum(x, axis, key)` adds the partial sums
of every rank of `axis` (an all-reduce), after which every rank holds the whole batch's
value, as eager computes it.

Backward: whole-batch statistic y = Σ_r x_r, every rank computes the rest of the loss from
the same y, and rank r's share of dL/dy is what its own backward brings; so dL/dx_r = Σ_r'
(rank r' share) — the same all-reduce of the incoming gradients (runtime/executor.py sums
the ranks' parameter gradients, each rank having back-propagated its part of the loss:
passes/global_loss.py seeds the term by `autohybrid::term_weight(denominator)`, the rank's
share of the loss denominator).

Microbatches. The backward of one microbatch starts before the next one's partial sums
exist, so the runtime computes the sums first (`WholeBatch`): a forward of every
microbatch without autograd under `collect()` records each node's partial sums (`key`, the
node's name) and adds them over the microbatches and the axis (`totals`); then the step's
forward and backward run under `apply()`, where each `batch_sum` returns the whole batch's
total (the same values, so everything after it is eager's) and passes its gradient to the
microbatch's own partial sum. As every microbatch's partial sum enters the total once, each
must receive the whole term's gradient: `term_weight` then seeds every microbatch's term
with its rank's whole denominator over the count of microbatches (the term's value still
adds up to once per rank), and the backward multiplies by that count.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import groups


class WholeBatch:
    """The partial sums of one step's microbatches and, once added up, their totals."""

    def __init__(self) -> None:
        self.partials: dict[str, torch.Tensor] = {}
        self.totals: dict[str, torch.Tensor] = {}
        self.count = 1                       # microbatches (the backward's factor)
        self.weight: torch.Tensor | None = None   # term_weight's value under apply()
        self.applying = False

    def record(self, key: str, x: torch.Tensor) -> None:
        x = x.detach()
        self.partials[key] = x.clone() if key not in self.partials else self.partials[key] + x

    def add_up(self, axis: str) -> None:
        """Totals: the partial sums added over the ranks of `axis`, in one all-reduce
        (every rank of the axis holds the same nodes, so the same keys)."""
        keys = sorted(self.partials)
        if not keys:
            return
        flat = torch.cat([self.partials[k].reshape(-1).double() for k in keys])
        groups.all_reduce(flat, axis)
        offset = 0
        for k in keys:
            p = self.partials[k]
            self.totals[k] = flat[offset:offset + p.numel()].view(p.shape).to(p.dtype)
            offset += p.numel()


_ACTIVE: list[WholeBatch] = []


@contextlib.contextmanager
def collect(state: WholeBatch) -> Iterator[WholeBatch]:
    """`batch_sum` records its input under its key (and returns it unchanged)."""
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.pop()


@contextlib.contextmanager
def apply(state: WholeBatch, count: int, weight: torch.Tensor) -> Iterator[WholeBatch]:
    """`batch_sum` returns the totals, `term_weight` returns `weight` (the rank's whole
    denominator / `count`), the backward multiplies by `count`."""
    state.count, state.weight, state.applying = count, weight, True
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.pop()
        state.applying = False


@torch.library.custom_op("autohybrid::batch_sum", mutates_args=())
def batch_sum(x: torch.Tensor, axis: str, key: str = "") -> torch.Tensor:
    """Σ over the ranks of `axis` of `x` (each rank's partial sum over its samples)."""
    if not _ACTIVE:
        return groups.all_reduce(x.clone(), axis)
    state = _ACTIVE[-1]
    if not state.applying:
        state.record(key, x)
        return x.clone()
    if key not in state.totals:
        raise RuntimeError(f"autohybrid::batch_sum {key!r}: no partial sums were collected "
                           "for it before the step (runtime/executor.py)")
    return state.totals[key].clone()


@batch_sum.register_fake
def _(x, axis, key=""):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    ctx.axis = inputs[1]
    ctx.count = _ACTIVE[-1].count if _ACTIVE and _ACTIVE[-1].applying else 1


def _backward(ctx, grad):
    total = groups.all_reduce(grad.contiguous().clone(), ctx.axis)
    return (total if ctx.count == 1 else total * ctx.count), None, None


batch_sum.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("autohybrid::term_weight", mutates_args=())
def term_weight(denominator: torch.Tensor) -> torch.Tensor:
    """The weight of the whole-batch term in this shard's numerator: its denominator, or
    under `apply()` the rank's denominator over all its microbatches / their count."""
    if _ACTIVE and _ACTIVE[-1].applying and _ACTIVE[-1].weight is not None:
        return _ACTIVE[-1].weight.to(denominator.dtype).reshape(denominator.shape).clone()
    return denominator.clone()


@term_weight.register_fake
def _(denominator):
    return torch.empty_like(denominator)
