"""torch.distributed.pipelining's own kinds of test model (our versions) compile and train exactly under fxpipe.

Buffers and a tensor default argument crossing a cut, one Parameter and one Linear used in two stages,
MLP stacks with ``pipe_split()`` markers, keyword inputs; ``plan="markers"`` cuts at the markers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import pipe_split

import fxpipe
from fxpipe.core.cluster import parse_cluster
from fxpipe.passes.markers import MarkerError
from fxpipe.planning import plan_markers
from tests.exactness_oracle import coverage_problems, train_and_compare, train_reference
from tests.mp_utils import join_world, leave_world, run_ranks

WIDTH = 8
GLOBAL_BATCH = 8
NUM_STEPS = 2
DEFAULT_SHIFT = torch.full((WIDTH,), 0.5)  # a tensor default argument, as in pipelining's ModelWithKwargs


class BufferModel(nn.Module):
    """Two raw Parameters, a buffer read after the first cut, two Linears; two markers (three stages)."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.mm_param1 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.register_buffer("cval", torch.randn(WIDTH))
        self.lin0 = nn.Linear(WIDTH, WIDTH)
        self.lin1 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.mm(x, self.mm_param0))
        skip = x
        pipe_split()
        x = self.lin0(torch.mm(x, self.mm_param1)) + self.cval
        pipe_split()
        return self.lin1(torch.relu(x) + skip)


class KwargsModel(nn.Module):
    """A keyword-only input and a tensor default argument that is read after the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(WIDTH, WIDTH)
        self.lin1 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, shift: torch.Tensor = DEFAULT_SHIFT, *, scale: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.lin0(x)) * scale
        pipe_split()
        return self.lin1(x + shift)


class AliasModel(nn.Module):
    """One Parameter and one Linear, each used on both sides of the marker (pipelining's ModelWithParamAlias)."""

    def __init__(self) -> None:
        super().__init__()
        self.mm_param0 = self.mm_param1 = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)
        self.lin0 = self.lin1 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin0(torch.relu(torch.mm(x, self.mm_param0)))
        pipe_split()
        return self.lin1(torch.relu(torch.mm(x, self.mm_param1)))


class MultiMLP(nn.Module):
    """A stack of MLP blocks with ``pipe_split()`` after every block but the last (pipelining's MultiMLP)."""

    def __init__(self, num_layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH)) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index < len(self.layers) - 1:
                pipe_split()
        return x


def _kwargs_inputs(rows: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, WIDTH, generator=generator),
            "scale": torch.rand(rows, 1, generator=generator) + 0.5}


def _plain_inputs(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


# (name, model class, inputs(rows, seed), plan, stages the markers make)
CASES: list[tuple[str, Callable[[], nn.Module], Callable[[int, int], Any], str, int]] = [
    ("buffer", BufferModel, _plain_inputs, "markers", 3),
    ("kwargs", KwargsModel, _kwargs_inputs, "markers", 2),
    ("kwargs-layout", KwargsModel, _kwargs_inputs, "2:2", 2),  # keyword-only input through the planner
    ("alias", AliasModel, _plain_inputs, "markers", 2),
    ("multi-mlp", MultiMLP, _plain_inputs, "markers", 4),
    ("multi-mlp-auto", MultiMLP, _plain_inputs, "1:1:2", 3),
]


def _loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, targets)


def _train_case(make: Callable[[], nn.Module], make_inputs: Callable[[int, int], Any], plan: str,
                batches: list[tuple[Any, torch.Tensor]]) -> dict[str, Any]:
    torch.manual_seed(0)
    reference = train_reference(make(), _loss, batches)
    torch.manual_seed(0)
    model = make()
    pipe = fxpipe.compile(model, make_inputs(GLOBAL_BATCH, 0), loss_fn=_loss, global_batch_size=GLOBAL_BATCH,
                          plan=plan, num_microbatches=4)
    result = train_and_compare(pipe, batches, reference)  # the README loop, on every rank
    record = {"losses": result["losses"], "reference": reference["losses"], "problems": result["problems"],
              "layout": pipe.plan.layout, "names": result["names"], "all_names": sorted(reference["params"])}
    pipe.close()
    return record


def _all_cases(rank: int, world_size: int, store_dir: str) -> dict[str, dict[str, Any]]:
    records = {}
    for index, (name, make, make_inputs, plan, _) in enumerate(CASES):
        batches = [(make_inputs(GLOBAL_BATCH, 10 + step), _plain_inputs(GLOBAL_BATCH, 20 + step))
                   for step in range(NUM_STEPS)]
        join_world(store_dir, f"case-{index}", rank, world_size)
        try:
            records[name] = _train_case(make, make_inputs, plan, batches)
        finally:
            leave_world()
    return records


