"""Honest predictions: measured block costs by default where the devices are here, agreed by every rank; labels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.block_costs import agreed_costs, measure_block_costs
from fxpipe.core import meta
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.costgraph import Affine
from fxpipe.job_costs import STRETCH_NOTE
from fxpipe.passes.profile import BlockTime, MeasuredCosts
from fxpipe.planning import COSTS_ENV, default_costs, plan_model
from tests.mp_utils import join_world, leave_world, run_ranks

BATCH = 8


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 4))
    return model, (torch.randn(4, 8),)


def _loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, targets)


def test_agreed_costs_are_the_median_work_times_the_median_stretch_refitted() -> None:
    local = MeasuredCosts(blocks=(BlockTime("a", ("x",), Affine(1.0, 0.0), Affine(1.0, 0.0)),
                                  BlockTime("b", ("y",), Affine(1.0, 0.0), Affine(1.0, 0.0))), batch_sizes=(2, 8))
    # per rank: (stretch, per block (forward at 2 rows, forward at 8, backward at 2, backward at 8) in seconds)
    # and the optimizer step's seconds per parameter byte
    figures = [(3.0, 1e-9, [(0.002, 0.008, 0.004, 0.016), (0.010, 0.010, 0.001, 0.001)]),
               (1.0, 5e-9, [(0.004, 0.010, 0.006, 0.022), (0.030, 0.030, 0.003, 0.003)]),
               (2.0, 2e-9, [(0.100, 0.200, 0.008, 0.020), (0.020, 0.020, 0.002, 0.002)])]
    agreed = agreed_costs(local, figures, slowdown=4.0)
    first, second = agreed.blocks
    # medians 0.004/0.010 and 0.006/0.020, times the median stretch 2 over the slowdown 4: halved
    assert first.forward_s.at(2) == pytest.approx(0.002) and first.forward_s.at(8) == pytest.approx(0.005)
    assert first.backward_s.at(2) == pytest.approx(0.003) and first.backward_s.at(8) == pytest.approx(0.010)
    assert second.forward_s == Affine(pytest.approx(0.010), pytest.approx(0.0))  # type: ignore[arg-type]
    assert second.backward_s.at(8) == pytest.approx(0.001)
    assert (first.name, first.node_names, agreed.stretch) == ("a", ("x",), 2.0)
    assert agreed.optimizer_s_per_param_byte == pytest.approx(1e-9)  # median 2e-9, halved
    assert agreed_costs(local, list(reversed(figures)), slowdown=4.0) == agreed  # rank order does not matter
    with pytest.raises(AssertionError, match="block counts"):
        agreed_costs(local, [(1.0, 0.0, figures[0][2][:1])], slowdown=1.0)


def test_auto_costs_measure_local_clusters_only_and_the_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    local, preset = parse_cluster("local:2", calibrate=False), parse_cluster("dapple-a")
    monkeypatch.delenv(COSTS_ENV, raising=False)
    assert (default_costs(local), default_costs(preset)) == ("measured", "analytic")
    assert default_costs(preset, devices_here=True) == "measured"
    monkeypatch.setenv(COSTS_ENV, "analytic")
    assert default_costs(local) == "analytic"
    monkeypatch.setenv(COSTS_ENV, "fast")
    with pytest.raises(ValueError, match="FXPIPE_COSTS"):
        default_costs(local)


def test_plan_model_labels_its_cost_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(COSTS_ENV, raising=False)
    model, example_inputs = _mlp()
    local = parse_cluster("local:2", calibrate=False)
    measured = plan_model(model, example_inputs, cluster=local, global_batch_size=BATCH, layout="dp")
    analytic = plan_model(model, example_inputs, cluster=local, global_batch_size=BATCH, layout="dp",
                          costs="analytic")
    remote = plan_model(model, example_inputs, cluster="dapple-b", global_batch_size=16, layout="dp")
    assert measured.predicted is not None and analytic.predicted is not None and remote.predicted is not None
    assert (measured.predicted.cost_source, analytic.predicted.cost_source, remote.predicted.cost_source) == \
        ("measured", "analytic", "analytic")
    assert json.loads(remote.to_json())["predicted"]["cost_source"] == "analytic"
    assert type(remote).from_json(remote.to_json()) == remote


def test_cli_plan_labels_analytic_figures_in_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.cli import main

    monkeypatch.delenv(COSTS_ENV, raising=False)
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-mini", "--cluster", "dapple-b", "--global-batch", "32", "--json", str(out)]) == 0
    assert "cost source: analytic (device model, not measured" in capsys.readouterr().out
    assert json.loads(out.read_text())["predicted"]["cost_source"] == "analytic"
    assert main(["plan", "gpt-mini", "--cluster", "local:2", "--global-batch", "8", "--layout", "dp",
                 "--json", str(out)]) == 0
    assert "cost source: measured" in capsys.readouterr().out
    assert json.loads(out.read_text())["predicted"]["cost_source"] == "measured"
    assert main(["plan", "gpt-mini", "--cluster", "local:2", "--global-batch", "8", "--costs", "analytic",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["predicted"]["cost_source"] == "analytic"


def test_measuring_estimate_is_every_block_at_both_batch_sizes_per_sweep() -> None:
    from fxpipe.core.chain import Block, CostChain
    from fxpipe.planning import MEASURING_BATCH_SIZES, MEASURING_SWEEPS, affordable_costs, measuring_seconds

    blocks = tuple(Block(f"b{i}", (f"n{i}",), Affine(0.01, 0.001), Affine(0.02, 0.002), 4) for i in range(3))
    chain = CostChain(blocks, (Affine(0, 0),) * 2)
    per_block = sum(0.01 + 0.001 * rows + 0.02 + 0.002 * rows for rows in MEASURING_BATCH_SIZES)
    assert measuring_seconds(chain) == pytest.approx(MEASURING_SWEEPS * 3 * per_block)
    assert affordable_costs(chain) == ("measured", "")
    source, note = affordable_costs(chain, on_meta=True)
    assert source == "analytic" and "meta device" in note
    slow = CostChain(tuple(Block(b.name, b.node_names, Affine(10.0, 0), Affine(10.0, 0), 4) for b in blocks),
                     chain.cut_bytes)
    source, note = affordable_costs(slow)
    assert source == "analytic" and f"about {measuring_seconds(slow):.0f} s" in note and "--costs measured" in note


def test_auto_costs_fall_back_to_analytic_for_meta_models_and_over_the_budget(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from fxpipe import planning
    from fxpipe.cli import main

    monkeypatch.delenv(COSTS_ENV, raising=False)
    model, example_inputs = _mlp()
    local = parse_cluster("local:2", calibrate=False)
    plan = plan_model(model.to("meta"), tuple(v.to("meta") for v in example_inputs), cluster=local,
                      global_batch_size=BATCH, layout="dp")
    assert plan.predicted is not None and plan.predicted.cost_source == "analytic"
    assert any("meta device" in note for note in plan.notes)
    monkeypatch.setattr(planning, "MEASURING_BUDGET_S", 0.0)
    assert main(["plan", "mlp", "--cluster", "local:2", "--global-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "cost source: analytic" in out and "note: costs=auto: measuring every block here would take" in out
    assert main(["plan", "mlp", "--cluster", "local:2", "--global-batch", "8", "--costs", "measured"]) == 0
    assert "cost source: measured" in capsys.readouterr().out


def test_measuring_leaves_the_random_state_alone() -> None:
    model, example_inputs = _mlp()
    from fxpipe import passes

    graph_module = passes.annotate_costs(passes.trace(model, example_inputs))
    before = torch.get_rng_state()
    costs = measure_block_costs(graph_module, graph_module.meta[meta.EXAMPLE_INPUTS], slowdown=1.0)
    assert costs is not None and len(costs.blocks) >= 1 and costs.optimizer_s_per_param_byte > 0
    assert torch.equal(torch.get_rng_state(), before)  # dropout draws while measuring do not shift training's
    with pytest.raises(ValueError, match="slowdown"):
        measure_block_costs(graph_module, graph_module.meta[meta.EXAMPLE_INPUTS], slowdown=0.5)


def _ranks_agree(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    import os

    import torch.distributed as dist

    from fxpipe import passes
    from fxpipe.runtime.calibration.calibrate_measure import measure_job_collective

    os.environ.pop(COSTS_ENV, None)  # the default path, as a user's script gets it
    model, example_inputs = _mlp()
    inputs, targets = torch.randn(BATCH, 8), torch.randint(0, 4, (BATCH,))
    results: dict[str, Any] = {}
    join_world(store_dir, "measured", rank, world_size)
    try:
        graph_module = passes.annotate_costs(passes.trace(model, example_inputs))
        costs = measure_block_costs(graph_module, graph_module.meta[meta.EXAMPLE_INPUTS], slowdown=1.0)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, costs)
        results["costs_equal"] = all(item == gathered[0] for item in gathered)
        pipe = fxpipe.compile(model, example_inputs, loss_fn=_loss, global_batch_size=BATCH, plan="auto")
        results["default"] = pipe.plan.to_json()
        results["notes"] = pipe.plan.notes
        results["collective"] = measure_job_collective(torch.device("cpu"))
        pipe.step(inputs, targets)  # the measured plan trains
        model = _mlp()[0]  # the measured plan may have sharded or split the first one's weights in place
        analytic = fxpipe.compile(model, example_inputs, loss_fn=_loss, global_batch_size=BATCH, plan="dp",
                                  costs="analytic")
        results["analytic"] = analytic.plan.predicted.cost_source if analytic.plan.predicted else None
        try:
            fxpipe.compile(model, example_inputs, loss_fn=_loss, global_batch_size=BATCH, costs="guessed")
        except ValueError as error:
            results["bad"] = str(error)
    finally:
        leave_world()
    return results


def test_every_rank_measures_and_plans_alike(tmp_path: Path) -> None:
    results = run_ranks(_ranks_agree, 2, tmp_path)
    assert all(result["costs_equal"] for result in results)
    assert results[0]["default"] == results[1]["default"]  # the same plan bytes on every rank
    assert json.loads(results[0]["default"])["predicted"]["cost_source"] == "measured"
    assert any(note.startswith(STRETCH_NOTE.split("{")[0]) for note in results[0]["notes"])
    # the job's own allreduce over both ranks, the same figures on each, planned with as the collective link
    collective = [note for note in results[0]["notes"] if note.startswith("allreduce over the job's 2 ranks measured")]
    assert len(collective) == 1 and results[0]["notes"] == results[1]["notes"]
    assert results[0]["collective"] == results[1]["collective"]
    latency_s, bandwidth = results[0]["collective"]
    assert 0 <= latency_s < 1 and bandwidth > 0
    assert [result["analytic"] for result in results] == ["analytic", "analytic"]
    assert all("costs='guessed'" in result["bad"] and "analytic" in result["bad"] for result in results)


def test_fxpipe_plan_measures_a_local_gpu_cluster_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from fxpipe.core.cluster import H200_141GB, cpu_device
    from fxpipe.planning import measuring_device

    local = parse_cluster("local:2", calibrate=False)  # a GPU machine's local: maps its GPUs to a preset
    local_cpu = replace(local, device=cpu_device(local.device.memory_bytes))  # both built: CPU ranks and GPUs, anywhere
    local_gpu = replace(local, device=H200_141GB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert (measuring_device(local_gpu), measuring_device(local_cpu), measuring_device(parse_cluster("dgx-h100:1"))) \
        == ("cuda", "cpu", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert measuring_device(local_gpu) == "cpu"


def test_ring_allreduce_fit_inverts_the_ring_formula_and_job_costs_plan_with_it() -> None:
    from dataclasses import replace

    from fxpipe.core.cluster import Cluster, LinkSpec, parse_cluster
    from fxpipe.job_costs import JobCosts
    from fxpipe.passes.profile import MeasuredCosts
    from fxpipe.runtime.calibration.calibrate_measure import ring_allreduce_fit

    base = parse_cluster("2x4:v100")
    for num_ranks in (2, 3, 8):
        link = LinkSpec(3e9, 2e-4)
        net = replace(base, intra_host_collective=link, inter_host_collective=link)
        devices = list(range(num_ranks))
        small, large = (56, net.allreduce_time(56, devices)), (2**22, net.allreduce_time(2**22, devices))
        latency_s, bandwidth = ring_allreduce_fit(num_ranks, small, large)
        assert latency_s == pytest.approx(2e-4, rel=1e-9) and bandwidth == pytest.approx(3e9, rel=1e-9)
    # noise: a large allreduce no slower than the small one gives a huge bandwidth, never a negative time
    assert ring_allreduce_fit(2, (56, 1e-3), (2**22, 1e-3))[1] > 1e12
    assert ring_allreduce_fit(2, (2**10, 1e-9), (2**22, 1.0))[0] == 0.0
    with pytest.raises(ValueError, match="at least 2 ranks"):
        ring_allreduce_fit(1, (56, 1e-3), (2**22, 1e-2))
    with pytest.raises(ValueError, match="must carry more"):
        ring_allreduce_fit(2, (2**22, 1e-3), (56, 1e-2))
    measured = MeasuredCosts(blocks=(), batch_sizes=(2, 8), device="cpu", optimizer_s_per_param_byte=1e-9)
    one_host: Cluster = replace(base, num_hosts=1)
    costs = JobCosts("measured", measured, None, (4, 5e-4, 2e9))
    planned = costs.planning_cluster(one_host)
    assert planned.intra_host_collective == LinkSpec(2e9, 5e-4) and planned.optimizer_s_per_param_byte == 1e-9
    assert planned.inter_host_collective == one_host.inter_host_collective
    assert costs.planning_cluster(base).inter_host_collective == LinkSpec(2e9, 5e-4)
    assert JobCosts("analytic").planning_cluster(base) == base


@pytest.mark.parametrize("costs", ["analytic", "measured"])
def test_compile_traces_the_model_once_for_costs_planning_and_codegen(costs: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph compile traces is the one costed, measured and planned (an export trace of a Hugging Face model
    takes seconds; the planner traced it again, and the measured costs a third time)."""
    import fxpipe.passes.tracing as tracing

    calls: list[str] = []
    frontends = tracing._run_frontends

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(costs)
        return frontends(*args, **kwargs)

    monkeypatch.setattr(tracing, "_run_frontends", counted)
    model, example_inputs = _mlp()
    pipe = fxpipe.compile(model, example_inputs, loss_fn=_loss, global_batch_size=BATCH, plan="dp", costs=costs)
    try:
        assert pipe.plan.predicted is not None and pipe.plan.predicted.cost_source == costs
        assert len(calls) == 1, calls
        loss = pipe.step((torch.randn(BATCH, 8),), torch.randint(0, 4, (BATCH,)))
        assert loss > 0
    finally:
        pipe.close()
