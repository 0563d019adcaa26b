"""AmoebaNet-like cell network (the DAPPLE AmoebaNet-36 benchmark shape).

Layout: a two-convolution stem (stride 4), then `num_stacks` stacks of `cells_per_stack` normal
cells; a reduction cell (stride 2, double the filters) sits between stacks. Every cell reads the
outputs of the two previous cells, so each value crosses one extra cell (a skip connection).
The cell wiring is modelled on the AmoebaNet-D genotype as used by GPipe/torchgpipe (1x1, 1x7-7x1,
pooling and identity branches, three concatenated outputs); operations are ReLU-conv-BN without
the bottlenecks of the original ops. AmoebaNet-36 = 3 stacks x 12 normal cells; `filters` = 304
was chosen so the parameter count lands on the ~933M quoted by DAPPLE (940.9M; about three
quarters of it sits in the last stack, where the filters are 4 x 304).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, class_cross_entropy, image_batch, make_entry

# (input state index, operation) pairs; node k = op(a) + op(b) of the k-th pair of pairs.
# States 0 and 1 are the two cell inputs; new nodes are numbered from 2.
NORMAL_OPS = (
    (1, "conv_1x1"), (1, "max_pool_3x3"),
    (1, "identity"), (0, "conv_1x7_7x1"),
    (0, "conv_1x1"), (0, "conv_1x7_7x1"),
    (2, "max_pool_3x3"), (2, "identity"),
    (1, "avg_pool_3x3"), (5, "conv_1x1"),
)
REDUCTION_OPS = (
    (0, "max_pool_3x3"), (0, "conv_3x3"),
    (1, "conv_1x7_7x1"), (1, "max_pool_3x3"),
    (2, "conv_1x7_7x1"), (3, "avg_pool_3x3"),
    (2, "conv_1x1"), (3, "identity"),
    (4, "conv_1x1"), (0, "avg_pool_3x3"),
)
# Nodes concatenated into the cell output; with these every node feeds the output.
NORMAL_CONCAT = (3, 4, 6)
REDUCTION_CONCAT = (4, 5, 6)
NUM_OUTPUTS = 3  # nodes per concat, so a cell outputs 3 x filters channels


@dataclass(frozen=True)
class AmoebaNetConfig:
    filters: int = 304  # channels per node in the first stack; doubles at each reduction cell
    num_stacks: int = 3
    cells_per_stack: int = 12  # normal cells per stack (AmoebaNet-36: 3 x 12)
    num_classes: int = 1000
    image_size: int = 224  # example / make_batch image side


def _relu_conv_bn(in_channels: int, out_channels: int, kernel: tuple[int, int], stride: tuple[int, int]) -> nn.Sequential:
    padding = (kernel[0] // 2, kernel[1] // 2)
    conv = nn.Conv2d(in_channels, out_channels, kernel, stride, padding, bias=False)
    return nn.Sequential(nn.ReLU(), conv, nn.BatchNorm2d(out_channels))


def make_op(name: str, channels: int, stride: int) -> nn.Module:
    """One cell operation on `channels` channels; stride 2 halves the spatial size."""
    if name == "conv_1x1":
        return _relu_conv_bn(channels, channels, (1, 1), (stride, stride))
    if name == "conv_3x3":
        return _relu_conv_bn(channels, channels, (3, 3), (stride, stride))
    if name == "conv_1x7_7x1":
        return nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(channels, channels, (1, 7), (1, stride), (0, 3), bias=False),
            nn.Conv2d(channels, channels, (7, 1), (stride, 1), (3, 0), bias=False),
            nn.BatchNorm2d(channels),
        )
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, stride, padding=1)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, stride, padding=1, count_include_pad=False)
    if name == "identity" and stride == 1:
        return nn.Identity()
    raise ValueError(f"unknown cell operation {name!r} with stride {stride}")


class Cell(nn.Module):
    """(s0 (B, c0, 2H or H, ...), s1 (B, c1, H, W)) -> (B, 3 filters, H/stride, W/stride)."""

    def __init__(self, c0: int, c1: int, filters: int, reduce_s0: bool, reduction: bool) -> None:
        super().__init__()
        self.preprocess0 = _relu_conv_bn(c0, filters, (1, 1), (2, 2) if reduce_s0 else (1, 1))
        self.preprocess1 = _relu_conv_bn(c1, filters, (1, 1), (1, 1))
        genotype = REDUCTION_OPS if reduction else NORMAL_OPS
        self.concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        self.inputs = tuple(index for index, _ in genotype)
        self.ops = nn.ModuleList(
            [make_op(name, filters, 2 if reduction and index < 2 else 1) for index, name in genotype]
        )

    def forward(self, s0: Tensor, s1: Tensor) -> Tensor:
        states = [self.preprocess0(s0), self.preprocess1(s1)]  # 2 x (B, F, H, W)
        for pair in range(len(self.ops) // 2):
            a, b = 2 * pair, 2 * pair + 1
            states.append(self.ops[a](states[self.inputs[a]]) + self.ops[b](states[self.inputs[b]]))
        return torch.cat([states[index] for index in self.concat], dim=1)  # (B, 3F, H', W')


class AmoebaNet(nn.Module):
    """images (B, 3, H, W) -> class logits (B, num_classes)."""

    def __init__(self, config: AmoebaNetConfig) -> None:
        super().__init__()
        self.config = config
        filters = config.filters
        self.stem = nn.Sequential(
            nn.Conv2d(3, filters, 3, 2, 1, bias=False), nn.BatchNorm2d(filters),
            nn.ReLU(), nn.Conv2d(filters, filters, 3, 2, 1, bias=False), nn.BatchNorm2d(filters),
        )
        cells: list[Cell] = []
        c0 = c1 = filters  # channels of the two previous outputs
        reduce_s0 = False  # whether s0 has twice the resolution of s1
        for stack in range(config.num_stacks):
            reduction = stack > 0
            for index in range(config.cells_per_stack + (1 if reduction else 0)):
                is_reduction = reduction and index == 0
                filters_here = config.filters * 2**stack
                cells.append(Cell(c0, c1, filters_here, reduce_s0, is_reduction))
                c0, c1, reduce_s0 = c1, NUM_OUTPUTS * filters_here, is_reduction
        self.cells = nn.ModuleList(cells)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(c1, config.num_classes)

    def forward(self, images: Tensor) -> Tensor:
        s0 = s1 = self.stem(images)  # (B, F, H/4, W/4)
        for cell in self.cells:
            s0, s1 = s1, cell(s0, s1)
        return self.classifier(self.pool(torch.relu(s1)).flatten(1))  # (B, num_classes)


def _batch(config: AmoebaNetConfig, batch_size: int, generator: torch.Generator) -> Batch:
    return image_batch(generator, config.image_size, config.num_classes, batch_size)


TINY = {"filters": 4, "cells_per_stack": 1, "num_classes": 10, "image_size": 32}

ENTRIES: tuple[ModelEntry, ...] = (
    make_entry("amoebanet-36", "AmoebaNet-like: 3 stacks x 12 normal cells + 2 reduction cells (DAPPLE)",
               model_cls=AmoebaNet, config=AmoebaNetConfig(), batch_fn=_batch,
               loss_fn=class_cross_entropy, paper_params=933_000_000, tiny_overrides=TINY),
)
