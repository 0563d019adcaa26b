"""Stages whose first op writes into a received activation (torchvision's ReLU(inplace=True), ``out += identity``):
which inputs are copied, and 2-rank training cut right there equals one process (gloo, CPU)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import fx, nn

import fxpipe
from fxpipe.passes import trace
from fxpipe.runtime.autograd.inplace import inputs_changed_in_place
from tests.exactness_oracle import mismatches
from tests.mp_utils import compute_nodes, join_world, leave_world, plan_from_cuts, run_ranks
from tests.test_measured_inplace import MobileNetV3Style, ResNetStyle


def _graph(body: Any) -> fx.GraphModule:
    return fx.symbolic_trace(body)


class _Writes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.plain = nn.ReLU()

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
                e: torch.Tensor) -> torch.Tensor:
        a += 1  # torch.fx records an out-of-place add (proxies have no __iadd__): nothing to copy
        self.act(b)  # a module in place
        c.view(-1).mul_(2)  # a method in place, through a view
        torch.relu_(d)  # a function in place
        return a + b + c + d + self.plain(e)  # e is only read


def test_inputs_written_in_place_are_found_and_read_only_ones_are_not() -> None:
    assert inputs_changed_in_place(_graph(_Writes())) == {"b", "c", "d"}
    graph = _graph(lambda x, y: torch.nn.functional.relu(x, inplace=True) + y)
    assert inputs_changed_in_place(graph) == {"x"}


def _cut_before(model: nn.Module, example: tuple[torch.Tensor, ...], node_name: str) -> fxpipe.Plan:
    names = compute_nodes(trace(copy.deepcopy(model), example))
    return plan_from_cuts(trace(copy.deepcopy(model), example), (1, 1), 4, 1,
                          fractions=[names.index(node_name) / len(names)])


# (model, the node the second stage starts with, train mode): each writes into the activation it receives
# (MobileNetV3's in-place dropout draws other random numbers on another rank, so that case runs in eval mode)
CASES = [(ResNetStyle, "relu", True), (ResNetStyle, "layer1_0_relu_1", True),
         (MobileNetV3Style, "classifier_1", False)]


def _train(rank: int, world_size: int, store_dir: str) -> list[dict[str, Any]]:
    records = []
    for index, (model_cls, node_name, training) in enumerate(CASES):
        torch.manual_seed(0)
        model = model_cls().train(training)
        reference = copy.deepcopy(model)
        images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        plan = _cut_before(model, (images,), node_name)
        join_world(store_dir, f"inplace-{index}", rank, world_size)
        try:
            pipe = fxpipe.compile(model, (images,), loss_fn=nn.functional.cross_entropy, global_batch_size=4,
                                  plan=plan)
            loss = pipe.step(images, labels)
            grads = {name: param.grad for name, param in pipe.named_parameters()}
            first = pipe.program.stages[1].module
        finally:
            leave_world()
        expected = nn.functional.cross_entropy(reference(images), labels)
        expected.backward()
        reference_grads = {name: param.grad for name, param in reference.named_parameters()}
        records.append({"case": f"{model_cls.__name__} at {node_name}", "loss": loss, "expected": expected.item(),
                        "problems": mismatches("grad", grads, reference_grads, rtol=1e-4, atol=1e-6),
                        "copied": sorted(inputs_changed_in_place(first))})
    return records


@pytest.mark.multiprocess
def test_stages_that_write_into_received_activations_train_exactly(tmp_path: Any) -> None:
    for rank, records in enumerate(run_ranks(_train, 2, tmp_path)):
        for record in records:
            assert record["copied"], (rank, record)  # the cut really falls before an in-place op
            assert record["loss"] == pytest.approx(record["expected"], rel=1e-5), (rank, record)
            assert not record["problems"], (rank, record)
