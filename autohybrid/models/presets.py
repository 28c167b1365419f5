"""Named model sizes (``PRESETS``), ``preset(name)`` and ``example_batch(name, batch)``.

GPT-3 sizes follow the GPT-3 paper's table (with 16 heads for 1.3B, head dim 128), with
Megatron's padded vocabulary 51200 and sequence 2048; ``gpt-22b``, ``gpt-530b`` and
``gpt-1t`` are the Korthikanti et al. (MLSys'23) models; Llama 3 sizes follow Meta's
model cards (vocab 128256, seq 8192, rope_theta 500000). The ``*-tiny`` presets are the
test sizes. Every preset builds on ``device="meta"`` without allocating memory.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..errors import ModelError
from .cnn import cosmoflow, vgg
from .gpt import gpt
from .llama import llama
from .mlp import mlp
from .moe import moe
from .resnet import resnet

#: model kind -> factory
FACTORIES: dict[str, Callable[..., nn.Module]] = {
    "gpt": gpt, "llama": llama, "mlp": mlp, "resnet": resnet, "vgg": vgg,
    "cosmoflow": cosmoflow, "moe": moe,
}


@dataclass(frozen=True)
class ModelConfig:
    """A named model size: which factory (``kind``) and with which ``kwargs``.

    ``image_size`` is the default example image side for resnets (ignored otherwise).
    """

    name: str
    kind: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    image_size: int | None = None

    def build(self, device: Any = None, dtype: torch.dtype | None = None,
              **overrides: Any) -> nn.Module:
        """Build the model on ``device``/``dtype``; ``overrides`` replace kwargs."""
        return build(self.kind, {**self.kwargs, **overrides}, device=device, dtype=dtype)


def build(kind: str, config: dict[str, Any], device: Any = None,
          dtype: torch.dtype | None = None) -> nn.Module:
    """Rebuild a model from its ``kind`` and ``config`` (e.g. ``model.kind, model.config``)."""
    if kind not in FACTORIES:
        raise ModelError(f"unknown model kind {kind!r}; known kinds: {sorted(FACTORIES)}")
    return FACTORIES[kind](**config, device=device, dtype=dtype)


def _gpt3(name: str, layers: int, hidden: int, heads: int, desc: str) -> ModelConfig:
    return ModelConfig(name, "gpt", dict(layers=layers, hidden=hidden, heads=heads,
                                         vocab=51200, seq=2048), desc)


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelConfig:
    return ModelConfig(name, "llama", dict(layers=layers, hidden=hidden, heads=heads,
                                           kv_heads=8, vocab=128256, seq=8192,
                                           ffn_hidden=ffn, rope_theta=500000.0),
                       f"Llama 3 {name.split('-')[1].upper()}")


def _mixtral(name: str, layers: int, hidden: int, heads: int, experts: int, top_k: int,
             ffn: int) -> ModelConfig:
    return ModelConfig(name, "moe", dict(layers=layers, hidden=hidden, heads=heads, kv_heads=8,
                                         vocab=32000 if "8x7b" in name else 32768,
                                         seq=4096, experts=experts, top_k=top_k,
                                         expert_hidden=ffn, rope_theta=1e6,
                                         aux_loss_coef=0.02),
                       f"Mixtral {name.split('-')[1].upper()} (Mistral AI's model card)")


_ALL: list[ModelConfig] = [
    _gpt3("gpt3-125m", 12, 768, 12, "GPT-3 Small"),
    _gpt3("gpt3-350m", 24, 1024, 16, "GPT-3 Medium"),
    _gpt3("gpt3-760m", 24, 1536, 16, "GPT-3 Large"),
    _gpt3("gpt3-1.3b", 24, 2048, 16, "GPT-3 XL"),
    _gpt3("gpt3-2.7b", 32, 2560, 32, "GPT-3 2.7B"),
    _gpt3("gpt3-6.7b", 32, 4096, 32, "GPT-3 6.7B"),
    _gpt3("gpt3-13b", 40, 5120, 40, "GPT-3 13B"),
    _gpt3("gpt3-175b", 96, 12288, 96, "GPT-3 175B (Korthikanti et al.: V=51200, s=2048)"),
    _gpt3("gpt-22b", 48, 6144, 64, "Korthikanti et al. 22B"),
    _gpt3("gpt-530b", 105, 20480, 128, "Korthikanti et al. 530B (MT-NLG size)"),
    _gpt3("gpt-1t", 128, 25600, 160, "Korthikanti et al. 1T"),
    _llama3("llama3-8b", 32, 4096, 32, 14336),
    _llama3("llama3-70b", 80, 8192, 64, 28672),
    _llama3("llama3-405b", 126, 16384, 128, 53248),
    ModelConfig("resnet50", "resnet", dict(depth=50, width=64, num_classes=1000,
                                           in_channels=3), "ResNet-50 (ImageNet)", 224),
    ModelConfig("vgg16", "vgg", dict(depth=16, num_classes=1000, in_channels=3,
                                     image_size=224), "VGG-16 (ImageNet)", 224),
    ModelConfig("cosmoflow", "cosmoflow", dict(image_size=128),
                "CosmoFlow-style 3-D CNN on 4x128^3 volumes", 128),
    ModelConfig("cosmoflow-tiny", "cosmoflow", dict(channels=[4, 8], image_size=16,
                                                    hidden=16),
                "tiny 3-D CNN (two Conv3d stages) on 4x16^3 volumes, for tests", 16),
    ModelConfig("gpt-tiny", "gpt", dict(layers=2, hidden=32, heads=4, vocab=96, seq=16),
                "tiny GPT for tests"),
    ModelConfig("llama-tiny", "llama", dict(layers=2, hidden=32, heads=4, kv_heads=2,
                                            vocab=96, seq=16, ffn_hidden=64),
                "tiny Llama (GQA 4:2) for tests"),
    ModelConfig("moe-tiny", "moe", dict(layers=2, hidden=32, heads=4, kv_heads=2, vocab=96,
                                        seq=16, experts=4, top_k=2, expert_hidden=24,
                                        shared=1, aux_loss_coef=0.01),
                "tiny MoE (4 experts, top-2, one shared, balance loss) for tests"),
    _mixtral("mixtral-8x7b", 32, 4096, 32, 8, 2, 14336),
    _mixtral("mixtral-8x22b", 56, 6144, 48, 8, 2, 16384),
    ModelConfig("deepseek-v3-style", "moe", dict(
        layers=61, hidden=7168, heads=128, kv_heads=128, vocab=129280, seq=4096,
        experts=256, top_k=8, expert_hidden=2048, shared=1, score="sigmoid",
        routed_scale=2.5, dense_layers=3, ffn_hidden=18432, aux_loss_coef=0.0001,
        rope_theta=10000.0),
        "DeepSeek-V3's expert layout (256 routed experts of 2048, top-8 by sigmoid "
        "score, one shared, three dense layers of 18432) with GQA attention, not MLA"),
    ModelConfig("mlp-tiny", "mlp", dict(in_features=16, hidden=32, out_features=8),
                "tiny MLP for tests"),
    ModelConfig("resnet-tiny", "resnet", dict(depth=8, width=8, num_classes=10,
                                              in_channels=3),
                "tiny ResNet (one BasicBlock per stage, CIFAR stem) for 8x8/16x16 images", 16),
]

#: preset name -> ModelConfig
PRESETS: dict[str, ModelConfig] = {c.name: c for c in _ALL}


def get_preset(name: str) -> ModelConfig:
    """The :class:`ModelConfig` called ``name`` (case-insensitive; ``_`` may stand for ``-``).

    Raises ``ModelError`` (a ``ValueError``) naming the closest matches and listing every known preset.
    """
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else name
    if key in PRESETS:
        return PRESETS[key]
    close = difflib.get_close_matches(str(key), list(PRESETS), n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ModelError(f"unknown model preset {name!r}.{hint} "
                     f"Known presets: {', '.join(PRESETS)}.")


def preset(name: str, device: Any = None, dtype: torch.dtype | None = None,
           **overrides: Any) -> nn.Module:
    """Build the preset ``name`` on ``device``/``dtype``; ``overrides`` replace its kwargs
    (e.g. ``preset("gpt3-1.3b", device="meta", seq=4096)``)."""
    return get_preset(name).build(device=device, dtype=dtype, **overrides)


def example_batch(name: str | nn.Module, batch: int, seq: int | None = None, seed: int = 0,
                  device: Any = None, dtype: torch.dtype | None = None,
                  image_size: int | None = None) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``(inputs, targets)`` for a preset name or a zoo model, drawn from ``seed``.

    gpt/llama/moe: ids ``(batch, seq)`` and the next-token targets ``(batch, seq)`` (``seq``
    defaults to the model's). mlp: features ``(batch, in_features)`` and class targets in
    ``[0, out_features)``. resnet: images ``(batch, C, S, S)`` (``S`` = ``image_size``,
    the preset's, else 32 or 224) and class targets; vgg / cosmoflow: images / volumes
    of the model's image_size and class targets (cosmoflow: of its `outputs`). Float
    inputs use ``dtype`` (default
    float32). Tensors are generated on the CPU, then moved to ``device`` (meta works).
    """
    if isinstance(name, nn.Module):
        kind = getattr(name, "kind", None)
        cfg = dict(getattr(name, "config", {}))
        if kind not in FACTORIES:
            raise ModelError(f"example_batch: {type(name).__name__} is not a zoo model "
                             f"(no .kind in {sorted(FACTORIES)})")
        default_image = None
    else:
        pc = get_preset(name)
        kind, cfg, default_image = pc.kind, dict(pc.kwargs), pc.image_size
    g = torch.Generator().manual_seed(seed)
    fdt = dtype or torch.float32
    if kind in ("gpt", "llama", "moe"):
        s = int(seq if seq is not None else cfg["seq"])
        ids = torch.randint(0, cfg["vocab"], (batch, s + 1), generator=g)
        inputs: tuple[torch.Tensor, ...] = (ids[:, :-1].contiguous(),)
        targets = ids[:, 1:].contiguous()
    elif kind == "mlp":
        inputs = (torch.randn(batch, cfg["in_features"], generator=g).to(fdt),)
        targets = torch.randint(0, cfg["out_features"], (batch,), generator=g)
    elif kind in ("vgg", "cosmoflow"):  # images / volumes of the config's size
        side = cfg.get("image_size") or image_size or default_image or 224
        dims = 3 if kind == "cosmoflow" else 2
        chans = cfg.get("in_channels", 4 if kind == "cosmoflow" else 3)
        inputs = (torch.randn(batch, chans, *[side] * dims, generator=g).to(fdt),)
        classes = cfg.get("outputs", 4) if kind == "cosmoflow" else cfg.get("num_classes", 1000)
        targets = torch.randint(0, classes, (batch,), generator=g)
    else:  # resnet
        small = cfg.get("small_inputs")
        small = cfg.get("depth", 50) < 18 if small is None else small
        side = image_size or default_image or (32 if small else 224)
        chans = cfg.get("in_channels", 3)
        inputs = (torch.randn(batch, chans, side, side, generator=g).to(fdt),)
        targets = torch.randint(0, cfg.get("num_classes", 1000), (batch,), generator=g)
    if device is not None:
        inputs = tuple(t.to(device) for t in inputs)
        targets = targets.to(device)
    return inputs, targets
