"""``torchvision.models.resnet18`` for machines without torchvision (this project's own).

The same layers and shapes as torchvision's ResNet-18 (11.7 M parameters; the network
``benchmarks/torch_step.py`` times), randomly initialised. The synthetic benchmark beside
this file imports it only when ``from torchvision import models`` fails.

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


def resnet18(num_classes: int = 1000) -> nn.Module:
    """ResNet-18 with torchvision's layer shapes."""
    layers = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def __getattr__(name: str):
    """A clear error for the other torchvision models (``--model resnet50`` and so on)."""
    raise AttributeError(
        f"torchvision is not installed, so only --model resnet18 runs here (built in), not "
        f"{name!r}: install torchvision (the build matching your torch) for the others"
    )
