"""The front door's small print: parameter-less stages, forced layouts, keyword inputs, CLI errors and files."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.core.cluster import parse_cluster
from fxpipe.passes import trace
from fxpipe.passes.codegen import split_for_plan
from fxpipe.passes.partition.dapple import LayoutError
from fxpipe.planning import costed_model, plan_chain, plan_model


class SkipMLP(nn.Module):
    """Eight Linear layers with long skips: block i also adds the output of block i - 3."""

    def __init__(self, width: int = 8, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [x]
        for index, layer in enumerate(self.layers):
            value = torch.relu(layer(outputs[-1]))
            if index >= 3:
                value = value + outputs[-3]
            outputs.append(value)
        return outputs[-1].sum(dim=-1) + outputs[1].mean(dim=-1)


class FourLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
                                    nn.Tanh(), nn.Linear(8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.layers(x) * 2.0, dim=-1).log()


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.rnn = cell(8, 8, batch_first=True)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(torch.relu(hidden))


def _stage_parameter_counts(model: nn.Module, example_inputs: tuple[Any, ...], layout: str | None) -> list[int]:
    plan = plan_model(model, example_inputs, cluster="local:4", global_batch_size=16, layout=layout)
    program = split_for_plan(trace(model, example_inputs), plan)
    return [sum(1 for _ in stage.module.parameters()) for stage in program.stages]


@pytest.mark.parametrize("model, example_inputs, layout", [
    (SkipMLP(), (torch.randn(4, 8),), "2:1:1"),
    (SkipMLP(), (torch.randn(4, 8),), "1:1:1:1"),
    (FourLinear(), (torch.randn(4, 4),), "1:1:1"),
    (FourLinear(), (torch.randn(4, 4),), "1:1:1:1"),
    (FourLinear(), (torch.randn(4, 4),), None),
])
def test_every_planned_stage_holds_parameters(model: nn.Module, example_inputs: tuple[Any, ...],
                                              layout: str | None) -> None:
    counts = _stage_parameter_counts(model, example_inputs, layout)
    assert all(count > 0 for count in counts), counts
    if layout is not None:
        assert len(counts) == len(layout.split(":"))


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_forced_layout_deeper_than_the_model_fails_in_the_planner(cell: type[nn.RNNBase]) -> None:
    model = Recurrent(cell)
    with pytest.raises(LayoutError, match=r"has 4 stages but the model has only 3 cuttable block"):
        plan_model(model, (torch.randint(0, 16, (4, 5)),), cluster="local:4", global_batch_size=16,
                   layout="1:1:1:1")
    assert all(count > 0 for count in _stage_parameter_counts(model, (torch.randint(0, 16, (4, 5)),), "1:1:1"))



def test_parameter_groups_join_parameter_less_blocks_to_the_previous_group() -> None:
    from fxpipe.core.chain import SharedParam
    from fxpipe.passes.partition.block_partition import parameter_groups
    from tests.planner_cases import chain

    assert parameter_groups(chain([1.0] * 5, [0, 5, 0, 5, 0])) == [3, 5]
    assert parameter_groups(chain([1.0] * 3, [0, 0, 0])) == [1, 2, 3]  # no parameters: nothing to protect
    tied = chain([1.0] * 4, [5, 0, 0, 0])
    tied = type(tied)(tied.blocks, tied.cut_bytes, shared_params=(SharedParam("wte", 5, (0, 2)),))
    assert parameter_groups(tied) == [2, 4]  # block 2 reads a copy of the tied weight


FACTORY_MODULE = '''
import torch
from torch import nn

import fxpipe


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x, *, scale):
        return self.b(torch.relu(self.a(x)) * scale)


def factory():
    torch.manual_seed(0)
    return Net(), {"x": torch.randn(4, 4), "scale": torch.ones(4, 1)}


def broken():
    return Net()


class Marked(Net):
    def forward(self, x, *, scale):
        from torch.distributed.pipelining import pipe_split

        hidden = torch.relu(self.a(x)) * scale
        pipe_split()
        return self.b(hidden)


def marked():
    return Marked(), {"x": torch.randn(4, 4), "scale": torch.ones(4, 1)}


class SeqFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):  # (T, B, 4): mixes positions along T, rows of B apart
        hidden = torch.relu(self.a(x))
        return self.b(hidden + hidden.mean(0, keepdim=True))


def seq_first():
    return SeqFirst(), (torch.randn(4, 4, 4),)  # T == B == 4: dim 0 or 1 could be the batch
'''


@pytest.fixture
def factory_folder(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A folder holding ``frontdoor_models.py``, as the current directory, and not on sys.path."""
    (tmp_path / "frontdoor_models.py").write_text(FACTORY_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "frontdoor_models", raising=False)
    return tmp_path


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from fxpipe.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_plans_a_factory_from_the_current_folder(factory_folder: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["plan", "frontdoor_models:factory", "--cluster", "local:2", "--global-batch", "8",
                           "--json", "plan.json"], capsys)
    assert (code, err) == (0, "")
    assert "wrote plan.json" in out
    assert fxpipe_plan_model(factory_folder / "plan.json") == "frontdoor_models:factory"


