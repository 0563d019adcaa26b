"""A stage's traced device constants follow the device it runs on (fxpipe.runtime.execution.device_constants).

The CPU machine has no GPU, so the rewrite is checked from the CPU to the meta device: the same graph, traced
with CPU example inputs, fails on meta inputs until its constants are retargeted. On a GPU machine
tests/test_hf_models.py's world-of-one GPT-2 runs the real case (export's ``arange(device=cpu)`` on CUDA).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from fxpipe import hf_examples
from fxpipe.passes import trace
from fxpipe.runtime.execution.device_constants import retarget_device_constants


class _Positions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)


def _exported(model: nn.Module, *inputs: torch.Tensor) -> fx.GraphModule:
    return torch.export.export(model, inputs).module()  # type: ignore[return-value]


def _devices(gm: fx.GraphModule) -> list[torch.device]:
    found: list[torch.device] = []
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                fx.node.map_aggregate((node.args, node.kwargs),
                                      lambda value: found.append(value) if isinstance(value, torch.device) else None)
    return found


def test_a_cpu_traced_factory_runs_on_the_stage_device_after_the_rewrite() -> None:
    gm = _exported(_Positions(), torch.zeros(2, 5))
    assert torch.device("cpu") in _devices(gm)  # export baked the example input's device in
    meta_input = torch.zeros(2, 5, device="meta")
    with pytest.raises(RuntimeError):  # arange on the CPU meets a meta tensor, as on a GPU it meets a CUDA one
        gm(meta_input)
    assert retarget_device_constants(gm, torch.device("meta"), from_types=("cpu",)) >= 1
    assert set(_devices(gm)) == {torch.device("meta")}
    assert gm(meta_input).device.type == "meta"


def test_a_stage_on_its_trace_device_is_left_alone() -> None:
    gm = _exported(_Positions(), torch.zeros(2, 5))
    code = gm.code
    assert retarget_device_constants(gm, torch.device("cpu")) == 0
    assert gm.code == code
    assert retarget_device_constants(gm, torch.device("meta")) == 0  # meta is a trace device too by default


def test_hugging_face_gpt2_traced_on_the_cpu_has_its_constants_retargeted_in_every_graph() -> None:
    model = hf_examples.gpt2()[0]
    inputs, _ = hf_examples.make_batch("gpt2", 2, seed=0)
    gm = trace(model, (inputs["input_ids"],))
    assert torch.device("cpu") in _devices(gm)
    changed = retarget_device_constants(gm, torch.device("meta"), from_types=("cpu",))
    assert changed >= 1 and torch.device("cpu") not in _devices(gm)


def test_example_inputs_follow_a_model_already_on_an_accelerator() -> None:
    """compile moves CPU example inputs to the one device a model's weights sit on, unless that is the CPU or
    meta (checked here with meta standing in for a GPU: keep=("cpu",))."""
    from fxpipe.pipe_inputs import on_model_device

    inputs = (torch.zeros(2, 3), {"mask": torch.ones(2, dtype=torch.bool)}, 7)
    on_cpu = nn.Linear(3, 3)
    assert on_model_device(on_cpu, inputs) is inputs
    on_meta = nn.Linear(3, 3, device="meta")
    assert on_model_device(on_meta, inputs) is inputs  # planning a model on meta: inputs stay as given
    moved = on_model_device(on_meta, inputs, keep=("cpu",))
    assert moved[0].device.type == "meta" and moved[1]["mask"].device.type == "meta" and moved[2] == 7
    split = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    assert on_model_device(split, inputs, keep=("cpu",)) is inputs  # several devices: left to the user