@pytest.mark.multiprocess
def test_pipelining_models_train_like_one_process(tmp_path: Any) -> None:
    per_rank = run_ranks(_all_cases, 4, tmp_path, timeout_s=300.0)
    failures = []
    for name, _, _, plan, num_stages in CASES:
        records = [ranks[name] for ranks in per_rank]
        layouts = {r["layout"] for r in records}
        if len(layouts) != 1 or len(next(iter(layouts)).split(":")) != num_stages:
            failures.append(f"{name}: layouts {layouts}, expected {num_stages} stages ({plan})")
        failures += [f"{name}: {p}" for r in records for p in r["problems"]]
        if any(not r["names"] for r in records):
            failures.append(f"{name}: a rank holds no parameters")
        failures += [f"{name}: {p}" for p in coverage_problems([r["names"] for r in records], records[0]["all_names"])]
        if {tuple(r["losses"]) for r in records} != {tuple(records[0]["losses"])}:
            failures.append(f"{name}: ranks disagree on the loss")
        if not torch.allclose(torch.tensor(records[0]["losses"]), torch.tensor(records[0]["reference"]), rtol=1e-5):
            failures.append(f"{name}: losses {records[0]['losses']} != reference {records[0]['reference']}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name, make, make_inputs, plan, num_stages", CASES[:4])
def test_markers_fix_the_cuts(name: str, make: Callable[[], nn.Module], make_inputs: Callable[[int, int], Any],
                              plan: str, num_stages: int) -> None:
    model = make()
    planned, chain = plan_markers(model, make_inputs(4, 0), parse_cluster("local:4"), GLOBAL_BATCH)
    assert planned.num_stages == num_stages and planned.planner == "markers"
    assert planned.num_blocks == chain.num_blocks and planned.stages[-1].stop_block == chain.num_blocks


def test_marker_stage_names_follow_the_markers() -> None:
    planned, _ = plan_markers(BufferModel(), _plain_inputs(4, 0), parse_cluster("local:4"), GLOBAL_BATCH)
    parameters = {"mm_param0", "mm_param1", "cval"}  # get_attr nodes go wherever the chain put them
    assert [tuple(n for n in stage.node_names if n not in parameters) for stage in planned.stages] == [
        ("mm", "relu"), ("mm_1", "lin0", "add"), ("relu_1", "add_1", "lin1")]


class NoMarkers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class EmptyMarkedStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin(x)
        pipe_split()
        return torch.relu(x) * 2


@pytest.mark.parametrize("model, message", [(NoMarkers(), "calls no pipe_split"),
                                            (EmptyMarkedStage(), r"stage\(s\) \[1\] no parameters")])
def test_marker_mistakes_are_named(model: nn.Module, message: str) -> None:
    with pytest.raises(MarkerError, match=message):
        plan_markers(model, _plain_inputs(4, 0), parse_cluster("local:4"), GLOBAL_BATCH)


class ExportOnly(nn.Module):
    """Branches on a shape, so torch.fx cannot trace it and the export front end (which keeps the marker
    operator and reads every weight at the top of the graph) does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin0 = nn.Linear(WIDTH, WIDTH)
        self.lin1 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.lin0(x)
        if x.shape[0] > 1:
            x = torch.relu(x)
        pipe_split()
        return self.lin1(x)


def test_markers_and_parameter_cuts_work_on_export_graphs() -> None:
    from fxpipe.passes import trace
    from fxpipe.passes.codegen import split_for_plan
    from fxpipe.planning import plan_model

    model, example_inputs = ExportOnly(), (_plain_inputs(4, 0),)
    graph_module = trace(model, example_inputs)
    assert graph_module.meta["fxpipe.frontend"] == "export"
    marked, _ = plan_markers(model, example_inputs, parse_cluster("local:2"), GLOBAL_BATCH)
    planned = plan_model(model, example_inputs, cluster="local:2", global_batch_size=GLOBAL_BATCH, layout="1:1")
    for plan in (marked, planned):
        program = split_for_plan(graph_module, plan)
        assert [sorted(name for name, _ in stage.module.named_parameters()) for stage in program.stages] == [
            ["lin0.bias", "lin0.weight"], ["lin1.bias", "lin1.weight"]]
