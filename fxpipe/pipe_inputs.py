"""A pipe's call inputs (a dict by name, a tuple or one value) as the model's positional inputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


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
