"""Fake-tensor runs of a program's stages: every crossing value's shape and dtype at given input shapes, with no
memory and no data (under autocast when it is on); batch layouts and shape templates both use them."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram

Shape = tuple[int, ...]


def fake_layouts(program: SplitProgram, device: torch.device, autocast_dtype: torch.dtype | None,
                 inputs: Mapping[str, Any]) -> tuple[dict[str, Shape], dict[str, torch.dtype]]:
    """Shape and dtype of every tensor value as the stages produce it (under autocast when it is on) from model
    inputs given as ``(shape, dtype)`` (non-tensor inputs as their values).

    Runs the stage modules in order on fake tensors (no memory, no data), with the weights as fake
    tensors on this rank's device: autocast's op lists differ between CPU and CUDA.
    """
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        known: dict[str, Any] = {name: torch.empty(value[0], dtype=value[1], device=device)
                                 if program.values[name].is_tensor else value for name, value in inputs.items()}
        run_stages(program, device, autocast_dtype, mode, known)
    tensors = {name: value for name, value in known.items() if isinstance(value, torch.Tensor)}
    return ({name: tuple(int(size) for size in value.shape) for name, value in tensors.items()},
            {name: value.dtype for name, value in tensors.items()})


def run_stages(program: SplitProgram, device: torch.device, autocast_dtype: torch.dtype | None, mode: FakeTensorMode,
               known: dict[str, Any], *, static_weights: bool = False) -> None:
    """Run every stage in order on the fake values in ``known`` (model inputs), adding each stage's outputs;
    the weights enter as fake tensors of ``mode`` on ``device`` (``static_weights``: with constant sizes, for a
    mode with a ShapeEnv), under autocast when it is on."""
    cast = getattr(torch, program.param_dtype) if program.param_dtype else None  # bf16-params: the stages' copies
    for stage in program.stages:
        weights = {name: mode.from_tensor(t, static_shapes=static_weights or None).to(device) for name, t in
                   itertools.chain(stage.module.named_parameters(), stage.module.named_buffers())}
        if cast is not None:
            weights.update({name: weights[name].to(cast) for name, t in stage.module.named_parameters()
                            if t.is_floating_point()})
        args = tuple(known[name] for name in stage.input_values)
        with torch.autocast(device_type=device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            outputs = torch.func.functional_call(stage.module, weights, args)
        known.update(zip(stage.output_values, outputs, strict=True))
