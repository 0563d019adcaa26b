"""Stages exported as torch.export ``.pt2`` programs (issue 24): batch norm in train and eval mode, tied copies,
old folders, and ``pipe.export`` of a trained 2:1 pipeline (replicas, tied weights, batch norm) loaded by a
process that imports torch alone, chained by program.json's value names, against the trained model."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn

import fxpipe
import fxpipe.models as zoo
from fxpipe.core.program import SplitProgram, tree_leaves
from fxpipe.passes import trace
from fxpipe.passes.codegen import split_stages
from fxpipe.passes.codegen_io import ProgramFileError, export_program, load_program
from fxpipe.passes.stage_export import StageExportError, StaticBatchWarning
from fxpipe.runtime.numerics.batchnorm import BatchNormWarning
from tests.mp_utils import compute_nodes, plan_from_cuts, run_ranks, run_scenarios

torch.set_num_threads(1)

BATCH, NUM_MICROBATCHES, REPLICAS = 12, 2, (2, 1)
OTHER_ROWS = 5  # loaded stages run a batch of another size than any export example

# Loads and chains exported stages with torch alone: what docs/export.md tells users to do.
TORCH_ALONE = r'''
import json, sys
import torch

def leaves(tree):
    ((tag, content),) = tree.items()
    if tag == "value":
        return [content]
    if tag in ("tuple", "list"):
        return [leaf for item in content for leaf in leaves(item)]
    if tag == "dict":
        return [leaf for _, item in content for leaf in leaves(item)]
    return []

results = {}
for folder, inputs_file in zip(sys.argv[1::2], sys.argv[2::2]):
    manifest = json.load(open(f"{folder}/program.json"))
    values = dict(zip(manifest["model_inputs"], torch.load(inputs_file, weights_only=True)))
    buffers = {}
    for stage in manifest["stages"]:
        module = torch.export.load(f"{folder}/{stage['program_file']}").module()
        with torch.no_grad():
            outputs = module(*(values[name] for name in stage["input_values"]))
        values.update(zip(stage["output_values"], outputs))
        buffers.update({name: tensor.clone() for name, tensor in module.named_buffers()})
    results[folder] = {"outputs": [values[name] for name in leaves(manifest["output_tree"])], "buffers": buffers}
assert "fxpipe" not in sys.modules, sorted(name for name in sys.modules if name.startswith("fxpipe"))
torch.save(results, "torch_alone_results.pt")
'''


class BatchNormNet(nn.Module):
    """Two batch norms, one per stage when cut in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.bn1 = nn.Linear(6, 16), nn.BatchNorm1d(16)
        self.mid, self.bn2, self.out = nn.Linear(16, 12), nn.BatchNorm1d(12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn2(self.mid(torch.relu(self.bn1(self.inp(x)))))))


def _batch_norm_net() -> BatchNormNet:
    torch.manual_seed(0)
    model = BatchNormNet()
    with torch.no_grad():
        model(torch.randn(BATCH, 6) * 3 + 1)  # running statistics away from their initial values
    return model


