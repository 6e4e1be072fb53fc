"""Small backbones that train on 2 CPU cores: the demo/benchmark student and teachers.

- ``ConvNet``: blocks of conv3x3 -> norm -> ReLU -> avg-pool, then global average pooling; returns
  flat features ``[B, widths[-1]]`` (the calibration backbone: widths 64/128/256, GroupNorm).
- ``ResNetSmall``: a BatchNorm ResNet for 28-32 px inputs (CIFAR-style stem, basic blocks) with a
  linear classifier; ``forward_features`` gives the pooled features. Used as a teacher with
  BatchNorm statistics (distillation) and as a classifier.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(min(32, channels // 4) or 1, channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "instance":
        return nn.GroupNorm(channels, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be 'group', 'batch', 'instance' or 'none', got {kind!r}.")


class ConvNet(nn.Module):
    """conv3x3-norm-ReLU-avgpool blocks + global average pool -> ``[B, widths[-1]]`` features.

    Args:
        in_channels: image channels (1 for Fashion-MNIST).
        widths: output channels per block; the feature dim is ``widths[-1]``.
        norm: ``"group"`` (default, batch-size independent), ``"batch"``, ``"instance"`` or ``"none"``.
    """

    def __init__(self, in_channels: int = 1, widths: Sequence[int] = (64, 128, 256), norm: str = "group"):
        super().__init__()
        layers: list[nn.Module] = []
        c = in_channels
        for w in widths:
            layers += [nn.Conv2d(c, w, 3, padding=1, bias=norm == "none"), _norm(norm, w), nn.ReLU(inplace=True), nn.AvgPool2d(2)]
            c = w
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = c
        self.config = {"in_channels": in_channels, "widths": list(widths), "norm": norm}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.features(x)).flatten(1)


class _BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetSmall(nn.Module):
    """A BatchNorm ResNet for small images: stem conv3x3, one basic block per stage, linear head.

    Args:
        in_channels: image channels.
        num_classes: classifier outputs (0: no classifier, ``forward`` returns features).
        widths: channels per stage (each stage after the first halves the resolution).
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, widths: Sequence[int] = (32, 64, 128)):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True))
        stages, c = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(_BasicBlock(c, w, 1 if i == 0 else 2))
            c = w
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = c
        self.fc = nn.Linear(c, num_classes) if num_classes else nn.Identity()
        self.config = {"in_channels": in_channels, "num_classes": num_classes, "widths": list(widths)}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.stages(self.stem(x))).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.forward_features(x))


BACKBONES = {"convnet": ConvNet, "resnet_small": ResNetSmall}


def create_backbone(name: str, **kwargs) -> nn.Module:
    """Build a backbone from this module by name (``"convnet"``, ``"resnet_small"``)."""
    if name not in BACKBONES:
        raise ValueError(f"Unknown backbone {name!r}; choose one of {sorted(BACKBONES)}.")
    return BACKBONES[name](**kwargs)
