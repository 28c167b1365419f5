"""torchvision-like ResNet with BatchNorm2d (no torchvision import).

Depths: 8 (one BasicBlock per stage, a tiny test model), 18 and 34 (BasicBlock), 50, 101
and 152 (Bottleneck, expansion 4). ``width`` is the channel count of the first stage
(64 in torchvision); stages have ``width·[1, 2, 4, 8]`` channels (times the expansion).

Stem: torchvision's 7x7 stride-2 conv + 3x3 stride-2 max-pool, or, when
``small_inputs`` is true, a 3x3 stride-1 conv without max-pool (CIFAR-style, for 8x8 to
32x32 images). ``small_inputs=None`` means "true for depth < 18". Either way a global
average pool feeds the final Linear, so any input size >= 1 pixel after the stem works.

Initialization as torchvision: convs Kaiming-normal (fan_out, relu), BatchNorm weight
one / bias zero, the final Linear PyTorch's default; nothing on the meta device.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._common import build_on, factory_kwargs, format_config, is_meta

#: depth -> (block kind, blocks per stage)
RESNET_DEPTHS: dict[int, tuple[str, tuple[int, int, int, int]]] = {
    8: ("basic", (1, 1, 1, 1)),
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
}


def _conv3x3(cin: int, cout: int, stride: int, dd: dict[str, Any]) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False, **dd)


def _conv1x1(cin: int, cout: int, stride: int, dd: dict[str, Any]) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False, **dd)


class BasicBlock(nn.Module):
    """Two 3x3 convs with BatchNorm; identity or 1x1-conv shortcut."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, dd: dict[str, Any]):
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride, dd)
        self.bn1 = nn.BatchNorm2d(planes, **dd)
        self.conv2 = _conv3x3(planes, planes, 1, dd)
        self.bn2 = nn.BatchNorm2d(planes, **dd)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(_conv1x1(cin, planes, stride, dd),
                                            nn.BatchNorm2d(planes, **dd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as torchvision v1.5), 1x1 expand (x4)."""

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, dd: dict[str, Any]):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = _conv1x1(cin, planes, 1, dd)
        self.bn1 = nn.BatchNorm2d(planes, **dd)
        self.conv2 = _conv3x3(planes, planes, stride, dd)
        self.bn2 = nn.BatchNorm2d(planes, **dd)
        self.conv3 = _conv1x1(planes, cout, 1, dd)
        self.bn3 = nn.BatchNorm2d(cout, **dd)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv1x1(cin, cout, stride, dd),
                                            nn.BatchNorm2d(cout, **dd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Images ``(batch, in_channels, H, W)`` -> logits ``(batch, num_classes)``."""

    kind = "resnet"

    def __init__(self, depth: int = 50, width: int = 64, num_classes: int = 1000,
                 in_channels: int = 3, device: Any = None, dtype: torch.dtype | None = None,
                 small_inputs: bool | None = None):
        super().__init__()
        if depth not in RESNET_DEPTHS:
            raise ValueError(f"resnet: unsupported depth={depth}; "
                             f"supported: {sorted(RESNET_DEPTHS)}")
        small = depth < 18 if small_inputs is None else bool(small_inputs)
        self.config: dict[str, Any] = dict(depth=depth, width=width, num_classes=num_classes,
                                           in_channels=in_channels, small_inputs=small)
        kind, counts = RESNET_DEPTHS[depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        dd = factory_kwargs(device, dtype)
        with build_on(device):
            if small:
                self.conv1 = _conv3x3(in_channels, width, 1, dd)
                self.maxpool: nn.Module = nn.Identity()
            else:
                self.conv1 = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False,
                                       **dd)
                self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
            self.bn1 = nn.BatchNorm2d(width, **dd)
            self.relu = nn.ReLU()
            cin = width
            stages = []
            for i, n in enumerate(counts):
                planes = width * (2 ** i)
                blocks = []
                for j in range(n):
                    stride = 2 if (i > 0 and j == 0) else 1
                    blocks.append(block(cin, planes, stride, dd))
                    cin = planes * block.expansion
                stages.append(nn.Sequential(*blocks))
            self.layer1, self.layer2, self.layer3, self.layer4 = stages
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(cin, num_classes, **dd)
        self._init_weights()

    def _init_weights(self) -> None:
        if is_meta(self):
            return
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                elif isinstance(m, nn.BatchNorm2d):
                    m.weight.fill_(1.0)
                    m.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))

    def extra_repr(self) -> str:
        return format_config(self.config)


def resnet(depth: int = 50, width: int = 64, num_classes: int = 1000, in_channels: int = 3,
           device: Any = None, dtype: torch.dtype | None = None,
           small_inputs: bool | None = None) -> ResNet:
    """Build a :class:`ResNet` directly on ``device``/``dtype``.

    ``resnet(depth=8, width=8, num_classes=10)`` is the tiny test model (CIFAR stem);
    ``resnet(50)`` matches torchvision's ResNet-50 (25.6 M parameters).
    """
    return ResNet(depth, width, num_classes, in_channels, device=device, dtype=dtype,
                  small_inputs=small_inputs)
