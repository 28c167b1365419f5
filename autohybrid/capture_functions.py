"""Custom `torch.autograd.Function`s in a captured model: their backward is not captured.

torch.export traces a Function's `forward` into the graph as plain ops and keeps no trace
of its hand-written `backward`; the compiled model's gradient is then autograd's
derivative of those ops. Where the backward is that derivative (a fused GELU, a reversible
layer that recomputes its inputs to save memory) nothing changes; where it is not — a
gradient-reversal layer, a straight-through estimator, a backward under `torch.no_grad()`
forward (Hugging Face Reformer) — every plan would train silently wrong.

`recording()` notes the Function classes a trace applies (torch's own, whose backward is
their forward's derivative — reentrant checkpointing —, excepted); `check_backward` then
runs the model once in eager (with the Functions' own backward) and the captured graph
once (with autograd's) on the example batch, from the same random state, and raises
CaptureError naming the Functions when a parameter's gradient differs beyond rounding. A
model on the meta device cannot run: it is refused with the same reason.

    >>> with recording() as applied:
    ...     ep = torch.export.export(...)
    >>> check_backward(wrapper, cap, args, applied)   # raises CaptureError, or returns
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.nn as nn

from .errors import CaptureError

#: relative difference of a parameter's gradient beyond rounding (float32 sums of a
#: whole batch, computed in another order)
_TOLERANCE = 1e-3
_FLOOR = 1e-5


@contextlib.contextmanager
def recording() -> Iterator[list[type]]:
    """The custom Function classes applied inside the context (other than torch's)."""
    applied: list[type] = []
    function = torch.autograd.Function
    original = function.__dict__["apply"]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith("torch.") and cls not in applied:
            applied.append(cls)
        return original.__func__(cls, *args, **kwargs)

    function.apply = classmethod(apply)
    try:
        yield applied
    finally:
        function.apply = original


def _names(classes: list[type]) -> str:
    return ", ".join(f"{c.__module__}.{c.__qualname__}" for c in classes)


def check_backward(model: nn.Module, eager_loss: Callable[[], torch.Tensor],
                   graph_loss: Callable[[], torch.Tensor], applied: list[type]) -> None:
    """Raise CaptureError unless the graph's gradients (`graph_loss()`, autograd through
    the traced forward) equal eager's (`eager_loss()`, the Functions' own backward) for
    every parameter of `model`. Buffers (BatchNorm's running statistics) are restored."""
    if not applied:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    what = (f"the model applies custom torch.autograd.Function {_names(applied)}, whose "
            "hand-written backward torch.export does not capture (the compiled model would "
            "differentiate its forward instead)")
    fix = ("  what to do: write it with ops autograd differentiates, or as a "
           "torch.library.custom_op with register_autograd (an op the graph keeps whole)")
    if any(p.is_meta for p in params) or not params:
        raise CaptureError(f"{what}, and on the meta device autohybrid cannot check that "
                           f"the two agree\n{fix}")
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    state = torch.random.get_rng_state()
    try:
        eager = _grads(eager_loss, params)
        torch.random.set_rng_state(state)
        graph = _grads(graph_loss, params)
    finally:
        torch.random.set_rng_state(state)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    names = {id(p): n for n, p in model.named_parameters()}
    largest = max((float(e.abs().max()) for e in eager if e.numel()), default=0.0)
    for p, e, g in zip(params, eager, graph):
        scale = float(e.abs().max()) if e.numel() else 0.0
        diff = float((e - g).abs().max()) if e.numel() else 0.0
        # beyond rounding of its own size, and of the model's largest gradient (a
        # gradient zero in exact arithmetic, a bias before a BatchNorm, is all rounding)
        if diff > _TOLERANCE * scale + _FLOOR * largest and diff > 0:
            raise CaptureError(
                f"{what}, and here the two differ: the gradient of {names[id(p)]} by up to "
                f"{diff:.3g} (its largest eager value {scale:.3g}) on the example batch, so "
                f"every plan would train silently wrong\n{fix}")


def _grads(loss_fn: Callable[[], torch.Tensor], params: list[nn.Parameter]
           ) -> list[torch.Tensor]:
    with torch.enable_grad():
        loss = loss_fn()
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            return [torch.zeros_like(p) for p in params]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)]
