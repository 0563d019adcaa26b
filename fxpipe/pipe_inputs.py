"""A pipe's call inputs (a dict by name, a tuple or one value) as the model's positional inputs."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


def positional_inputs(names: Sequence[str], inputs: Any, partial: bool = False) -> tuple[Any, ...]:
    """``inputs`` in the order of the model's inputs ``names``; ``partial``: a rank passes only what it reads."""
    if isinstance(inputs, Mapping):
        if partial:
            return tuple(inputs.get(name) for name in names)
        missing = [name for name in names if name not in inputs]
        if missing:
            raise TypeError(f"inputs dict lacks {missing}; the model takes {list(names)}")
        return tuple(inputs[name] for name in names)
    if isinstance(inputs, tuple | list):
        return tuple(inputs)
    return (inputs,)


def on_model_device(model: torch.nn.Module, example_inputs: Any, keep: tuple[str, ...] = ("cpu", "meta")) -> Any:
    """``example_inputs`` with their CPU tensors moved to the accelerator the model's weights sit on, if they all
    sit on one (a model a first ``compile`` moved to the GPU, compiled again with the same CPU inputs; issue 36's
    device run failed in compile's row check there: "mat1 is on cpu, different from other tensors on cuda:0").

    A model on a device of a type in ``keep`` (the CPU, the meta device), or spread over several devices, keeps
    its inputs as given.
    """
    devices = {tensor.device for tensor in itertools.chain(model.parameters(), model.buffers())}
    if len(devices) != 1:
        return example_inputs
    (device,) = devices
    if device.type in keep:
        return example_inputs
    return pytree.tree_map(
        lambda value: value.to(device) if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value,
        example_inputs)
