"""Whole-batch statistics in a loss under microbatches: their sums before the step.

A loss term computed from sums over the whole batch (Hugging Face's MoE load-balancing
loss: tokens per expert over every token, passes/batch_stats.py) cannot be back-propagated
one microbatch at a time: the first microbatch's backward would need the sums of
microbatches not yet forwarded. The runtime therefore runs the step's forwards twice:

1. `sums_first`: every microbatch forward without autograd, each `autohybrid::batch_sum`
   recording its partial sum (ops/batch_sum.collect); the partial sums are added over the
   microbatches and over dp in one all-reduce (`WholeBatch.add_up`), and the rank's
   denominators summed (the term's weight). The random generator is restored afterwards,
   so the second forward draws what the first drew (the pass refuses the orders where it
   would not: passes/batch_stats.whole_batch_problem).
2. The step itself, under `ops.batch_sum.apply`: each `batch_sum` returns the totals, so
   every microbatch computes the whole batch's term, eager's value; its gradient reaches
   each microbatch's own partial sums.

The price is one forward without saved activations per step (the pricing counts it:
search/pricing.py). With one microbatch the single forward already sees the whole shard:
nothing of this runs.

Example::

    sums = sums_first(lambda: sum(program.run(state, i, t)[-1] for i, t in micro), count)
    with step(sums, count):
        ...  # the microbatches' forwards and backwards
"""
from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.fx as fx

from ..ops.batch_sum import WholeBatch, apply, collect

_BATCH_SUM = torch.ops.autohybrid.batch_sum.default

__all__ = ["WholeBatch", "apply", "has_batch_sums", "sums_first", "step"]


_SEEN: "weakref.WeakKeyDictionary[fx.GraphModule, bool]" = weakref.WeakKeyDictionary()


def has_batch_sums(graphs: Sequence[fx.GraphModule]) -> bool:
    """Whether any of `graphs` adds partial sums over the batch (`batch_sum` nodes, in
    the graph or a region of it recomputed in backward: a submodule); each graph looked
    at once."""
    for gm in graphs:
        if gm not in _SEEN:
            _SEEN[gm] = any(n.target is _BATCH_SUM for sub in gm.modules()
                            if isinstance(sub, fx.GraphModule) for n in sub.graph.nodes)
    return any(_SEEN[gm] for gm in graphs)


@contextlib.contextmanager
def _same_draws() -> Iterator[None]:
    """Restore the random generators (CPU, and the current GPU's when in use) on exit."""
    devices = ([torch.cuda.current_device()]
               if torch.cuda.is_available() and torch.cuda.is_initialized() else [])
    with torch.random.fork_rng(devices=devices):
        yield


def sums_first(forward_all: Callable[[], torch.Tensor | None], count: int,
               axis: str = "dp") -> WholeBatch:
    """Run `forward_all()` (every microbatch's forward on this rank; returns the sum of
    their loss denominators, or None on a rank without the loss) without autograd,
    recording the partial sums; add them over `axis`; the rank's denominator over
    `count` becomes the term's weight."""
    state = WholeBatch()
    with _same_draws(), torch.no_grad(), collect(state):
        denominator = forward_all()
    state.add_up(axis)
    if denominator is not None:
        state.weight = denominator.detach() / count
    return state


def step(state: WholeBatch | None, count: int) -> contextlib.AbstractContextManager:
    """The context the step's forwards and backwards run in: `apply(state, ...)`, or
    nothing without whole-batch sums."""
    if state is None:
        return contextlib.nullcontext()
    return apply(state, count, state.weight)
