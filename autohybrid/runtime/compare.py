"""How the first-step check compares the compiled model with eager: the tolerances, the
comparison of a loss or gradient, and the refusal of plans whose random draws cannot
match eager's. Shared by the whole-model check (selfcheck.py) and the per-stage one
(selfcheck_stage.py), which import it; it imports neither.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import AutohybridError
from ..graph import draws_random

_RTOL = {torch.float16: 5e-2, torch.bfloat16: 5e-2}
_DEFAULT_RTOL = 1e-3


def has_random_ops(gm: fx.GraphModule) -> bool:
    """Whether the graph draws random numbers (dropout with p > 0, rand*, bernoulli)."""
    return any(draws_random(node) for node in gm.graph.nodes if node.op == "call_function")


def refuse_random(gm: fx.GraphModule, dp: int, num_microbatches: int) -> None:
    """AutohybridError when the train graph draws random numbers and the plan splits the
    batch: such a step draws other masks than eager's by design."""
    if has_random_ops(gm) and (dp > 1 or num_microbatches > 1):
        raise AutohybridError(
            "check=True cannot compare this plan with eager: the model draws random "
            f"numbers (dropout) and the plan splits the batch (dp={dp}, "
            f"{num_microbatches} microbatches per rank), so each shard draws its own "
            "masks. Check with dropout at 0, or pin dp=1 and num_microbatches=1 for "
            "the checked run")


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    return bool((a - b).abs().max() <= atol + rtol * b.abs().max())


def _differs(name: str, got: torch.Tensor | None, want: torch.Tensor | None,
             rtol: float, atol: float) -> str | None:
    if (got is None) != (want is None):
        return ("eager has a gradient, the compiled model none" if got is None
                else "the compiled model has a gradient, eager none")
    if want is None or want.numel() == 0:
        return None
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)} vs eager's {tuple(want.shape)}"
    got = got.to(want.dtype)
    if _close(got, want, rtol, atol):
        return None
    diff = (got - want).abs().max().item()
    peak = want.abs().max().item()
    return (f"largest difference {diff:.3g} of a largest gradient {peak:.3g} "
            f"({diff / peak:.1%} of it)" if peak else f"largest difference {diff:.3g}")