def _chain(program: SplitProgram, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The program's output leaves, stages called in order on the same modules (buffer updates stay)."""
    values: dict[str, Any] = dict(zip(program.model_inputs, inputs, strict=True))
    with torch.no_grad():
        for stage in program.stages:
            values.update(zip(stage.output_values, stage.module(*(values[name] for name in stage.input_values)),
                              strict=True))
    return [values[name] for name in tree_leaves(program.output_tree)]


def _buffers(program: SplitProgram) -> dict[str, torch.Tensor]:
    """Every stage's buffers by original name."""
    found = {}
    for stage in program.stages:
        held = dict(stage.module.named_buffers(remove_duplicate=False))
        found.update({original: held[path].clone() for path, original in stage.param_names if path in held})
    return found


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_stages_match_the_eager_model(training: bool, tmp_path: Path) -> None:
    model = _batch_norm_net().train(training)
    gm = trace(model, (torch.randn(BATCH, 6),))
    names = compute_nodes(gm)
    program = split_stages(gm, [names[: len(names) // 2], names[len(names) // 2:]])
    for stage in program.stages:
        stage.module.train(training)
    before = _buffers(program)
    export_program(program, tmp_path)
    assert all(torch.equal(tensor, before[name]) for name, tensor in _buffers(program).items())  # export changed none
    assert [stage["training"] for stage in json.loads((tmp_path / "program.json").read_text())["stages"]] == \
        [training, training]
    loaded, eager = load_program(tmp_path), copy.deepcopy(model)
    assert {name for name in before if "bn1" in name} and {name for name in before if "bn2" in name}
    for rows in (OTHER_ROWS, BATCH):  # train mode: two calls, each updating the running statistics
        x = torch.randn(rows, 6)
        with torch.no_grad():
            expected = eager(x)
        (actual,) = _chain(loaded, (x,))
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
        eager_buffers = dict(eager.named_buffers())
        for name, tensor in _buffers(loaded).items():
            torch.testing.assert_close(tensor, eager_buffers[name], rtol=1e-6, atol=1e-7, msg=name)
    moved = any(not torch.equal(tensor, before[name]) for name, tensor in _buffers(loaded).items())
    assert moved == training  # train mode updates running statistics, eval mode leaves them


def test_tied_copies_that_differ_are_refused(tmp_path: Path) -> None:
    model, inputs = zoo.build("tied-lm", **zoo.get("tied-lm").tiny_overrides)
    gm = trace(model, inputs)
    names = compute_nodes(gm)
    program = split_stages(gm, [names[: len(names) // 2], names[len(names) // 2:]])
    (tied, holders), = program.tie_groups
    last = program.stages[holders[-1]]
    changed = copy.deepcopy(last.module)
    path = next(path for path, original in last.param_names if original == tied)
    with torch.no_grad():
        changed.get_parameter(path).add_(0.5)
    stages = tuple(dataclasses.replace(stage, module=changed) if stage is last else stage for stage in program.stages)
    with pytest.raises(StageExportError, match=rf"tied tensor '{tied}' differs between stage 0 and stage 1 "
                                               r"\(max abs difference 0\.5"):
        export_program(dataclasses.replace(program, stages=stages), tmp_path)


class FixedBatchHead(nn.Module):
    """A stage module with a hard-coded batch of ``BATCH`` rows (what a fixed view in a model does)."""

    def __init__(self, out: nn.Module) -> None:
        super().__init__()
        self.out = out

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.out(h.reshape(BATCH, -1)),)


def test_a_stage_that_fixes_its_batch_is_exported_static_with_a_warning(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 4))
    x = torch.randn(BATCH, 6)
    gm = trace(model, (x,))
    program = split_stages(gm, [["_0"], ["_1"]])
    head = dataclasses.replace(program.stages[1], module=fx.symbolic_trace(FixedBatchHead(model[1])),
                               param_names=(("out.weight", "1.weight"), ("out.bias", "1.bias")))
    with pytest.warns(StaticBatchWarning, match=f"stage 1 fixes its batch size, so its exported program runs only "
                                                f"batches of {BATCH} rows"):
        export_program(dataclasses.replace(program, stages=(program.stages[0], head)), tmp_path)
    manifest = json.loads((tmp_path / "program.json").read_text())
    assert [stage["dynamic_batch"] for stage in manifest["stages"]] == [True, False]
    loaded = load_program(tmp_path)
    (actual,) = _chain(loaded, (x,))
    torch.testing.assert_close(actual, model(x).detach(), rtol=0, atol=0)
    with pytest.raises((AssertionError, RuntimeError), match=str(BATCH)):  # torch's input guard names the size
        _chain(loaded, (x[:OTHER_ROWS],))


def test_a_version_1_folder_says_to_export_again(tmp_path: Path) -> None:
    (tmp_path / "program.json").write_text(json.dumps({"format": "fxpipe.split_program", "format_version": 1}))
    (tmp_path / "stage_0.py").write_text("raise SystemExit('stored code ran')\n")
    with pytest.raises(ProgramFileError, match=r"format version 1 .* which fxpipe no longer does\); export the "
                                               r"model again"):
        load_program(tmp_path)


def _tied_lm_scenario(rank: int, store_dir: str) -> dict[str, Any] | None:
    """tied-lm trained two steps on 2:1, then exported (tied weights, a replicated stage)."""
    entry = zoo.get("tied-lm")
    model, example_inputs = zoo.build("tied-lm", seed=0, **entry.tiny_overrides)
    inputs, targets = entry.make_batch(BATCH, 3, **entry.tiny_overrides)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), REPLICAS, BATCH, NUM_MICROBATCHES)
    pipe = fxpipe.compile(model, example_inputs, global_batch_size=BATCH, plan=plan, loss_fn=entry.loss_fn)
    return _train_and_export(pipe, tuple(inputs), targets,
                             lambda: zoo.build("tied-lm", seed=0, **entry.tiny_overrides)[0], store_dir, "tied")


def _batch_norm_scenario(rank: int, store_dir: str) -> dict[str, Any] | None:
    """BatchNormNet trained two steps on 2:1 (batch_norm="deferred"), exported in train mode and in eval mode."""
    x = torch.randn(BATCH, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 4, (BATCH,), generator=torch.Generator().manual_seed(2))
    plan = plan_from_cuts(trace(_batch_norm_net(), (x,)), REPLICAS, BATCH, NUM_MICROBATCHES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormWarning)  # train-mode slices: expected, not what this test checks
        pipe = fxpipe.compile(_batch_norm_net(), (x,), global_batch_size=BATCH, plan=plan, loss_fn=F.cross_entropy,
                              batch_norm="deferred")
    trained = _train_and_export(pipe, (x,), y, _batch_norm_net, store_dir, "bn-train")
    pipe.eval()
    pipe.export(str(Path(store_dir) / "bn-eval"))
    dist.barrier()
    if trained is None:
        return None
    state = torch.load(Path(store_dir) / "bn-train.state.pt", weights_only=True)
    return {**trained, "bn-eval": _loaded_against(Path(store_dir), "bn-eval", state, _batch_norm_net, False)}


def _train_and_export(pipe: Any, inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, build: Any,
                      store_dir: str, name: str) -> dict[str, Any] | None:
    """Two SGD steps, export to ``store_dir/name``; rank 0 saves the trained state and checks the loaded stages."""
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    for _ in range(2):
        pipe.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
    state = _whole_state(pipe)
    folder = Path(store_dir) / name
    pipe.export(str(folder))
    dist.barrier()
    if dist.get_rank() != 0:
        return None
    torch.save(state, Path(store_dir) / f"{name}.state.pt")
    initial = build().state_dict()
    trained_moved = all(not torch.equal(state[key], initial[key]) for key in initial if key.endswith("weight"))
    return {"trained_moved": trained_moved,
            name: _loaded_against(Path(store_dir), name, state, build, pipe.driver.runner.module.training)}


def _whole_state(pipe: Any) -> dict[str, torch.Tensor]:
    """The trained model's state: each tensor from the lowest rank holding it (a stage's first replica)."""
    gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: tensor.clone() for name, tensor in pipe.state_dict().items()})
    state: dict[str, torch.Tensor] = {}
    for held in gathered:
        assert held is not None
        for name, tensor in held.items():
            state.setdefault(name, tensor)
    return state


def _loaded_against(store_dir: Path, name: str, state: dict[str, torch.Tensor], build: Any,
                    training: bool) -> dict[str, Any]:
    """Max differences between the loaded stages and the trained model (outputs, then buffers after the call).

    The batch, the trained model's outputs and its buffers after the call go to ``<name>.expected.pt``
    (tensors do not travel back through the result queue once the rank process exits).
    """
    program = load_program(store_dir / name)
    reference = build()
    reference.load_state_dict(state)
    reference.train(training)
    inputs = _other_batch(program)
    with torch.no_grad():
        expected = reference(*inputs)
    actual = _chain(program, inputs)
    expected_leaves = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    reference_buffers = dict(reference.named_buffers())
    torch.save({"inputs": list(inputs), "outputs": expected_leaves, "buffers": reference_buffers},
               store_dir / f"{name}.expected.pt")
    return {
        "output_diff": max(float((a - e).abs().max()) for a, e in zip(actual, expected_leaves, strict=True)),
        "buffer_diff": max([float((tensor.double() - reference_buffers[key].double()).abs().max())
                            for key, tensor in _buffers(program).items()], default=0.0),
        "num_stages": program.num_stages,
    }


def _other_batch(program: SplitProgram) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(11)
    inputs = []
    for name in program.model_inputs:
        spec = program.values[name]
        shape = list(spec.shape)
        shape[spec.batch_dim] = OTHER_ROWS
        assert spec.dtype is not None
        if spec.dtype.is_floating_point:
            inputs.append(torch.randn(shape, generator=generator, dtype=spec.dtype))
        else:
            inputs.append(torch.randint(0, 8, shape, generator=generator, dtype=spec.dtype))
    return tuple(inputs)


def _ranks(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    return run_scenarios({"tied": lambda: _tied_lm_scenario(rank, store_dir),
                          "bn": lambda: _batch_norm_scenario(rank, store_dir)}, rank, world_size, store_dir, "export")


@pytest.mark.multiprocess
def test_exported_pipeline_stages_reproduce_the_trained_model_with_torch_alone(tmp_path: Path) -> None:
    results = run_ranks(_ranks, sum(REPLICAS), tmp_path)
    assert all(result == {"tied": None, "bn": None} for result in results[1:])
    tied, batch_norm = results[0]["tied"], results[0]["bn"]
    assert tied["trained_moved"] and batch_norm["trained_moved"]  # the export holds trained weights
    names = ("tied", "bn-train", "bn-eval")
    checks = {"tied": tied["tied"], "bn-train": batch_norm["bn-train"], "bn-eval": batch_norm["bn-eval"]}
    for name, check in checks.items():
        assert check["num_stages"] == len(REPLICAS), name
        assert check["output_diff"] < 1e-5 and check["buffer_diff"] < 1e-6, (name, check)
    expected = {name: torch.load(tmp_path / f"{name}.expected.pt", weights_only=True) for name in names}
    arguments = []
    for name in names:
        torch.save(expected[name]["inputs"], tmp_path / f"{name}.inputs.pt")
        arguments += [str(tmp_path / name), str(tmp_path / f"{name}.inputs.pt")]
    completed = subprocess.run([sys.executable, "-I", "-c", TORCH_ALONE, *arguments], cwd=tmp_path,
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    alone = torch.load(tmp_path / "torch_alone_results.pt", weights_only=True)
    for name in names:
        for actual, wanted in zip(alone[str(tmp_path / name)]["outputs"], expected[name]["outputs"], strict=True):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5, msg=name)
    trained_buffers = alone[str(tmp_path / "bn-train")]["buffers"]  # train mode: running statistics updated
    assert sorted(trained_buffers) == sorted(expected["bn-train"]["buffers"])
    for module_path, tensor in trained_buffers.items():
        torch.testing.assert_close(tensor, expected["bn-train"]["buffers"][module_path], msg=module_path)
