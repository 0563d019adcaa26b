"""Tests for extract_subgraph: inputs/outputs, shared parameters, pass-through, errors."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from fxpipe.passes.subgraph import SubgraphError, extract_subgraph

torch.set_num_threads(1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        y = self.fc2(h) * self.scale
        return y + x


def _traced() -> fx.GraphModule:
    torch.manual_seed(0)
    return fx.symbolic_trace(Net())


def _names(gm: fx.GraphModule) -> list[str]:
    return [node.name for node in gm.graph.nodes]


def test_two_halves_chain_to_the_full_output() -> None:
    gm = _traced()
    assert _names(gm) == ["x", "fc1", "relu", "fc2", "scale", "mul", "add", "output"]
    first = extract_subgraph(gm, ["fc1", "relu"])
    second = extract_subgraph(gm, ["fc2", "scale", "mul", "add"])
    assert first.input_names == ("x",) and first.output_names == ("relu",)
    assert second.input_names == ("x", "relu") and second.output_names == ("add",)
    x = torch.randn(3, 4)
    (relu,) = first.module(x)
    (out,) = second.module(x, relu)
    torch.testing.assert_close(out, gm(x), rtol=0, atol=0)
    # Parameters are shared under the original attribute paths and appear in readable code.
    assert second.module.fc2.weight is gm.fc2.weight and second.module.scale is gm.scale
    assert "def forward(self, x, relu)" in second.module.code
    assert not hasattr(second.module, "fc1")
    assert "fc1" not in dict(second.module.named_parameters()) and gm.fc1.weight is first.module.fc1.weight


def test_explicit_inputs_outputs_pass_through_and_renamed_attribute() -> None:
    gm = _traced()
    sub = extract_subgraph(
        gm,
        ["fc2", "scale", "mul"],
        inputs=["relu", "x"],
        outputs=["x", "mul"],
        attribute_names={"scale": "head.scale"},
    )
    assert sub.input_names == ("relu", "x") and sub.output_names == ("x", "mul")
    assert sub.module.get_parameter("head.scale") is gm.scale
    h = torch.randn(2, 8)
    x = torch.randn(2, 4)
    passed, mul = sub.module(h, x)
    assert passed is x
    torch.testing.assert_close(mul, gm.fc2(h) * gm.scale)


def test_input_graph_is_not_modified() -> None:
    gm = _traced()
    before = gm.code
    extract_subgraph(gm, ["fc2"], attribute_names={"fc2": "other"})
    assert gm.code == before and _names(gm)[-1] == "output"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"node_names": ["nope"]}, "nope"),
        ({"node_names": ["output"]}, "output node"),
        ({"node_names": ["fc2"], "inputs": ["x"]}, "relu"),
        ({"node_names": ["fc2"], "outputs": ["mul"]}, "mul"),
        ({"node_names": ["fc2"], "inputs": ["relu", "relu"]}, "distinct"),
    ],
)
def test_errors_name_the_bad_value(kwargs: dict, message: str) -> None:
    with pytest.raises(SubgraphError, match=message):
        extract_subgraph(_traced(), **kwargs)
