"""A model with a ResNet-18's worth of parameters (11,689,512) for wire benchmarks.

Only a tiny head is used in ``forward``; the rest is a parameter block that makes every pull
and push carry the bytes of a ResNet-18.
"""

from __future__ import annotations

import torch
from torch import nn

RESNET18_PARAMS = 11_689_512


class ParameterBlock(nn.Module):
    """Global average pooling and a linear head, plus padding parameters up to ``total``."""

    def __init__(self, in_channels: int, num_classes: int, total: int = RESNET18_PARAMS) -> None:
        super().__init__()
        self.head = nn.Linear(in_channels, num_classes)
        used = sum(p.numel() for p in self.head.parameters())
        self.block = nn.Parameter(torch.zeros(total - used))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.mean(dim=(2, 3)))


def factory(in_channels: int, num_classes: int, input_size: int) -> nn.Module:
    """The user-model factory signature: ``factory(in_channels=, num_classes=, input_size=)``."""
    return ParameterBlock(in_channels, num_classes)
