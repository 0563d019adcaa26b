"""The front door's small print: parameter-less stages, forced layouts, keyword inputs, CLI errors and files."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.passes import trace
from fxpipe.passes.codegen import split_for_plan
from fxpipe.passes.partition import LayoutError
from fxpipe.planning import plan_model


class SkipMLP(nn.Module):
    """Eight Linear layers with long skips: block i also adds the output of block i - 3."""

    def __init__(self, width: int = 8, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [x]
        for index, layer in enumerate(self.layers):
            value = torch.relu(layer(outputs[-1]))
            if index >= 3:
                value = value + outputs[-3]
            outputs.append(value)
        return outputs[-1].sum(dim=-1) + outputs[1].mean(dim=-1)


class FourLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
                                    nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.layers(x) * 2.0, dim=-1).log()


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.rnn = cell(8, 8, batch_first=True)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(torch.relu(hidden))


def _stage_parameter_counts(model: nn.Module, example_inputs: tuple[Any, ...], layout: str | None) -> list[int]:
    plan = plan_model(model, example_inputs, cluster="local:4", global_batch_size=16, layout=layout)
    program = split_for_plan(trace(model, example_inputs), plan)
    return [sum(1 for _ in stage.module.parameters()) for stage in program.stages]


@pytest.mark.parametrize("model, example_inputs, layout", [
    (SkipMLP(), (torch.randn(4, 8),), "2:1:1"),
    (SkipMLP(), (torch.randn(4, 8),), "1:1:1:1"),
    (FourLinear(), (torch.randn(4, 4),), "1:1:1"),
    (FourLinear(), (torch.randn(4, 4),), "1:1:1:1"),
    (FourLinear(), (torch.randn(4, 4),), None),
])
def test_every_planned_stage_holds_parameters(model: nn.Module, example_inputs: tuple[Any, ...],
                                              layout: str | None) -> None:
    counts = _stage_parameter_counts(model, example_inputs, layout)
    assert all(count > 0 for count in counts), counts
    if layout is not None:
        assert len(counts) == len(layout.split(":"))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_forced_layout_deeper_than_the_model_fails_in_the_planner(cell: type[nn.RNNBase]) -> None:
    model = Recurrent(cell)
    with pytest.raises(LayoutError, match=r"has 4 stages but the model has only 3 cuttable block"):
        plan_model(model, (torch.randint(0, 16, (4, 5)),), cluster="local:4", global_batch_size=16,
                   layout="1:1:1:1")
    assert all(count > 0 for count in _stage_parameter_counts(model, (torch.randint(0, 16, (4, 5)),), "1:1:1"))



def test_parameter_groups_join_parameter_less_blocks_to_the_previous_group() -> None:
    from fxpipe.passes.block_partition import parameter_groups
    from fxpipe.passes.chain import SharedParam
    from tests.planner_cases import chain

    assert parameter_groups(chain([1.0] * 5, [0, 5, 0, 5, 0])) == [3, 5]
    assert parameter_groups(chain([1.0] * 3, [0, 0, 0])) == [1, 2, 3]  # no parameters: nothing to protect
    tied = chain([1.0] * 4, [5, 0, 0, 0])
    tied = type(tied)(tied.blocks, tied.cut_bytes, shared_params=(SharedParam("wte", 5, (0, 2)),))
    assert parameter_groups(tied) == [2, 4]  # block 2 reads a copy of the tied weight
