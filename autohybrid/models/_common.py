"""Helpers shared by the model zoo: device/dtype handling and weight initialization.

Every factory builds its modules directly on the requested device and dtype (factory
kwargs passed to each layer, inside ``with torch.device(device)`` so that tensors created
by PyTorch internals land there too). When the result lives on the meta device the
initialization pass is skipped entirely, so a 175B-parameter model constructs in seconds
and allocates nothing.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch
from torch import nn

#: Standard deviation of the GPT-2 style normal initialization.
INIT_STD = 0.02


def factory_kwargs(device: torch.device | str | None, dtype: torch.dtype | None) -> dict[str, Any]:
    """The ``device=``/``dtype=`` keyword arguments handed to every ``nn`` layer."""
    return {"device": device, "dtype": dtype}


@contextlib.contextmanager
def build_on(device: torch.device | str | None) -> Iterator[None]:
    """Context in which a model is built: ``torch.device(device)`` when one is given."""
    if device is None:
        yield
    else:
        with torch.device(device):
            yield


def is_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` lives on the meta device."""
    for t in module.parameters():
        return t.is_meta
    for t in module.buffers():
        return t.is_meta
    return False


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: ``x * rsqrt(mean(x^2) + eps) * weight``.

    The normalization is computed in fp32 and cast back to the input dtype before the
    (learned, ones-initialized) scale is applied, as in Meta's Llama reference code.
    """

    def __init__(self, dim: int, eps: float = 1e-5, device: Any = None, dtype: Any = None):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"


def upcast(x: torch.Tensor) -> torch.Tensor:
    """`x` in at least float32 (half precision computed in fp32; fp64 left as is)."""
    return x.float() if x.element_size() < 4 else x


def init_transformer_(module: nn.Module, std: float = INIT_STD,
                      residual_std: float | None = None) -> None:
    """GPT-2 style initialization, in place, in module order (deterministic under a seed).

    Linear and Embedding weights ~ N(0, std), biases zero, norm weights one (biases zero).
    Linear layers flagged with ``_ah_residual_proj = True`` (the projections that write
    into the residual stream) get ``residual_std`` instead when given (GPT-2's
    ``0.02 / sqrt(2 * layers)``). A tensor shared by several modules (tied embeddings) is
    initialized once, by the first module that owns it. Does nothing on the meta device.
    """
    if is_meta(module):
        return
    seen: set[int] = set()

    def fresh(t: torch.Tensor | None) -> bool:
        if t is None or id(t) in seen:
            return False
        seen.add(id(t))
        return True

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear):
                s = residual_std if (residual_std is not None
                                     and getattr(m, "_ah_residual_proj", False)) else std
                if fresh(m.weight):
                    m.weight.normal_(0.0, s)
                if fresh(m.bias):
                    m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                if fresh(m.weight):
                    m.weight.normal_(0.0, std)
            elif isinstance(m, (nn.LayerNorm, RMSNorm)):
                if fresh(getattr(m, "weight", None)):
                    m.weight.fill_(1.0)
                if fresh(getattr(m, "bias", None)):
                    m.bias.zero_()


def residual_std_for(layers: int, std: float = INIT_STD) -> float:
    """GPT-2's scaled init for residual projections: ``std / sqrt(2 * layers)``."""
    return std / math.sqrt(2 * max(layers, 1))


def format_config(config: dict[str, Any]) -> str:
    """``key=value, ...`` rendering of a config dict for ``extra_repr``."""
    return ", ".join(f"{k}={v}" for k, v in config.items())
