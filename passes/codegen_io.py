"""Export a SplitProgram to a folder (one torch.export ``.pt2`` program per stage plus ``program.json``) and load it back.

Loading runs no stored Python: each stage is ``torch.export.load(stage_<i>.pt2).module()``, which needs
torch alone (docs/export.md shows how to chain the stages without fxpipe).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import fx

from fxpipe.core.program import SplitProgram, StageProgram, ValueSpec
from fxpipe.passes.stage_export import (
    check_tied_copies_equal,
    example_batch_rows,
    export_stage,
    on_cpu,
    stage_example_args,
    value_batch_dims,
)

MANIFEST = "program.json"
FORMAT = "fxpipe.split_program"
FORMAT_VERSION = 2  # 1: stage code as .py files plus weights (loading executed the code); no longer read


class ProgramFileError(ValueError):
    """An exported program folder is missing files or does not match this fxpipe version."""


def export_program(program: SplitProgram, directory: str | Path) -> None:
    """Write ``stage_<i>.pt2`` (a torch.export program per stage) and ``program.json`` to ``directory``.

    Each stage is exported in its modules' training mode at export time, on the CPU, with its tensors
    (a tied tensor is in every file that uses it, so the copies must be equal) and a symbolic batch dim
    (``torch.export.Dim``, min 1) on every batched input; other dims are fixed at the example's sizes.
    In train mode, batch norm's running statistics are buffer mutations that the loaded module applies.
    """
    check_tied_copies_equal(program)
    program = on_cpu(program)
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    stage_entries = []
    for stage, args in zip(program.stages, stage_example_args(program, example_batch_rows(program)), strict=True):
        exported = export_stage(program, stage, args)
        program_file = f"stage_{stage.stage_index}.pt2"
        torch.export.save(exported.program, folder / program_file)
        stage_entries.append(
            {
                "stage_index": stage.stage_index,
                "program_file": program_file,
                "input_values": list(stage.input_values),
                "output_values": list(stage.output_values),
                "input_batch_dims": value_batch_dims(program, stage.input_values),
                "output_batch_dims": value_batch_dims(program, stage.output_values),
                "dynamic_batch": exported.dynamic_batch,
                "training": stage.module.training,
                "param_names": [[path, original] for path, original in stage.param_names],
            }
        )
    manifest = _program_manifest(program, stage_entries)
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def load_program(directory: str | Path) -> SplitProgram:
    """Rebuild an exported program; each stage module is ``torch.export.load(stage_<i>.pt2).module()``.

    No stored Python is executed (torch.export's deserialiser reads the graph and the tensors). A stage
    module is called as before, ``module(*input_values)`` returning the tuple ``output_values``, and keeps
    the training mode it was exported in (torch refuses ``.train()``/``.eval()`` on it: export again in
    the other mode). A folder written by an older fxpipe (format version 1, stage code as ``.py``
    files) raises :class:`ProgramFileError`: export the model again.
    """
    folder = Path(directory)
    manifest = _read_manifest(folder)
    stages = tuple(_load_stage(folder, entry) for entry in manifest["stages"])
    values = {name: _spec_from_json(name, spec) for name, spec in manifest["values"].items()}
    return SplitProgram(
        stages=stages,
        model_inputs=tuple(manifest["model_inputs"]),
        output_tree=_tree_from_json(manifest["output_tree"]),
        producers=MappingProxyType(dict(manifest["producers"])),
        consumers=MappingProxyType({name: tuple(stages) for name, stages in manifest["consumers"].items()}),
        values=MappingProxyType(values),
        tie_groups=tuple((name, tuple(held)) for name, held in manifest["tie_groups"]),
    )


def _load_stage(folder: Path, entry: Mapping[str, Any]) -> StageProgram:
    stage_index = int(entry["stage_index"])
    path = folder / entry["program_file"]
    if not path.is_file():
        raise ProgramFileError(f"{path} does not exist; {MANIFEST} names it for stage {stage_index}: export again")
    exported = torch.export.load(path)
    input_values, output_values = tuple(entry["input_values"]), tuple(entry["output_values"])
    num_inputs, num_outputs = len(exported.graph_signature.user_inputs), len(exported.graph_signature.user_outputs)
    if (num_inputs, num_outputs) != (len(input_values), len(output_values)):
        raise ProgramFileError(
            f"{path} takes {num_inputs} inputs and returns {num_outputs} outputs, but {MANIFEST} lists "
            f"{list(input_values)} -> {list(output_values)} for stage {stage_index}: the folder mixes exports; export again"
        )
    module = exported.module()
    assert isinstance(module, fx.GraphModule), type(module)
    held = {name for name, _ in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]}
    param_names = tuple((str(path_), str(original)) for path_, original in entry["param_names"])
    missing = [path_ for path_, _ in param_names if path_ not in held]
    if missing:
        raise ProgramFileError(f"{path} holds no tensors {missing}, which {MANIFEST} lists for stage {stage_index}: export again")
    return StageProgram(stage_index=stage_index, module=module, input_values=input_values,
                        output_values=output_values, param_names=param_names)


def _program_manifest(program: SplitProgram, stage_entries: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_inputs": list(program.model_inputs),
        "output_tree": _tree_to_json(program.output_tree),
        "producers": dict(program.producers),
        "consumers": {name: list(stages) for name, stages in program.consumers.items()},
        "values": {name: _spec_to_json(spec) for name, spec in program.values.items()},
        "tie_groups": [[name, list(held)] for name, held in program.tie_groups],
        "stages": stage_entries,
    }


def _read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise ProgramFileError(f"{path} does not exist; point load_program at a folder written by export_program")
    manifest = json.loads(path.read_text())
    found = (manifest.get("format"), manifest.get("format_version"))
    if found == (FORMAT, 1):
        raise ProgramFileError(
            f"{path} is format version 1 (stage code as .py files plus weights, loaded by executing that code, which "
            f"fxpipe no longer does); export the model again (pipe.export(dir) or export_program) to write "
            f"torch.export .pt2 stages (version {FORMAT_VERSION})"
        )
    if found != (FORMAT, FORMAT_VERSION):
        raise ProgramFileError(
            f"{path} has format {found[0]!r} version {found[1]!r}; "
            f"this fxpipe reads {FORMAT!r} version {FORMAT_VERSION}: export the program again"
        )
    return dict(manifest)


def _spec_to_json(spec: ValueSpec) -> dict[str, Any]:
    return {
        "shape": list(spec.shape),
        "dtype": None if spec.dtype is None else str(spec.dtype).removeprefix("torch."),
        "batched": spec.batched,
        "batch_dim": spec.batch_dim,
        "is_tensor": spec.is_tensor,
        "requires_grad": spec.requires_grad,
        "fixed_dims": list(spec.fixed_dims),
    }


def _spec_from_json(name: str, data: Mapping[str, Any]) -> ValueSpec:
    dtype = None if data["dtype"] is None else getattr(torch, data["dtype"])
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ProgramFileError(f"value {name!r} has dtype {data['dtype']!r}, which is not a torch dtype")
    return ValueSpec(
        name=name,
        shape=tuple(data["shape"]),
        dtype=dtype,
        batched=bool(data["batched"]),
        is_tensor=bool(data["is_tensor"]),
        requires_grad=bool(data["requires_grad"]),
        batch_dim=int(data.get("batch_dim", 0)),  # folders written before batch_dims: dim 0
        fixed_dims=tuple(int(dim) for dim in data.get("fixed_dims", ())),
    )


def _tree_to_json(tree: Any) -> Any:
    """Tagged form, so tuples, lists and dicts survive JSON: {"value": name}, {"tuple": [...]}, ..."""
    if isinstance(tree, str):
        return {"value": tree}
    if isinstance(tree, tuple | list):
        return {type(tree).__name__: [_tree_to_json(item) for item in tree]}
    if isinstance(tree, dict):
        return {"dict": [[key, _tree_to_json(item)] for key, item in tree.items()]}
    return {"constant": tree}


def _tree_from_json(data: Mapping[str, Any]) -> Any:
    ((tag, content),) = data.items()
    if tag == "value":
        return content
    if tag in ("tuple", "list"):
        items = [_tree_from_json(item) for item in content]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict":
        return {key: _tree_from_json(item) for key, item in content}
    return content


__all__ = ["ProgramFileError", "export_program", "load_program"]
