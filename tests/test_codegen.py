"""Split zoo models into stages: chained stages match the eager model (outputs and grads), routing, export."""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

import fxpipe.models as zoo
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.program import SplitProgram, tree_leaves
from fxpipe.passes.codegen import CodegenError, split_for_plan, split_stages
from fxpipe.passes.codegen_io import ProgramFileError, export_program, load_program
from fxpipe.passes.tracing import trace

torch.set_num_threads(1)

ZOO_MODELS = ("mlp", "skipnet", "tied-lm", "gpt-mini")


@functools.cache
def _zoo(name: str) -> tuple[nn.Module, tuple[Any, ...], fx.GraphModule]:
    model, example_inputs = zoo.build(name, **zoo.get(name).tiny_overrides)
    model.eval()  # no dropout: eager and split runs must see identical randomness-free math
    return model, example_inputs, trace(model, example_inputs)


def _computing(gm: fx.GraphModule) -> list[str]:
    return [node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output", "get_attr")]


def _cut(gm: fx.GraphModule, fractions: Sequence[float]) -> list[list[str]]:
    """Stages of consecutive computing nodes, cut at the given fractions of the node list."""
    names = _computing(gm)
    bounds = [0, *(max(1, round(f * len(names))) for f in fractions), len(names)]
    return [names[start:stop] for start, stop in zip(bounds, bounds[1:], strict=False)]


def _eager_leaves(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, tuple | list):
        return [leaf for item in output for leaf in _eager_leaves(item)]
    if isinstance(output, dict):
        return [leaf for item in output.values() for leaf in _eager_leaves(item)]
    return []


def _loss(leaves: Sequence[Any]) -> torch.Tensor:
    """A fixed pseudo-random weighting of every floating output, so each output element gets its own grad."""
    total = torch.zeros(())
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            weights = torch.linspace(-1.0, 1.0, leaf.numel()).reshape(leaf.shape) * (index + 1)
            total = total + (leaf * weights).sum()
    return total


def _run_stagewise(program: SplitProgram, inputs: Sequence[Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Run stages as separate 'ranks' (own module copies, detached boundaries), then backward stage by stage.

    Returns every value by name and the parameter gradients by original name, tie groups summed.
    """
    modules = [copy.deepcopy(stage.module) for stage in program.stages]
    values: dict[str, Any] = dict(zip(program.model_inputs, inputs, strict=True))
    received: list[dict[str, torch.Tensor]] = []
    produced: list[dict[str, Any]] = []
    for stage, module in zip(program.stages, modules, strict=True):
        arguments = {}
        for name in stage.input_values:
            value = values[name]
            if program.values[name].requires_grad and program.producers[name] >= 0:
                value = value.detach().requires_grad_(True)
            arguments[name] = value
        outputs = module(*arguments.values())
        assert isinstance(outputs, tuple) and len(outputs) == len(stage.output_values)
        received.append({name: value for name, value in arguments.items() if isinstance(value, torch.Tensor) and value.requires_grad})
        produced.append(dict(zip(stage.output_values, outputs, strict=True)))
        values.update(produced[-1])
    leaves = [values[name] for name in tree_leaves(program.output_tree)]
    grads: dict[str, torch.Tensor] = {}
    for stage_index in reversed(range(program.num_stages)):
        pairs = _stage_backward_pairs(program, stage_index, produced[stage_index], leaves, received, grads)
        if pairs:
            torch.autograd.backward([tensor for tensor, _ in pairs], [grad for _, grad in pairs])
        for name, tensor in received[stage_index].items():
            grads[f"value:{stage_index}:{name}"] = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
    return values, _param_grads(program, modules)


def _stage_backward_pairs(
    program: SplitProgram,
    stage_index: int,
    produced: dict[str, Any],
    leaves: list[Any],
    received: list[dict[str, torch.Tensor]],
    grads: dict[str, torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pairs = []
    if stage_index == program.num_stages - 1:
        loss = _loss(leaves)
        if loss.requires_grad:
            pairs.append((loss, torch.ones(())))
    for name, tensor in produced.items():
        if program.producers[name] != stage_index:
            continue  # an output leaf passed through the last stage: its own sender handles its gradient
        if not program.values[name].requires_grad:
            assert not (isinstance(tensor, torch.Tensor) and tensor.requires_grad and stage_index < program.num_stages - 1)
            continue
        assert tensor.requires_grad, f"{name} is marked requires_grad but the stage output is not"
        sent_back = [grads[f"value:{reader}:{name}"] for reader in program.consumers[name]]
        if sent_back:
            pairs.append((tensor, functools.reduce(torch.add, sent_back)))
    return pairs


def _param_grads(program: SplitProgram, modules: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    grads: dict[str, torch.Tensor] = {}
    for stage, module in zip(program.stages, modules, strict=True):
        seen: set[int] = set()
        for path, original in stage.param_names:
            tensor = module.get_parameter(path) if path in dict(module.named_parameters(remove_duplicate=False)) else None
            if tensor is None or tensor.grad is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            grads[original] = grads[original] + tensor.grad if original in grads else tensor.grad.clone()
    return grads


def _eager(model: nn.Module, inputs: Sequence[Any]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    leaves = _eager_leaves(model(*inputs))
    _loss(leaves).backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad(set_to_none=True)
    return leaves, grads


CUTS = {2: [(0.5,), (0.15,)], 3: [(0.33, 0.66)], 4: [(0.15, 0.3, 0.9)]}
CASES = [(name, cuts) for name in ZOO_MODELS for variants in CUTS.values() for cuts in variants]


@pytest.mark.parametrize(("name", "fractions"), CASES)
def test_chained_stages_match_eager_outputs_and_gradients(name: str, fractions: tuple[float, ...]) -> None:
    model, inputs, gm = _zoo(name)
    program = split_stages(gm, _cut(gm, fractions))
    assert program.num_stages == len(fractions) + 1
    values, grads = _run_stagewise(program, inputs)
    split_leaves = [values[leaf] for leaf in tree_leaves(program.output_tree)]
    with torch.no_grad():
        traced_leaves = _eager_leaves(gm(*inputs))
    for split_leaf, traced_leaf in zip(split_leaves, traced_leaves, strict=True):
        torch.testing.assert_close(split_leaf, traced_leaf, rtol=0, atol=0)  # same ops, same order: bit-exact
    eager_leaves, eager_grads = _eager(model, inputs)
    for split_leaf, eager_leaf in zip(split_leaves, eager_leaves, strict=True):
        torch.testing.assert_close(split_leaf, eager_leaf)
    assert sorted(grads) == sorted(eager_grads)
    for param_name, eager_grad in eager_grads.items():
        torch.testing.assert_close(grads[param_name], eager_grad, rtol=1e-5, atol=1e-6, msg=param_name)


def test_every_stage_returns_a_tuple_and_last_stage_returns_all_output_leaves() -> None:
    _, _, gm = _zoo("skipnet")
    program = split_stages(gm, _cut(gm, (0.3, 0.6)))
    assert program.stages[-1].output_values == tuple(dict.fromkeys(tree_leaves(program.output_tree)))
    for stage in program.stages:
        assert stage.module.graph.find_nodes(op="output")[0].args[0].__class__ is tuple


def test_skip_value_goes_straight_to_the_far_stage() -> None:
    _, _, gm = _zoo("skipnet")
    program = split_stages(gm, _cut(gm, (0.25, 0.5, 0.75)))
    far = {name: readers for name, readers in program.consumers.items() if readers and program.producers[name] >= 0 and max(readers) > program.producers[name] + 1}
    assert far, "skipnet cut in 4 should have a value read two stages later"
    for name, readers in far.items():
        producer = program.producers[name]
        assert name in program.stages[producer].output_values
        for stage in program.stages[producer + 1 :]:
            assert (name in stage.input_values) == (stage.stage_index in readers)
            assert name not in stage.output_values or stage.stage_index == program.num_stages - 1


def test_model_inputs_are_inputs_of_every_stage_that_reads_them() -> None:
    class ReadsInputTwice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(3, 3)
            self.second = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.first(x) + bias
            return h, self.second(h) * x

    gm = fx.symbolic_trace(ReadsInputTwice())
    inputs = (torch.randn(4, 3), torch.randn(3))
    program = split_stages(gm, [["first", "add"], ["second", "mul"]], example_inputs=inputs)
    assert program.stages[0].input_values == ("x", "bias")
    assert program.stages[1].input_values == ("x", "add")  # add: skip to output and input of stage 1
    assert program.stages[1].output_values == ("add", "mul")  # earlier output leaf passed through
    assert program.producers["x"] == -1 and program.consumers["x"] == (0, 1)
    assert program.values["bias"].batched is False and program.values["x"].batched is True
    assert program.values["x"].requires_grad is False and program.values["add"].requires_grad is True
    values, _ = _run_stagewise(program, inputs)
    expected = gm(*inputs)
    torch.testing.assert_close((values["add"], values["mul"]), expected, rtol=0, atol=0)


def test_tied_embedding_and_head_form_a_tie_group() -> None:
    _, _, gm = _zoo("tied-lm")
    program = split_stages(gm, _cut(gm, (0.5,)))
    assert program.tie_groups == (("embedding.weight", (0, 1)),)
    for stage in program.stages:
        assert "embedding.weight" in dict(stage.param_names).values()
    gpt_program = split_stages(_zoo("gpt-mini")[2], _cut(_zoo("gpt-mini")[2], (0.3, 0.6)))
    assert gpt_program.tie_groups == (("wte.weight", (0, 2)),)


def test_generated_code_is_readable_with_value_names_and_model_paths() -> None:
    _, _, gm = _zoo("gpt-mini")
    program = split_stages(gm, _cut(gm, (0.5,)))
    second = program.stages[1]
    signature = f"def forward(self, {', '.join(second.input_values)})"
    assert signature in second.module.code
    paths = [path for path, _ in program.stages[0].param_names]
    assert "h.0.attn.c_attn.weight" in paths and all(path == original for path, original in program.stages[0].param_names)
    assert program.stages[0].module.get_parameter("h.0.attn.c_attn.weight") is gm.get_parameter("h.0.attn.c_attn.weight")


def test_value_specs_shapes_batching_and_non_tensors() -> None:
    _, inputs, gm = _zoo("gpt-mini")
    program = split_stages(gm, _cut(gm, (0.5,)))
    batch = inputs[0].shape[0]
    crossing = [spec for name, spec in program.values.items() if program.producers[name] == 0]
    assert crossing and all(spec.is_tensor for spec in crossing if spec.batched)
    for spec in crossing:
        if spec.is_tensor:
            assert spec.batched == (spec.shape[:1] == (batch,))
        else:
            assert spec.dtype is None and not spec.requires_grad
    (token_input,) = program.model_inputs
    assert program.values[token_input].dtype == torch.int64 and not program.values[token_input].requires_grad


def test_split_is_deterministic() -> None:
    _, _, gm = _zoo("skipnet")
    first = split_stages(gm, _cut(gm, (0.3, 0.6)))
    second = split_stages(gm, _cut(gm, (0.3, 0.6)))
    assert [stage.module.code for stage in first.stages] == [stage.module.code for stage in second.stages]
    assert first.values == second.values and dict(first.consumers) == dict(second.consumers)


def test_split_does_not_modify_the_graph() -> None:
    _, _, gm = _zoo("tied-lm")
    before = (gm.code, [dict(node.meta) for node in gm.graph.nodes])
    split_stages(gm, _cut(gm, (0.5,)))
    assert (gm.code, [dict(node.meta) for node in gm.graph.nodes]) == before


@pytest.mark.parametrize("name", ["tied-lm", "gpt-mini", "skipnet"])
def test_export_load_round_trip_reproduces_outputs(name: str, tmp_path: Path) -> None:
    _, inputs, gm = _zoo(name)
    program = split_stages(gm, _cut(gm, (0.3, 0.7)))
    export_program(program, tmp_path)
    loaded = load_program(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        ["program.json"] + [f"stage_{i}.pt2" for i in range(3)]
    )
    assert loaded.values == program.values and loaded.tie_groups == program.tie_groups
    assert loaded.output_tree == program.output_tree and dict(loaded.consumers) == dict(program.consumers)
    for original, copy_ in zip(program.stages, loaded.stages, strict=True):
        assert (copy_.input_values, copy_.output_values) == (original.input_values, original.output_values)
        assert copy_.param_names == original.param_names
    (tokens,) = inputs
    for rows in (tokens.shape[0], 1, tokens.shape[0] - 1):  # the export example's batch, and other sizes
        batch = (tokens[:rows],)
        expected, _ = _run_stagewise(program, batch)
        actual, grads = _run_stagewise(loaded, batch)
        for leaf in tree_leaves(program.output_tree):
            torch.testing.assert_close(actual[leaf], expected[leaf], rtol=0, atol=0)
        assert grads  # loaded parameters train: they are leaves with requires_grad


def test_export_is_deterministic_and_runs_no_stored_python(tmp_path: Path) -> None:
    _, _, gm = _zoo("tied-lm")
    program = split_stages(gm, _cut(gm, (0.5,)))
    export_program(program, tmp_path / "a")
    export_program(program, tmp_path / "b")
    for file_name in ("program.json", "stage_0.pt2", "stage_1.pt2"):
        assert (tmp_path / "a" / file_name).read_bytes() == (tmp_path / "b" / file_name).read_bytes()
    assert not list((tmp_path / "a").glob("*.py"))
    manifest = json.loads((tmp_path / "a" / "program.json").read_text())
    assert [stage["program_file"] for stage in manifest["stages"]] == ["stage_0.pt2", "stage_1.pt2"]
    assert all(stage["dynamic_batch"] for stage in manifest["stages"])


def test_load_missing_folder_names_the_manifest(tmp_path: Path) -> None:
    with pytest.raises(ProgramFileError, match="program.json"):
        load_program(tmp_path)


def _small() -> fx.GraphModule:
    return fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ([["_0", "_1"]], r"unassigned \['_2'\]"),
        ([["_0", "_1"], ["_1", "_2"]], r"duplicated \['_1 \(stages 0 and 1\)'\]"),
        ([["_0", "_1", "_2", "nope"]], r"unknown \['nope'\]"),
        ([["_0", "_2"], ["_1"]], r"node '_2' on stage 0 reads '_1' computed on later stage 1"),
        ([["_0", "_1", "_2"], []], r"stages \[1\] compute no nodes"),
        ([], "at least one stage"),
    ],
)
def test_bad_stage_assignments_name_the_nodes(stages: list[list[str]], message: str) -> None:
    with pytest.raises(CodegenError, match=message):
        split_stages(_small(), stages, example_inputs=(torch.randn(3, 2),))


def test_missing_example_inputs_says_how_to_get_them() -> None:
    with pytest.raises(CodegenError, match="example_inputs"):
        split_stages(_small(), [["_0", "_1", "_2"]])


def test_split_for_plan_uses_stage_node_names() -> None:
    gm = _small()
    stages = (
        StagePlan(stage_index=0, first_block=0, stop_block=1, replicas=1, devices=(0,), node_names=("_0", "_1")),
        StagePlan(stage_index=1, first_block=1, stop_block=2, replicas=1, devices=(1,), node_names=("_2",)),
    )
    plan = Plan(global_batch_size=4, num_microbatches=2, stages=stages)
    program = split_for_plan(gm, plan, example_inputs=(torch.randn(4, 2),))
    assert [stage.input_values for stage in program.stages] == [("input_1",), ("_1",)]
    empty = Plan(global_batch_size=4, num_microbatches=2, stages=(StagePlan(0, 0, 1, 1, (0,)),))
    with pytest.raises(CodegenError, match="profile file"):
        split_for_plan(gm, empty)


class SplitsThenJoins(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(self.proj(x), 2, dim=1)
        return torch.cat(parts, dim=1) + parts[0].sum(dim=1, keepdim=True)


def test_getitem_of_a_tuple_moves_to_the_stage_computing_the_tuple() -> None:
    gm = fx.symbolic_trace(SplitsThenJoins())
    inputs = (torch.randn(3, 4),)
    program = split_stages(gm, [["proj", "split", "cat"], ["getitem", "sum_1", "add"]], example_inputs=inputs)
    assert program.stages[1].input_values == ("cat", "getitem")
    values, _ = _run_stagewise(program, inputs)
    torch.testing.assert_close(values["add"], gm(*inputs), rtol=0, atol=0)
    with pytest.raises(CodegenError, match=r"value 'split' \(tuple holding tensors\)"):
        split_stages(gm, [["proj", "split"], ["cat", "getitem", "sum_1", "add"]], example_inputs=inputs)


def test_listed_get_attr_nodes_are_still_duplicated_into_their_readers() -> None:
    _, inputs, gm = _zoo("tied-lm")
    stages = _cut(gm, (0.5,))
    stages[0] = [node.name for node in gm.graph.nodes if node.op == "get_attr"] + stages[0]  # as a planner may list them
    program = split_stages(gm, stages)
    assert program.tie_groups == (("embedding.weight", (0, 1)),)
    assert all(program.values[name].is_tensor for name in program.stages[1].input_values)  # no weight is sent
    values, _ = _run_stagewise(program, inputs)
    torch.testing.assert_close(values[program.output_tree], gm(*inputs), rtol=0, atol=0)


def test_meta_device_models_split_without_allocating() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 8))
        inputs = (torch.empty(64, 4096),)
    program = split_stages(fx.symbolic_trace(model), [["_0", "_1"], ["_2"]], example_inputs=inputs)
    assert program.values["_1"].shape == (64, 4096) and program.values["_1"].batched
    assert program.stages[1].module.get_parameter("2.weight").is_meta


class _RowsCrossTheCut(nn.Module):
    """Reads the batch size on one side of a cut and uses it on the other (as HF attention's ``bsz``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x)
        rows = hidden.size(0)
        return self.second(hidden).view(rows, 2, -1)


def test_a_python_value_following_the_rows_may_not_cross_between_other_replica_counts() -> None:
    gm = trace(_RowsCrossTheCut(), (torch.randn(4, 6),))
    names = [node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output", "get_attr")]
    cut = names.index("second") if "second" in names else next(i for i, n in enumerate(names) if "second" in n)
    assert any("size" in name for name in names[:cut]), names  # the row count is read before the cut

    def plan(replicas: tuple[int, int]) -> Plan:
        stages = (StagePlan(0, 0, 1, replicas[0], tuple(range(replicas[0])), tuple(names[:cut])),
                  StagePlan(1, 1, 2, replicas[1], tuple(range(replicas[0], sum(replicas))), tuple(names[cut:])))
        return Plan(global_batch_size=4, num_microbatches=1, stages=stages, planner="test")

    program = split_for_plan(gm, plan((1, 1)))  # equal replica counts: each receiver holds its sender's rows
    crossing = [name for name, spec in program.values.items() if not spec.is_tensor and program.consumers[name]]
    assert crossing, program.values
    with pytest.raises(CodegenError, match=r"follows the batch rows \(4 at the example batch, 5 with one more row\) "
                       r"and crosses from stage 0 \(2 replicas\) to stage 1 \(1 replicas\)"):
        split_for_plan(gm, plan((2, 1)))