def test_cli_batch_dims_flag_settles_an_ambiguous_batch(factory_folder: Any,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "frontdoor_models:seq_first", "--cluster", "local:2", "--global-batch", "8", "--costs", "analytic"]
    code, _, err = _cli(base, capsys)
    assert code == 2 and "batch_dims" in err, err
    code, out, err = _cli([*base, "--batch-dims", "1"], capsys)
    assert (code, err) == (0, ""), err
    assert "predicted iteration" in out
    code, _, err = _cli([*base, "--batch-dims", "x=one"], capsys)
    assert code == 2 and "'x=one' is not name=dim" in err, err


def test_cli_plans_at_markers_and_the_file_simulates(factory_folder: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(["plan", "frontdoor_models:marked", "--cluster", "local:4", "--global-batch", "8",
                           "--layout", "markers", "--json", "marked.json"], capsys)
    assert (code, err) == (0, ""), err
    assert "planner=markers" in out
    from fxpipe.core.planfile import load_plan_file

    plan, chain, _ = load_plan_file(factory_folder / "marked.json")
    assert plan.num_stages == 2 and chain is not None and plan.num_blocks == chain.num_blocks
    assert _cli(["simulate", "marked.json"], capsys)[0] == 0
    code, _, err = _cli(["plan", "frontdoor_models:marked", "--cluster", "local:4", "--global-batch", "8",
                         "--planner", "markers", "--layout", "2:2"], capsys)
    assert code == 2 and "markers fix the cuts" in err


def fxpipe_plan_model(path: Any) -> str:
    from fxpipe.core.plan import Plan

    return Plan.load(path).model


@pytest.mark.parametrize("argv, message", [
    (["plan", "frontdoor_models:broken", "--global-batch", "8"], "must return (nn.Module, example_inputs), got Net"),
    (["plan", "frontdoor_models:nothing", "--global-batch", "8"], "module 'frontdoor_models' has no 'nothing'"),
    (["plan", "no_such_module:factory", "--global-batch", "8"], "cannot import 'no_such_module'"),
    (["plan", "frontdoor_models:factory", "--global-batch", "8", "--layout", "2-1"], "layout '2-1' is malformed"),
    (["plan", "frontdoor_models:factory", "--global-batch", "8", "--layout", "1:1:1"],
     "has 3 stages but the model has only 2 cuttable block"),
    (["plan", "frontdoor_models:factory", "--global-batch", "8", "--layout", "markers"], "calls no pipe_split"),
    (["plan", "--global-batch", "8"], "give MODEL"),
    (["train", "frontdoor_models:factory"], "give its loss with --loss"),
    (["train", "frontdoor_models:factory", "--loss", "hinge"], "loss 'hinge' is unknown"),
    (["train", "frontdoor_models:factory", "--loss", "mse", "--plan", "2-1"], "plan '2-1' is not 'auto'"),
])
def test_cli_errors_are_one_line_and_exit_2(factory_folder: Any, capsys: pytest.CaptureFixture[str],
                                            argv: list[str], message: str) -> None:
    code, _, err = _cli([*argv, "--cluster", "local:4"] if argv[0] == "plan" else argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(f"fxpipe {argv[0]}: error: "), err
    assert message in err, err


def test_train_rejects_a_plan_file_made_for_another_model(factory_folder: Any,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli(["plan", "mlp", "--cluster", "local:2", "--global-batch", "8", "--json", "mlp.json"], capsys)[0] == 0
    code, _, err = _cli(["train", "frontdoor_models:factory", "--loss", "mse", "--plan", "mlp.json"], capsys)
    assert code == 2 and "was made for model 'mlp', not 'frontdoor_models:factory'" in err, err


def test_compile_names_the_model_a_foreign_plan_was_made_for() -> None:
    from fxpipe.plan_checks import check_plan_matches
    from fxpipe.runtime.faults.errors import PipelineSetupError

    plan = plan_model(SkipMLP(), (torch.randn(4, 8),), cluster="local:2", global_batch_size=8, layout="1:1")
    plan = plan.with_updates(model="skip-mlp")
    check_plan_matches(plan, trace(SkipMLP(), (torch.randn(4, 8),)))
    with pytest.raises(PipelineSetupError, match="the plan was made for model 'skip-mlp'"):
        check_plan_matches(plan, trace(FourLinear(), (torch.randn(4, 4),)))


@pytest.mark.parametrize("text, kind", [("auto", "auto"), ("markers", "markers"), ("3:1", "layout"), ("dp", "layout"),
                                        ("plan.json", "file"), ("runs/plan", "file")])
def test_plan_arguments_are_classified(text: str, kind: str) -> None:
    from fxpipe.core.plan import plan_argument_kind

    assert plan_argument_kind(text) == kind


def test_a_dp_plan_prints_no_speedup_over_dp() -> None:
    from fxpipe.report import format_plan

    plan = plan_model(FourLinear(), (torch.randn(4, 4),), cluster="local:2", global_batch_size=8, layout="dp")
    assert plan.layout == "dp" and "the speed of data parallel" not in format_plan(plan)
    fewer = plan.with_updates(stages=(plan.stages[0].__class__(0, 0, plan.num_blocks, 1, (0,)),), num_devices=2)
    assert "the speed of data parallel" not in format_plan(fewer) and "data parallel on 1 of 2 devices" in format_plan(fewer)
    pipelined = plan_model(FourLinear(), (torch.randn(4, 4),), cluster="local:2", global_batch_size=8,
                           layout="1:1")
    assert "not compared with data parallel" in format_plan(pipelined)


def test_the_plan_report_prints_the_plan_notes() -> None:
    from fxpipe.report import format_plan

    plan = plan_model(FourLinear(), (torch.randn(4, 4),), cluster="local:2", global_batch_size=8, layout="dp")
    noted = plan.with_updates(notes=("a plan on 1 rank is predicted faster", "second note"))
    text = format_plan(noted)
    assert "note: a plan on 1 rank is predicted faster" in text and "note: second note" in text
    assert "note:" not in format_plan(plan.with_updates(notes=()))


def _train_factory(rank: int, world_size: int, store_dir: str) -> int:
    from fxpipe.cli import main
    from tests.mp_utils import join_world, leave_world

    join_world(store_dir, "train-factory", rank, world_size)
    try:
        return main(["train", "frontdoor_models:factory", "--loss", "cross_entropy", "--steps", "2",
                     "--global-batch", "8", "--num-microbatches", "2", "--plan", "1:1", "--quiet"])
    finally:
        leave_world()


@pytest.mark.multiprocess
def test_train_runs_a_factory_with_a_named_loss(factory_folder: Any) -> None:
    from tests.mp_utils import run_ranks

    assert run_ranks(_train_factory, 2, factory_folder) == [0, 0]


def _compile_errors(rank: int, world_size: int, store_dir: str) -> list[str]:
    """Two compiles that must fail on every rank alike: a given plan with a parameter-less stage, and
    plan="markers" for a model without markers (found on rank 0 only)."""
    from tests.mp_utils import compute_nodes, join_world, leave_world, plan_from_cuts

    model, example_inputs = FourLinear(), (torch.randn(4, 4),)
    names = compute_nodes(trace(model, example_inputs))
    plan = plan_from_cuts(trace(model, example_inputs), (1, 1), 8, 2, fractions=[names.index("mul") / len(names)])
    messages = []
    for index, given in enumerate([plan, "markers"]):
        join_world(store_dir, f"compile-error-{index}", rank, world_size)
        try:
            fxpipe.compile(model, example_inputs, loss_fn=torch.nn.functional.mse_loss, global_batch_size=8,
                           plan=given)
            messages.append("compiled")
        except ValueError as error:
            messages.append(str(error))
        finally:
            leave_world()
    return messages


@pytest.mark.multiprocess
def test_compile_mistakes_fail_on_every_rank(tmp_path: Any) -> None:
    from tests.mp_utils import run_ranks

    per_rank = run_ranks(_compile_errors, 2, tmp_path, timeout_s=100.0)
    assert all("plan '1:1' gives stage(s) [1] no parameters" in messages[0] for messages in per_rank), per_rank
    assert all("calls no pipe_split()" in messages[1] for messages in per_rank), per_rank


@pytest.mark.parametrize("model_name", ["skipnet", "tied-lm", "gnmt-16"])
def test_every_planner_gives_every_stage_parameters(model_name: str) -> None:
    from fxpipe import models

    entry = models.get(model_name)
    model, example_inputs = models.build(model_name, **entry.tiny_overrides)
    graph_module = trace(model, example_inputs)
    cluster = parse_cluster("local:4")
    chain = costed_model(model, example_inputs, cluster).chain  # costed once, planned 7 times
    for planner, layout in [("dapple", None), ("dapple", "2:1:1"), ("dapple", "1:1:1:1"), ("pipedream", None),
                            ("gpipe", None), ("uniform", None), ("params", None)]:
        plan = plan_chain(chain, cluster, 16, planner=planner, layout=layout)
        program = split_for_plan(graph_module, plan)
        counts = [sum(1 for _ in stage.module.parameters()) for stage in program.stages]
        assert min(counts) > 0, (planner, layout, plan.layout, counts)


def test_parameter_reads_move_next_to_their_first_reader() -> None:
    from fxpipe.core.costgraph import CostGraph, CostNode
    from fxpipe.planning import parameter_reads_at_first_use

    graph = CostGraph((CostNode("w0", op="get_attr:w0", param_bytes=4), CostNode("w1", op="get_attr:w1", param_bytes=4),
                       CostNode("a", ("w0",)), CostNode("b", ("a",)), CostNode("c", ("b", "w1", "w0"))))
    assert [node.name for node in parameter_reads_at_first_use(graph).nodes] == ["w0", "a", "b", "w1", "c"]
