"""Multi-layer perceptron: ``(batch, in_features) -> (batch, out_features)``.

``layers`` counts the Linear layers (>= 1): ``in -> hidden``, ``layers - 2`` times
``hidden -> hidden``, then ``hidden -> out``, with the activation between them (not after
the last). Linear layers have biases; weights ~ N(0, 0.02), biases zero.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..errors import ModelError
from ._common import build_on, factory_kwargs, format_config, init_transformer_

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "identity": nn.Identity,
}


class MLP(nn.Module):
    """Stack of Linear layers (``self.layers``) with an activation between them."""

    kind = "mlp"

    def __init__(self, in_features: int, hidden: int, out_features: int, layers: int = 2,
                 device: Any = None, dtype: torch.dtype | None = None,
                 activation: str = "gelu"):
        super().__init__()
        if layers < 1:
            raise ModelError(f"mlp: layers={layers} must be >= 1")
        if activation not in _ACTIVATIONS:
            raise ModelError(f"mlp: unknown activation {activation!r}; "
                             f"known: {sorted(_ACTIVATIONS)}")
        self.config: dict[str, Any] = dict(in_features=in_features, hidden=hidden,
                                           out_features=out_features, layers=layers,
                                           activation=activation)
        dims = [in_features] + [hidden] * (layers - 1) + [out_features]
        dd = factory_kwargs(device, dtype)
        with build_on(device):
            self.layers = nn.ModuleList(nn.Linear(a, b, **dd) for a, b in zip(dims, dims[1:]))
            self.act = _ACTIVATIONS[activation]()
        init_transformer_(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < n - 1:
                x = self.act(x)
        return x

    def extra_repr(self) -> str:
        return format_config(self.config)


def mlp(in_features: int, hidden: int, out_features: int, layers: int = 2, device: Any = None,
        dtype: torch.dtype | None = None, activation: str = "gelu") -> MLP:
    """Build an :class:`MLP` directly on ``device``/``dtype``."""
    return MLP(in_features, hidden, out_features, layers=layers, device=device, dtype=dtype,
               activation=activation)


__all__ = ["MLP", "mlp"]
