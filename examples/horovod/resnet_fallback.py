"""``torchvision.models.resnet18`` and ``resnet50`` for machines without torchvision (this
project's own).

The same layers and shapes as torchvision's ResNet-18 (11.7 M parameters; the network
``benchmarks/torch_step.py`` times) and ResNet-50 (25.6 M), randomly initialised. The
synthetic benchmark beside this file imports it only when ``from torchvision import models``
fails.

>>> resnet18()(torch.randn(1, 3, 224, 224)).shape  # doctest: +SKIP
torch.Size([1, 1000])
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a shortcut (a 1x1 convolution where the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.bn1(self.conv1(x)).relu()))
        return (out + (x if self.downsample is None else self.downsample(x))).relu()


class Bottleneck(nn.Module):
    """1x1, 3x3 (with the stride), 1x1 to 4x the width, and a shortcut (ResNet-50's block,
    torchvision's v1.5: the stride on the 3x3)."""

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn1(self.conv1(x)).relu()
        out = self.bn2(self.conv2(out)).relu()
        out = self.bn3(self.conv3(out))
        return (out + (x if self.downsample is None else self.downsample(x))).relu()


def _resnet(blocks: list, num_classes: int) -> nn.Module:
    layers = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for block, width, stride, out in blocks:
        layers.append(block(cin, width, stride))
        cin = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def resnet18(num_classes: int = 1000) -> nn.Module:
    """ResNet-18 with torchvision's layer shapes."""
    blocks = []
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        blocks += [(BasicBlock, width, stride, width), (BasicBlock, width, 1, width)]
    return _resnet(blocks, num_classes)


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 with torchvision's layer shapes."""
    blocks = []
    for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        blocks += [(Bottleneck, width, stride if i == 0 else 1, 4 * width) for i in range(count)]
    return _resnet(blocks, num_classes)


def __getattr__(name: str):
    """A clear error for the other torchvision models (``--model resnet50`` and so on)."""
    raise AttributeError(
        f"torchvision is not installed, so only --model resnet18 or resnet50 runs here (built "
        f"in), not "
        f"{name!r}: install torchvision (the build matching your torch) for the others"
    )
