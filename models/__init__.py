"""Benchmark and test model zoo: build(name) -> (model, example_inputs), plus losses and batches."""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from . import amoebanet, bert, gnmt, gpt, mlp, resnet, skipnet, tied_lm, vgg, xlnet
from .registry import DEFAULT_BATCH_SIZE, ModelEntry, UnknownModelError

__all__ = ["DEFAULT_BATCH_SIZE", "ModelEntry", "UnknownModelError", "build", "get", "names"]

_ENTRIES: dict[str, ModelEntry] = {
    entry.name: entry
    for module in (gpt, bert, xlnet, gnmt, vgg, resnet, amoebanet, mlp, skipnet, tied_lm)
    for entry in module.ENTRIES
}


def names() -> list[str]:
    """All zoo model names, sorted."""
    return sorted(_ENTRIES)


def get(name: str) -> ModelEntry:
    """The zoo entry called `name`; UnknownModelError lists the known names and the closest one."""
    try:
        return _ENTRIES[name]
    except KeyError:
        close = difflib.get_close_matches(name, names(), n=1, cutoff=0.0)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownModelError(
            f"unknown model {name!r}.{hint} Known models: {', '.join(names())}"
        ) from None


def build(name: str, *, device: str | torch.device = "cpu", **overrides: Any) -> tuple[nn.Module, tuple[Any, ...]]:
    """Build zoo model `name` on `device` -> (model, example_inputs as a tuple, batch dim 0).

    Overrides are fields of the model's config dataclass plus `batch_size` and `seed`; on
    device="meta" nothing is allocated, so paper-size presets build in well under a second.
    """
    return get(name).build(device, **overrides)
