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

from ..init import INIT_RULE_ATTR, INIT_STD, TransformerRule  # INIT_STD: re-exported


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

    The rule is `autohybrid.init.TransformerRule(std, residual_std)`: Linear and Embedding
    weights ~ N(0, std), biases zero, norm weights one (biases zero); Linear layers
    flagged with ``_ah_residual_proj = True`` (the projections that write into the
    residual stream) get ``residual_std`` instead when given (GPT-2's
    ``0.02 / sqrt(2 * layers)``). The rule is recorded on ``module`` (``_ah_init_rule``),
    so ``autohybrid.init.materialize`` of a meta model draws the same distributions with
    its seeded, shardable values. A tensor shared by several modules (tied embeddings) is
    initialized once, by the first module that owns it. Draws nothing on the meta device.
    """
    rule = TransformerRule(std, residual_std)
    setattr(module, INIT_RULE_ATTR, rule)
    if is_meta(module):
        return
    seen: set[int] = set()
    with torch.no_grad():
        for mname, m in module.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                spec = rule(mname, m, pname, p)
                if spec is not None:
                    spec.draw_(p)


def residual_std_for(layers: int, std: float = INIT_STD) -> float:
    """GPT-2's scaled init for residual projections: ``std / sqrt(2 * layers)``."""
    return std / math.sqrt(2 * max(layers, 1))


def format_config(config: dict[str, Any]) -> str:
    """``key=value, ...`` rendering of a config dict for ``extra_repr``."""
    return ", ".join(f"{k}={v}" for k, v in config.items())
