"""Plain CNNs for the ParaDL oracle: VGG (Simonyan & Zisserman 2015) and a CosmoFlow-style
3-D CNN (Mathuriya et al., SC'18: Conv3d + pooling stages on 4-channel volumes, a few
dense layers, 4 regression outputs). Both build on ``device="meta"`` without allocating.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._common import build_on, factory_kwargs, format_config

#: VGG configurations: output channels per conv, "M" a 2x2 max pool
VGG_CONFIGS = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
         512, 512, 512, "M"],
}


class VGG(nn.Module):
    """Images ``(batch, in_channels, S, S)`` (S divisible by 32) -> ``(batch, classes)``."""

    kind = "vgg"

    def __init__(self, depth: int = 16, num_classes: int = 1000, in_channels: int = 3,
                 image_size: int = 224, hidden: int = 4096, device: Any = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        if depth not in VGG_CONFIGS:
            raise ValueError(f"vgg: unsupported depth={depth}; supported: {sorted(VGG_CONFIGS)}")
        if image_size % 32:
            raise ValueError(f"vgg: image_size={image_size} must be divisible by 32")
        self.config: dict[str, Any] = dict(depth=depth, num_classes=num_classes,
                                           in_channels=in_channels, image_size=image_size,
                                           hidden=hidden)
        dd = factory_kwargs(device, dtype)
        with build_on(device):
            layers: list[nn.Module] = []
            cin = in_channels
            for v in VGG_CONFIGS[depth]:
                if v == "M":
                    layers.append(nn.MaxPool2d(2))
                else:
                    layers += [nn.Conv2d(cin, int(v), 3, padding=1, **dd), nn.ReLU()]
                    cin = int(v)
            self.features = nn.Sequential(*layers)
            side = image_size // 32
            self.classifier = nn.Sequential(
                nn.Linear(cin * side * side, hidden, **dd), nn.ReLU(),
                nn.Linear(hidden, hidden, **dd), nn.ReLU(), nn.Linear(hidden, num_classes, **dd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))

    def extra_repr(self) -> str:
        return format_config(self.config)


class CosmoFlow(nn.Module):
    """Volumes ``(batch, in_channels, S, S, S)`` -> 4 cosmological parameters."""

    kind = "cosmoflow"

    def __init__(self, channels: tuple[int, ...] | list[int] = (16, 32, 64, 64, 64),
                 in_channels: int = 4, image_size: int = 128, hidden: int = 128,
                 outputs: int = 4, device: Any = None, dtype: torch.dtype | None = None):
        super().__init__()
        channels = [int(c) for c in channels]
        if image_size % (2 ** len(channels)):
            raise ValueError(f"cosmoflow: image_size={image_size} must be divisible by "
                             f"2**{len(channels)} (one 2x pool per conv stage)")
        self.config: dict[str, Any] = dict(channels=channels, in_channels=in_channels,
                                           image_size=image_size, hidden=hidden,
                                           outputs=outputs)
        dd = factory_kwargs(device, dtype)
        with build_on(device):
            layers: list[nn.Module] = []
            cin = in_channels
            for c in channels:
                layers += [nn.Conv3d(cin, c, 3, padding=1, **dd), nn.LeakyReLU(0.3),
                           nn.MaxPool3d(2)]
                cin = c
            self.features = nn.Sequential(*layers)
            side = image_size // 2 ** len(channels)
            self.head = nn.Sequential(nn.Linear(cin * side ** 3, hidden, **dd), nn.LeakyReLU(0.3),
                                      nn.Linear(hidden, hidden // 2, **dd), nn.LeakyReLU(0.3),
                                      nn.Linear(hidden // 2, outputs, **dd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))

    def extra_repr(self) -> str:
        return format_config(self.config)


def vgg(depth: int = 16, num_classes: int = 1000, in_channels: int = 3, image_size: int = 224,
        hidden: int = 4096, device: Any = None, dtype: torch.dtype | None = None) -> VGG:
    """``vgg(16)`` is VGG-16 (138 M parameters at 224x224)."""
    return VGG(depth, num_classes, in_channels, image_size, hidden, device=device, dtype=dtype)


def cosmoflow(channels: tuple[int, ...] | list[int] = (16, 32, 64, 64, 64), in_channels: int = 4,
              image_size: int = 128, hidden: int = 128, outputs: int = 4, device: Any = None,
              dtype: torch.dtype | None = None) -> CosmoFlow:
    """A CosmoFlow-style 3-D CNN (``cosmoflow(image_size=16, channels=(4, 8))``: tiny)."""
    return CosmoFlow(channels, in_channels, image_size, hidden, outputs, device=device,
                     dtype=dtype)
