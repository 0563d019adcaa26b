"""MLP with long skip connections: early-layer outputs are added many layers later (test model).

Layer i (i >= skip_distance) adds the output of layer i - skip_distance to its own output, and
the raw input is projected and added to the final output, so in any pipeline split some values
cross several stages at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, make_entry, mean_squared_error


@dataclass(frozen=True)
class SkipNetConfig:
    in_features: int = 16
    width: int = 32
    out_features: int = 4
    num_layers: int = 8
    skip_distance: int = 4  # output of layer i feeds layer i + skip_distance as well


class SkipNet(nn.Module):
    """x (B, in_features) -> y (B, out_features)."""

    def __init__(self, config: SkipNetConfig) -> None:
        super().__init__()
        if not 1 <= config.skip_distance <= config.num_layers:
            raise ValueError(
                f"skip_distance must be in [1, num_layers={config.num_layers}], got {config.skip_distance}"
            )
        self.skip_distance = config.skip_distance
        self.input = nn.Linear(config.in_features, config.width)
        self.layers = nn.ModuleList([nn.Linear(config.width, config.width) for _ in range(config.num_layers)])
        self.act = nn.GELU()
        self.input_skip = nn.Linear(config.in_features, config.out_features)
        self.head = nn.Linear(config.width, config.out_features)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.input(x))  # (B, width)
        outputs: list[Tensor] = []
        for index, layer in enumerate(self.layers):
            h = self.act(layer(h))  # (B, width)
            if index >= self.skip_distance:  # static structure, not data dependent
                h = h + outputs[index - self.skip_distance]
            outputs.append(h)
        return self.head(h) + self.input_skip(x)  # (B, out_features)


def _batch(config: SkipNetConfig, batch_size: int, generator: torch.Generator) -> Batch:
    inputs = torch.randn(batch_size, config.in_features, generator=generator)
    targets = torch.randn(batch_size, config.out_features, generator=generator)
    return (inputs,), targets


ENTRIES: tuple[ModelEntry, ...] = (
    make_entry("skipnet", "8-layer MLP whose layers also add the output of the layer 4 before (test model)",
               model_cls=SkipNet, config=SkipNetConfig(), batch_fn=_batch, loss_fn=mean_squared_error,
               tiny_overrides={"in_features": 8, "width": 16, "num_layers": 6, "skip_distance": 3}),
)
