"""autohybrid's model zoo: GPT, Llama, MoE, MLP, ResNet, VGG and CosmoFlow factories plus presets.

Every factory takes ``device=`` and ``dtype=`` and builds directly there; on the meta
device nothing is allocated or initialized. Every model has a ``kind`` (``"gpt"``,
``"llama"``, ``"mlp"``, ``"resnet"``) and a ``config`` dict of its constructor kwargs, so
``build(model.kind, model.config)`` rebuilds it. Transformers are capturable by
``torch.export.export(..., strict=False)`` with dynamic batch and sequence dims.

>>> import autohybrid.models as zoo
>>> m = zoo.preset("gpt-tiny")
>>> (ids,), targets = zoo.example_batch("gpt-tiny", batch=2)
>>> m(ids).shape
torch.Size([2, 16, 96])
"""
from __future__ import annotations

from ._common import RMSNorm
from .cnn import VGG, CosmoFlow, cosmoflow, vgg
from .gpt import GPT, gpt
from .llama import Llama, llama, llama_ffn_hidden
from .mlp import MLP, mlp
from .moe import MoETransformer, moe, moe_loss
from .presets import FACTORIES, PRESETS, ModelConfig, build, example_batch, get_preset, preset
from .resnet import RESNET_DEPTHS, ResNet, resnet
from . import spec  # noqa: E402  (MODEL strings: presets and file.py:factory)

__all__ = [
    "CosmoFlow", "FACTORIES", "GPT", "VGG", "cosmoflow", "vgg", "Llama", "MLP", "ModelConfig", "PRESETS", "RESNET_DEPTHS", "RMSNorm",
    "ResNet", "build", "example_batch", "get_preset", "gpt", "llama", "llama_ffn_hidden",
    "mlp", "moe", "moe_loss", "MoETransformer", "preset", "resnet", "spec",
]
