"""The split program's types: per-stage GraphModules and the routing of every crossing value (codegen writes
them, the runtime runs them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx


@dataclass(frozen=True)
class ValueSpec:
    """A value that crosses a stage boundary (or is a model input/output), at the example batch size."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    batched: bool
    is_tensor: bool
    requires_grad: bool
    batch_dim: int = 0  # the dim holding the batch rows when ``batched`` (fxpipe.passes.batchdims derives it)
    # model inputs: the dims the traced program fixed at the example's sizes (a batch must match them there);
    # every other dim (sequence length, image size) may differ from step to step
    fixed_dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class StageProgram:
    """One stage: ``module(*input_values)`` returns the tuple ``output_values``."""

    stage_index: int
    module: fx.GraphModule
    input_values: tuple[str, ...]
    output_values: tuple[str, ...]
    param_names: tuple[tuple[str, str], ...]  # (attribute path in module, original model name)


@dataclass(frozen=True)
class SplitProgram:
    """All stages of a split model, with where every crossing value comes from and goes to."""

    stages: tuple[StageProgram, ...]
    model_inputs: tuple[str, ...]
    output_tree: Any
    producers: Mapping[str, int]
    consumers: Mapping[str, tuple[int, ...]]
    values: Mapping[str, ValueSpec]
    tie_groups: tuple[tuple[str, tuple[int, ...]], ...]
    # the dtype name the stages compute their weights in (precision bf16-params: "bfloat16"); None: the weights' own
    param_dtype: str | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)


MODEL_INPUT = -1  # producer index of model inputs: every rank holds the global batch and slices it


def tree_leaves(tree: Any) -> list[str]:
    """The value names in an output tree (``SplitProgram.output_tree``), in order, repeats included."""
    if isinstance(tree, str):
        return [tree]
    if isinstance(tree, tuple | list):
        return [leaf for item in tree for leaf in tree_leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in tree_leaves(item)]
    return []  # constants (None, numbers) in the output are not values
