"""ResNet-50 (He et al. 2016) with bottleneck blocks, for ImageNet-sized inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, class_cross_entropy, image_batch, make_entry


@dataclass(frozen=True)
class ResNetConfig:
    stage_depths: tuple[int, ...] = (3, 4, 6, 3)  # bottleneck blocks per stage
    base_width: int = 64  # bottleneck width of the first stage; doubles per stage
    expansion: int = 4
    num_classes: int = 1000
    image_size: int = 224  # example / make_batch image side


def _conv_bn(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
             zero_init: bool = False) -> nn.Sequential:
    conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding=kernel_size // 2, bias=False)
    norm = nn.BatchNorm2d(out_channels)
    if zero_init:  # zero-init the last BN of a block: each block starts as the identity
        nn.init.zeros_(norm.weight)
    return nn.Sequential(conv, norm)


class Bottleneck(nn.Module):
    def __init__(self, in_channels: int, width: int, expansion: int, stride: int) -> None:
        super().__init__()
        out_channels = width * expansion
        self.reduce = _conv_bn(in_channels, width, 1)
        self.conv = _conv_bn(width, width, 3, stride)
        self.expand = _conv_bn(width, out_channels, 1, zero_init=True)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = _conv_bn(in_channels, out_channels, 1, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.reduce(x))  # (B, w, H, W)
        y = self.relu(self.conv(y))  # (B, w, H/s, W/s)
        return self.relu(self.expand(y) + self.shortcut(x))  # (B, 4w, H/s, W/s)


class ResNet(nn.Module):
    """images (B, 3, H, W) -> class logits (B, num_classes)."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        self.stem = nn.Sequential(_conv_bn(3, config.base_width, 7, 2), nn.ReLU(),
                                  nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        blocks: list[nn.Module] = []
        in_channels = config.base_width
        for stage, depth in enumerate(config.stage_depths):
            width = config.base_width * 2**stage
            for index in range(depth):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(Bottleneck(in_channels, width, config.expansion, stride))
                in_channels = width * config.expansion
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, config.num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images)  # (B, base, H/4, W/4)
        x = self.blocks(x)  # (B, 32 base, H/32, W/32)
        return self.fc(self.pool(x).flatten(1))  # (B, num_classes)


def _batch(config: ResNetConfig, batch_size: int, generator: torch.Generator) -> Batch:
    return image_batch(generator, config.image_size, config.num_classes, batch_size)


TINY = {"stage_depths": (1, 1, 1, 1), "base_width": 4, "num_classes": 10, "image_size": 32}

ENTRIES: tuple[ModelEntry, ...] = (
    make_entry("resnet-50", "ResNet-50 for 224x224 ImageNet (bottleneck blocks 3-4-6-3)",
               model_cls=ResNet, config=ResNetConfig(), batch_fn=_batch, loss_fn=class_cross_entropy,
               paper_params=25_600_000, tiny_overrides=TINY),
)
