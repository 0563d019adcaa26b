"""Measured costs for models with in-place ops (torchvision ResNet and MobileNetV3 style): measured, not analytic."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from fxpipe.core.cluster import parse_cluster
from fxpipe.job_costs import job_costs
from fxpipe.planning import COSTS_ENV, plan_model

BATCH = 8
FALLBACK = "measuring block costs failed"


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: one shared ReLU(inplace=True), ``out += identity``."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride, bias=False),
                                            nn.BatchNorm2d(channels))

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNetStyle(nn.Module):
    """torchvision's ResNet layout (stem conv1/bn1/relu/maxpool as top-level modules), two stages of basic blocks."""

    def __init__(self, width: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _conv_bn_act(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1,
                 activation: type[nn.Module] | None = nn.Hardswish) -> nn.Sequential:
    """torchvision's Conv2dNormActivation: its activation is in place."""
    layers: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, kernel_size, stride, kernel_size // 2,
                                         groups=groups, bias=False), nn.BatchNorm2d(out_channels)]
    if activation is not None:
        layers.append(activation(inplace=True))
    return nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeezed, 1)
        self.fc2 = nn.Conv2d(squeezed, channels, 1)
        self.activation = nn.ReLU(inplace=True)
        self.scale_activation = nn.Hardsigmoid(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class InvertedResidual(nn.Module):
    """MobileNetV3's block: expand, depthwise, squeeze-excite, project, ``result += input``."""

    def __init__(self, channels: int, expanded: int) -> None:
        super().__init__()
        self.block = nn.Sequential(_conv_bn_act(channels, expanded, 1),
                                   _conv_bn_act(expanded, expanded, 3, groups=expanded),
                                   SqueezeExcite(expanded, expanded // 4),
                                   _conv_bn_act(expanded, channels, 1, activation=None))

    def forward(self, x: Tensor) -> Tensor:
        result = self.block(x)
        result += x
        return result


class MobileNetV3Style(nn.Module):
    """torchvision's MobileNetV3 layout: features, avgpool, classifier with Hardswish and Dropout in place."""

    def __init__(self, width: int = 8, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(_conv_bn_act(3, width, 3, stride=2), InvertedResidual(width, 4 * width),
                                      InvertedResidual(width, 4 * width), _conv_bn_act(width, 6 * width, 1))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(6 * width, 32), nn.Hardswish(inplace=True),
                                        nn.Dropout(p=0.2, inplace=True), nn.Linear(32, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class RankOneCholesky(nn.Module):
    """A genuine failure: each row's rank-one outer product is not positive-definite, which only real values show."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        return torch.linalg.cholesky(h.unsqueeze(-1) @ h.unsqueeze(-2)).sum(-1)


def _built(model_cls: type[nn.Module]) -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    return model_cls(), (torch.randn(4, 3, 16, 16),)


# Per model, blocks whose first node works in place on the block's input (the stem's ReLU; the classifier's
# Hardswish and Dropout): the blocks that made measuring fail before.
IN_PLACE_FIRST = {ResNetStyle: {"relu"}, MobileNetV3Style: {"classifier_1", "classifier_2"}}


@pytest.mark.parametrize("model_cls", [ResNetStyle, MobileNetV3Style])
def test_models_with_in_place_ops_are_measured_without_falling_back(
        model_cls: type[nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COSTS_ENV, raising=False)
    model, example_inputs = _built(model_cls)
    local = parse_cluster("local:2", calibrate=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        costs = job_costs("auto", True, model, example_inputs, local, None)  # what fxpipe.compile plans with
        plan = plan_model(model, example_inputs, cluster=local, global_batch_size=BATCH, layout="dp")
    assert not [str(w.message) for w in caught if FALLBACK in str(w.message)]
    assert costs.source == "measured" and costs.measured is not None
    assert plan.predicted is not None and plan.predicted.cost_source == "measured"
    assert IN_PLACE_FIRST[model_cls] <= {block.node_names[0] for block in costs.measured.blocks}
    assert all(block.forward_s.at(BATCH) > 0 for block in costs.measured.blocks)


def test_measuring_leaves_the_inputs_of_in_place_blocks_as_they_were() -> None:
    from fxpipe.passes.profile import run_once

    block = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4))
    leaf = torch.tensor([[-1.0, 2.0, -3.0, 4.0]], requires_grad=True)
    forward_s, backward_s = run_once(block, [leaf])
    assert forward_s >= 0 and backward_s >= 0
    assert torch.equal(leaf.detach(), torch.tensor([[-1.0, 2.0, -3.0, 4.0]]))  # not rectified in place
    assert leaf.grad is not None and leaf.grad[0, 0] == 0 and leaf.grad[0, 1] != 0  # the gradient reaches it


def test_a_model_that_fails_to_measure_still_falls_back_with_the_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COSTS_ENV, raising=False)
    torch.manual_seed(0)
    model, example_inputs = RankOneCholesky(), (torch.randn(4, 8),)
    with pytest.warns(RuntimeWarning, match=f"(?s){FALLBACK} .*positive-definite.*analytic device model"):
        costs = job_costs("auto", True, model, example_inputs, parse_cluster("local:2", calibrate=False), None)
    assert costs.source == "analytic" and costs.measured is None
