"""Each stage of a SplitProgram as a torch.export program: example arguments, a dynamic batch dim, tie checks."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from fxpipe.core.program import SplitProgram, StageProgram

# The smallest batch an export example may have: torch.export specialises a dim of size 0 or 1.
MIN_EXAMPLE_ROWS = 2


class StageExportError(ValueError):
    """A stage cannot be written as a torch.export program (or its tied copies disagree)."""


class StaticBatchWarning(UserWarning):
    """A stage fixes its batch size, so its exported program runs only batches of the example's size."""


@dataclass(frozen=True)
class ExportedStage:
    """A stage's torch.export program and whether its batch dim is symbolic (any batch >= 1 rows)."""

    program: torch.export.ExportedProgram
    dynamic_batch: bool


def example_batch_rows(program: SplitProgram) -> int:
    """Rows of the export example: the program's example batch, at least ``MIN_EXAMPLE_ROWS``."""
    sizes = {program.values[name].shape[program.values[name].batch_dim]
             for name in program.model_inputs if program.values[name].batched}
    return max([MIN_EXAMPLE_ROWS, *sizes])


def stage_example_args(program: SplitProgram, rows: int) -> list[tuple[Any, ...]]:
    """Each stage's arguments (zeros; Python numbers as computed) when the chain runs on ``rows`` batch rows.

    The chain runs on fake tensors (no compute), so non-tensor values that cross a boundary (e.g. a
    sequence length read by ``x.size(1)``) get the values the stages compute. Each stage runs on fake
    copies of its parameters and buffers: a train-mode batch norm's ``num_batches_tracked += 1`` would
    otherwise change the real (0-dim) buffer.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.no_grad():
        values: dict[str, Any] = {name: _fake_model_input(program, name, rows) for name in program.model_inputs}
        fake_args = []
        for stage in program.stages:
            args = tuple(values[name] for name in stage.input_values)
            fake_args.append(args)
            outputs = torch.func.functional_call(stage.module, _fake_state(mode, stage), args)
            values.update(zip(stage.output_values, outputs, strict=True))
    return [tuple(_concrete(value) for value in args) for args in fake_args]


def _fake_state(mode: FakeTensorMode, stage: StageProgram) -> dict[str, torch.Tensor]:
    module = stage.module
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {name: mode.from_tensor(tensor) for name, tensor in named}


def _fake_model_input(program: SplitProgram, name: str, rows: int) -> torch.Tensor:
    spec = program.values[name]
    if not spec.is_tensor or spec.dtype is None:
        raise StageExportError(f"model input {name!r} is not a tensor; export needs tensor model inputs")
    shape = list(spec.shape)
    if spec.batched:
        shape[spec.batch_dim] = rows
    return torch.zeros(shape, dtype=spec.dtype)


def _concrete(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.zeros(tuple(int(size) for size in value.shape), dtype=value.dtype)
    return value


def export_stage(program: SplitProgram, stage: StageProgram, args: tuple[Any, ...]) -> ExportedStage:
    """``torch.export.export`` of the stage in its training mode, with a symbolic batch on every batched input.

    First one ``Dim("batch", min=1)`` shared by those inputs; a stage that needs a narrower range (it
    takes the first 2 rows, say) fails that and is exported with ``Dim.AUTO``, where export picks the
    range. A stage that fixes its batch size (a hard-coded view) then comes out static, with a
    ``StaticBatchWarning``: its program refuses other batch sizes when called (torch.export's guards).
    """
    batched = [_batched_tensor(program, name, arg) for name, arg in zip(stage.input_values, args, strict=True)]
    errors = []
    for batch in (torch.export.Dim("batch", min=1), torch.export.Dim.AUTO):
        shapes = tuple({program.values[name].batch_dim: batch} if is_batched else None
                       for name, is_batched in zip(stage.input_values, batched, strict=True))
        try:
            exported = torch.export.export(stage.module, args, dynamic_shapes=shapes, strict=False)
            break
        except Exception as error:  # a narrower batch range (Dim.AUTO finds it), or a stage export cannot trace
            errors.append(f"{type(error).__name__}: {error}")
    else:
        raise StageExportError(
            f"stage {stage.stage_index} cannot be exported with torch.export ({errors[-1]}); the stage code must be "
            "traceable by non-strict torch.export"
        )
    dynamic = _has_symbolic_batch(program, stage, exported)
    if any(batched) and not dynamic:
        warnings.warn(
            f"stage {stage.stage_index} fixes its batch size, so its exported program runs only batches of "
            f"{_rows(program, stage, args)} rows (program.json says dynamic_batch: false)",
            StaticBatchWarning, stacklevel=3)
    return ExportedStage(exported, dynamic)


def _batched_tensor(program: SplitProgram, name: str, arg: Any) -> bool:
    return isinstance(arg, torch.Tensor) and program.values[name].batched


def _rows(program: SplitProgram, stage: StageProgram, args: tuple[Any, ...]) -> int | None:
    for name, arg in zip(stage.input_values, args, strict=True):
        if _batched_tensor(program, name, arg):
            return int(arg.shape[program.values[name].batch_dim])
    return None


def _has_symbolic_batch(program: SplitProgram, stage: StageProgram, exported: torch.export.ExportedProgram) -> bool:
    """True when every batched tensor input's batch dim is symbolic in the exported graph."""
    placeholders = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    user_inputs = exported.graph_signature.user_inputs
    assert len(user_inputs) == len(stage.input_values), (user_inputs, stage.input_values)
    symbolic = []
    for name, node_name in zip(stage.input_values, user_inputs, strict=True):
        if not isinstance(node_name, str) or node_name not in placeholders:
            continue  # a Python number input: export made it a constant
        value = placeholders[node_name].meta.get("val")
        if isinstance(value, torch.Tensor) and program.values[name].batched:
            # an int, or a SymInt export specialised to one (Dim.AUTO on a stage that fixes its batch)
            symbolic.append(not is_concrete_int(value.shape[program.values[name].batch_dim]))
    return bool(symbolic) and all(symbolic)


def on_cpu(program: SplitProgram) -> SplitProgram:
    """``program``, or a copy whose stage modules live on the CPU (exported programs are portable CPU files)."""
    stages = []
    for stage in program.stages:
        tensors = [*stage.module.parameters(), *stage.module.buffers()]
        if all(tensor.device.type == "cpu" for tensor in tensors):
            stages.append(stage)
        else:
            stages.append(dataclasses.replace(stage, module=copy.deepcopy(stage.module).to("cpu")))
    return dataclasses.replace(program, stages=tuple(stages))


def check_tied_copies_equal(program: SplitProgram) -> None:
    """Raise unless every stage's copy of each tied tensor equals the first holder's (each file holds its own)."""
    for original, holders in program.tie_groups:
        copies = [(index, _tensor_named(program.stages[index], original)) for index in holders]
        first_index, first = copies[0]
        for index, tensor in copies[1:]:
            if tensor.shape != first.shape or not torch.equal(tensor.detach().cpu(), first.detach().cpu()):
                difference = _max_difference(first, tensor)
                raise StageExportError(
                    f"tied tensor {original!r} differs between stage {first_index} and stage {index} "
                    f"(max abs difference {difference}); every exported stage holds its own copy, so the copies must "
                    "be equal: export after a whole optimizer step (pipe.step then opt.step on every rank), or load "
                    "one state dict into every stage first"
                )


def _tensor_named(stage: StageProgram, original: str) -> torch.Tensor:
    for path, name in stage.param_names:
        if name == original:
            owner_path, _, attribute = path.rpartition(".")
            value = getattr(stage.module.get_submodule(owner_path) if owner_path else stage.module, attribute)
            assert isinstance(value, torch.Tensor), (path, type(value))
            return value
    raise AssertionError(f"stage {stage.stage_index} holds no tensor named {original!r}")


def _max_difference(first: torch.Tensor, second: torch.Tensor) -> float | str:
    if first.shape != second.shape:
        return f"shapes {tuple(first.shape)} and {tuple(second.shape)}"
    return float((first.detach().cpu().double() - second.detach().cpu().double()).abs().max())


def value_batch_dims(program: SplitProgram, names: Sequence[str]) -> list[int | None]:
    """Each value's batch dim, None for values without batch rows (manifest form)."""
    return [program.values[name].batch_dim if program.values[name].batched else None for name in names]


__all__ = [
    "ExportedStage",
    "StageExportError",
    "StaticBatchWarning",
    "check_tied_copies_equal",
    "example_batch_rows",
    "export_stage",
    "on_cpu",
    "stage_example_args",
    "value_batch_dims",
]
