"""Small multilayer perceptron (Linear + GELU layers) regressed with mean squared error."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, make_entry, mean_squared_error


@dataclass(frozen=True)
class MLPConfig:
    in_features: int = 32
    hidden_features: int = 64
    out_features: int = 8
    num_layers: int = 4  # Linear layers, including the output layer


class MLP(nn.Module):
    """x (B, in_features) -> y (B, out_features)."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        if config.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {config.num_layers}")
        widths = [config.in_features] + [config.hidden_features] * (config.num_layers - 1)
        layers: list[nn.Module] = []
        for in_width, out_width in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(in_width, out_width), nn.GELU()]
        layers.append(nn.Linear(widths[-1], config.out_features))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)  # (B, out_features)


def _batch(config: MLPConfig, batch_size: int, generator: torch.Generator) -> Batch:
    inputs = torch.randn(batch_size, config.in_features, generator=generator)
    targets = torch.randn(batch_size, config.out_features, generator=generator)
    return (inputs,), targets


ENTRIES: tuple[ModelEntry, ...] = (
    make_entry("mlp", "4-layer Linear+GELU perceptron with MSE loss (test model)", model_cls=MLP,
               config=MLPConfig(), batch_fn=_batch, loss_fn=mean_squared_error,
               tiny_overrides={"in_features": 8, "hidden_features": 16, "out_features": 4}),
)
