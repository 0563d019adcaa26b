"""The shapes one step runs at: the batch's rows, their split into micro-batches, every crossing value's shape and dtype.

A plan is made at the example's shapes but runs any batch the traced program accepts: another
sequence length, a short last batch, a bigger evaluation batch. Every rank sees the same global
batch, so every rank works out the same layout on its own, with no message: the rows split as
evenly as possible over micro-batches and then over each stage's replicas (``split_rows``), and the
values' shapes come from the plan (only the batch dim differs) or, when another dim changes, from
one run of every stage on fake tensors (no memory, no data), done once per shape signature; a symbolic
run's formulas answer for later shapes it covers (``shape_templates``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from fxpipe.core.fake_log import quiet_fake_tensor_log
from fxpipe.core.plan import Plan
from fxpipe.core.row_slices import row_ranges
from fxpipe.runtime.faults.errors import BatchShapeError
from fxpipe.runtime.transport.fake_run import Shape, fake_layouts

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram, ValueSpec
    from fxpipe.runtime.transport.shape_templates import ShapeTemplates



@dataclass(frozen=True)
class BatchLayout:
    """``num_rows`` global rows in micro-batches ``microbatch_ranges`` (the plan's count, fewer for a batch too small
    for it); ``shapes``/``dtypes`` of every tensor value (a batched value's batch dim at any row count: receivers
    put their own rows there)."""

    num_rows: int
    microbatch_ranges: tuple[tuple[int, int], ...]
    shapes: Mapping[str, Shape]
    dtypes: Mapping[str, torch.dtype | None]

    def microbatch_rows(self, microbatch_index: int) -> int:
        start, stop = self.microbatch_ranges[microbatch_index]
        return stop - start


def min_rows(plan: Plan) -> int:
    """The smallest batch the plan runs: one micro-batch with a row for every replica of every stage."""
    return max(stage.replicas for stage in plan.stages)


def num_microbatches_for(plan: Plan, num_rows: int) -> int:
    """The plan's micro-batch count, or fewer for a batch too small to give every replica a row of each."""
    return max(1, min(plan.num_microbatches, num_rows // min_rows(plan)))


def shape_key(program: SplitProgram, inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What the layout depends on: each input's shape with the batch dim left out (None for non-tensors)."""
    key: list[tuple[int, ...] | None] = []
    for name, value in zip(program.model_inputs, inputs, strict=False):
        if not isinstance(value, torch.Tensor):
            key.append(None)
            continue
        spec = program.values[name]
        shape = tuple(value.shape)
        key.append(shape[:spec.batch_dim] + shape[spec.batch_dim + 1:] if spec.batched else shape)
    return tuple(key)


def batch_rows(program: SplitProgram, plan: Plan, inputs: Sequence[Any], targets: Any, *,
               target_batch_dim: int = 0) -> int:
    """The batch's row count after checking it against the program (BatchShapeError, no communication).

    Every tensor input must have the dtype and number of dims the model was traced with and the sizes
    the traced program fixed (``ValueSpec.fixed_dims``); the batched inputs and the targets must agree on
    the rows, and there must be at least :func:`min_rows`. A model without batched inputs runs the plan's.
    """
    names = program.model_inputs
    if len(inputs) != len(names):
        raise BatchShapeError(f"step got {len(inputs)} inputs but the model takes {len(names)} ({list(names)})")
    rows_by_input: dict[str, int] = {}
    for name, value in zip(names, inputs, strict=True):
        spec = program.values[name]
        if spec.is_tensor:
            _check_input(spec, value)
            if spec.batched:
                rows_by_input[name] = int(value.shape[spec.batch_dim])
    if len(set(rows_by_input.values())) > 1:
        raise BatchShapeError(f"inputs disagree on the batch rows {rows_by_input}; every batched input holds the same "
                              "rows in its batch dim (batch_dims of fxpipe.compile says which)")
    num_rows = next(iter(rows_by_input.values()), plan.global_batch_size)
    _check_not_transposed(program, inputs, targets, num_rows, target_batch_dim)
    check_targets(targets, num_rows, target_batch_dim)
    needed = min_rows(plan)
    if num_rows < needed:
        raise BatchShapeError(
            f"a batch of {num_rows} rows is too small for plan {plan.layout!r}: a stage of {needed} replicas needs "
            f"at least {needed} rows (one per replica); pad the batch or drop it (DataLoader drop_last=True)")
    return num_rows


def _check_input(spec: ValueSpec, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise BatchShapeError(f"input {spec.name!r} must be a tensor, got {type(value).__name__}")
    expected = f"{spec.dtype}, {len(spec.shape)} dims as the example {spec.shape}"
    if value.dim() != len(spec.shape) or (spec.dtype is not None and value.dtype != spec.dtype):
        raise BatchShapeError(f"input {spec.name!r} has shape {tuple(value.shape)} {value.dtype} but the model was "
                              f"traced with {expected}; pass that dtype and number of dims")
    fixed = [dim for dim in spec.fixed_dims if not (spec.batched and dim == spec.batch_dim)]
    differs = [dim for dim in fixed if value.shape[dim] != spec.shape[dim]]
    if differs:
        raise BatchShapeError(
            f"input {spec.name!r} has shape {tuple(value.shape)} but the traced program fixed dims {differs} at "
            f"{[spec.shape[dim] for dim in differs]} (the example {spec.shape}: torch.export specialised them, the "
            "model's code treats them as constants); pass those sizes, or compile with an example of the new shape")


def _check_not_transposed(program: SplitProgram, inputs: Sequence[Any], targets: Any, num_rows: int,
                          target_batch_dim: int) -> None:
    """Inputs that hold the targets' rows in another dim than their batch dim (``(T, B)`` passed where the model
    takes ``(B, T)``) are blamed on the inputs, naming the input, before the targets are checked against them."""
    leaves = [leaf for leaf in tree_flatten(targets)[0] if isinstance(leaf, torch.Tensor) and leaf.dim() > target_batch_dim]
    target_rows = {int(leaf.shape[target_batch_dim]) for leaf in leaves}
    if len(target_rows) != 1 or num_rows in target_rows:
        return
    rows = target_rows.pop()
    for name, value in zip(program.model_inputs, inputs, strict=True):
        spec = program.values[name]
        if not (spec.is_tensor and spec.batched and isinstance(value, torch.Tensor)):
            continue
        others = [dim for dim in range(value.dim()) if dim != spec.batch_dim and value.shape[dim] == rows]
        if others:
            raise BatchShapeError(
                f"input {name!r} has shape {tuple(value.shape)}: the model reads the batch from its dim "
                f"{spec.batch_dim} ({value.shape[spec.batch_dim]} rows), but the targets hold {rows} rows, as many as "
                f"its dim {others[0]}: the input looks transposed (the example was {spec.shape}, batch in dim "
                f"{spec.batch_dim}); pass {name!r} with the batch in dim {spec.batch_dim} (e.g. "
                f"{name}.transpose({spec.batch_dim}, {others[0]})), or compile with batch_dims={{{name!r}: "
                f"{others[0]}}} if the model really takes the batch in dim {others[0]}; if {name!r} is right, the "
                f"targets are not (they must hold {num_rows} rows in dim {target_batch_dim})")


def check_targets(targets: Any, num_rows: int, dim: int) -> None:
    """Every tensor leaf of the targets holds ``num_rows`` rows in dim ``dim`` (BatchShapeError otherwise)."""
    for leaf in tree_flatten(targets)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and (leaf.dim() <= dim or leaf.shape[dim] != num_rows):
            rows = leaf.shape[dim] if leaf.dim() > dim else "no"
            raise BatchShapeError(f"targets have {rows} rows in their batch dim {dim} (shape {tuple(leaf.shape)}) "
                                  f"but the inputs hold {num_rows} rows; pass targets with the batch in dim {dim} or "
                                  "set target_batch_dim")


def make_layout(program: SplitProgram, plan: Plan, inputs: Sequence[Any], num_rows: int, device: torch.device,
                autocast_dtype: torch.dtype | None, plan_dtypes: Mapping[str, torch.dtype | None],
                templates: ShapeTemplates | None = None) -> BatchLayout:
    """The layout of a checked batch: the plan's value shapes when only the rows differ, else a fake run, or
    with ``templates`` the formulas of an earlier symbolic run where they cover the batch (the same result)."""
    ranges = row_ranges(num_rows, num_microbatches_for(plan, num_rows))
    if shape_key(program, inputs) == _example_key(program):  # batched values differ in the batch dim only
        shapes = {name: spec.shape for name, spec in program.values.items() if spec.is_tensor}
        return BatchLayout(num_rows, ranges, shapes, plan_dtypes)
    rows = ranges[0][1] - ranges[0][0]
    sliced = {name: _slice_layout(program.values[name], value, rows)
              for name, value in zip(program.model_inputs, inputs, strict=True)}
    try:
        if templates is not None:  # quiet only where it runs the stages: setting log levels costs a millisecond
            shapes, dtypes = templates.layouts(sliced)
        else:
            with quiet_fake_tensor_log():
                shapes, dtypes = fake_layouts(program, device, autocast_dtype, sliced)
    except Exception as error:
        given = {name: tuple(value.shape) for name, value in zip(program.model_inputs, inputs, strict=True)
                 if isinstance(value, torch.Tensor)}
        traced = {name: program.values[name].shape for name in given}
        raise BatchShapeError(f"the model does not run at input shapes {given} (traced at {traced}): "
                              f"{type(error).__name__}: {str(error)[:300]}") from error
    return BatchLayout(num_rows, ranges, shapes, {**plan_dtypes, **dtypes} if autocast_dtype else dict(plan_dtypes))


def _example_key(program: SplitProgram) -> tuple[Any, ...]:
    specs = [program.values[name] for name in program.model_inputs]
    return shape_key(program, [torch.empty(spec.shape, device="meta") if spec.is_tensor else None for spec in specs])


def _slice_layout(spec: ValueSpec, value: Any, rows: int) -> Any:
    """``(shape, dtype)`` of one micro-batch slice of input ``value`` with ``rows`` rows (non-tensors as they are)."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = list(value.shape)
    if spec.batched:
        shape[spec.batch_dim] = rows
    return tuple(shape), value.dtype


def infer_value_dtypes(program: SplitProgram, device: torch.device,
                       autocast_dtype: torch.dtype | None) -> dict[str, torch.dtype | None]:
    """Dtype of every value as the stages produce it at the plan's shapes, under autocast when it is on,
    so every rank knows its receive-buffer dtypes without asking the sender."""
    dtypes: dict[str, torch.dtype | None] = {name: spec.dtype for name, spec in program.values.items()}
    if autocast_dtype is None:
        return dtypes
    inputs = {}
    for name in program.model_inputs:
        spec = program.values[name]
        if not spec.is_tensor or spec.dtype is None:
            raise ValueError(f"value {spec.name!r} is not a tensor; autocast dtype inference needs tensor inputs")
        inputs[name] = (spec.shape, spec.dtype)
    dtypes.update(fake_layouts(program, device, autocast_dtype, inputs)[1])
    return dtypes
