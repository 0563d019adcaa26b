"""VGG-19 (Simonyan & Zisserman 2015, configuration E) for ImageNet-sized inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, class_cross_entropy, image_batch, make_entry

# Convolutions per stage for VGG-19; each stage ends with a 2x2 max-pool.
VGG19_STAGES = (2, 2, 4, 4, 4)


@dataclass(frozen=True)
class VGGConfig:
    stage_depths: tuple[int, ...] = VGG19_STAGES
    base_width: int = 64  # stage widths: base, 2 base, 4 base, 8 base, 8 base
    fc_width: int = 4096
    num_classes: int = 1000
    pool_size: int = 7  # adaptive average pool before the classifier (7 -> 25088 features)
    image_size: int = 224  # example / make_batch image side


def _stage_widths(config: VGGConfig) -> list[int]:
    return [config.base_width * min(2**index, 8) for index in range(len(config.stage_depths))]


class VGG(nn.Module):
    """images (B, 3, H, W) -> class logits (B, num_classes)."""

    def __init__(self, config: VGGConfig) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        in_channels = 3
        for depth, width in zip(config.stage_depths, _stage_widths(config), strict=True):
            for _ in range(depth):
                layers += [nn.Conv2d(in_channels, width, kernel_size=3, padding=1), nn.ReLU()]
                in_channels = width
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(config.pool_size)
        self.classifier = nn.Sequential(
            nn.Linear(in_channels * config.pool_size**2, config.fc_width),
            nn.ReLU(),
            nn.Linear(config.fc_width, config.fc_width),
            nn.ReLU(),
            nn.Linear(config.fc_width, config.num_classes),
        )
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
            if isinstance(module, nn.Conv2d | nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, images: Tensor) -> Tensor:
        x = self.features(images)  # (B, 8 base, H/32, W/32)
        x = self.avgpool(x).flatten(1)  # (B, 8 base * pool^2)
        return self.classifier(x)  # (B, num_classes)


def _batch(config: VGGConfig, batch_size: int, generator: torch.Generator) -> Batch:
    return image_batch(generator, config.image_size, config.num_classes, batch_size)


TINY = {"base_width": 4, "fc_width": 32, "num_classes": 10, "pool_size": 1, "image_size": 32}

ENTRIES: tuple[ModelEntry, ...] = (
    make_entry("vgg-19", "VGG-19 for 224x224 ImageNet, 16 conv + 3 fully connected layers",
               model_cls=VGG, config=VGGConfig(), batch_fn=_batch, loss_fn=class_cross_entropy,
               paper_params=137_000_000, tiny_overrides=TINY),
)
