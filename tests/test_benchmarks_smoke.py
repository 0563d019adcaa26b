"""Smoke runs of the runtime benchmarks at tiny sizes (so they cannot rot) and exact tests of the memory meter."""

from __future__ import annotations

import pytest
import torch

from benchmarks import (
    evaluate_vs_step,
    memory_fidelity,
    new_lengths,
    overhead,
    precision_plans,
    prediction_fidelity,
    runtime_fidelity,
    scale_study,
    schedule_memory,
    sharding_fidelity,
    sharding_study,
    small_fidelity,
    torch_pipelining_common,
    tp_fidelity,
    virtual_schedules,
    vs_torch_pipelining,
    vs_torch_schedules,
)
from benchmarks.bench_common import ActivationMeter, Workload, layer_bounds, layer_cut_stages

TINY = (("n_layer", 4), ("n_embd", 16), ("block_size", 8), ("vocab_size", 32), ("n_head", 2))


def tiny(global_batch_size: int, num_microbatches: int) -> Workload:
    return Workload("gpt-mini", TINY, global_batch_size, num_microbatches)


# ---- the activation meter, exactly ---------------------------------------------------------------------


def test_meter_counts_saved_bytes_and_peak() -> None:
    x = torch.randn(1000, requires_grad=True)  # 4000 bytes
    meter = ActivationMeter()
    with meter.measure():
        y = x.sin()  # saves x
        z = y.exp()  # saves its result z
    assert meter.live_bytes == 8000
    z.sum().backward()
    del y, z
    assert meter.live_bytes == 0
    assert meter.peak_bytes == 8000


def test_meter_counts_a_storage_once_and_skips_parameters() -> None:
    weight = torch.nn.Parameter(torch.randn(10, 10))
    x = torch.randn(4, 10, requires_grad=True)
    meter = ActivationMeter.for_parameters([weight])
    with meter.measure():
        out = (x @ weight) * x  # x saved twice (matmul and mul) -> one storage; weight excluded
        out.sum().backward()
    assert meter.peak_bytes == 4 * 10 * 4 + 4 * 10 * 4  # x once, plus the matmul output saved by mul
    assert meter.live_bytes == 0


def test_meter_releases_bytes_when_the_graph_is_dropped() -> None:
    x = torch.randn(256, requires_grad=True)
    meter = ActivationMeter()
    with meter.measure():
        y = x.sigmoid()  # saves its result
    assert meter.live_bytes == 1024
    del y
    assert meter.live_bytes == 0


# ---- layer cuts ----------------------------------------------------------------------------------------


def test_layer_bounds_are_even_and_checked() -> None:
    assert layer_bounds(4, 2) == [0, 2, 4]
    assert layer_bounds(6, 4) == [0, 2, 3, 4, 6]  # round half to even: blocks 2,1,1,2
    with pytest.raises(ValueError, match="num_stages=5"):
        layer_bounds(4, 5)


def test_layer_cut_stages_put_embeddings_first_and_head_last() -> None:
    from fxpipe.passes import trace

    model, example_inputs = tiny(4, 2).build()
    stages = layer_cut_stages(trace(model, example_inputs), 2)
    assert "wte" in stages[0] and "lm_head" in stages[1] and "ln_f" in stages[1]
    assert all(not name.startswith("h_2") for name in stages[0])
    assert all(not name.startswith("h_1") for name in stages[1])


# ---- each script end to end, tiny --------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_vs_torch_pipelining_smoke() -> None:
    result = vs_torch_pipelining.run(tiny(8, 4), throughput_ranks=2, memory_ranks=2, num_warmup=1, num_steps=1)
    assert result["gradient_gap"] < 1e-5  # both systems compute the same gradients
    assert all(m["fxpipe"] > 0 and m["torch"] > 0 for m in result["memory"])
    assert "Schedule1F1B" in vs_torch_pipelining.report(result)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_vs_torch_schedules_smoke() -> None:
    from benchmarks.bench_common import run_ranks

    per_rank = run_ranks(vs_torch_schedules.compare_rank, 2, tiny(8, 4), 0, 1)
    names = {f"fxpipe {s}" for s in vs_torch_schedules.FX_SCHEDULES} | {
        f"torch {s}" for s in torch_pipelining_common.TORCH_SCHEDULES}
    assert set(per_rank[0]["times"]) == set(per_rank[0]["memory"]) == names
    for memory in (r["memory"] for r in per_rank):  # zero-bubble keeps what early backward keeps
        assert 0 < memory["fxpipe zero_bubble"] == memory["fxpipe early_backward"] < memory["fxpipe gpipe"]
    bubbles = run_ranks(vs_torch_schedules.bubble_rank, 2, tiny(8, 4), 0, 2)
    assert all(0 < busy <= step for r in bubbles for busy, step in r["stats"]["zero_bubble"])
    assert all(r["memory"][s] > 0 for r in bubbles for s in ("early_backward", "zero_bubble"))
    assert vs_torch_schedules.auto_schedule(tiny(8, 4), 2) in vs_torch_schedules.FX_SCHEDULES


@pytest.mark.multiprocess
@pytest.mark.slow
def test_virtual_schedules_smoke_computes_torchs_gradients() -> None:
    """fxpipe's interleaved/ZB-V chunks and torch's ScheduleInterleaved1F1B/ScheduleZBVZeroBubble on the same chunk
    code and map: every rank's gradients agree (the comparison times the same work)."""
    from benchmarks.bench_common import run_ranks

    workload = Workload("gpt-mini", (("n_layer", 8), *TINY[1:]), 8, 4)
    per_rank = run_ranks(virtual_schedules.compare_rank, 4, workload, 0, 1)
    names = {"fxpipe 1F1B (early_backward)", "fxpipe interleaved (v=2)", "fxpipe zbv (v=2)"} | {
        f"torch {name} (v=2)" for name in torch_pipelining_common.TORCH_VIRTUAL_SCHEDULES}
    assert all(set(r["times"]) == names for r in per_rank)
    assert all(gap < 1e-5 for r in per_rank for gap in r["gradient_gaps"].values())


def test_virtual_schedules_simulates_each_schedule_on_the_chunks_it_runs() -> None:
    """The model's gains come from the same cuts the ranks run: chunk block ranges tile the chain, 1F1B's stages are
    each rank's chunks, and a chain cut coarser than the chunks is refused rather than simulated on other cuts."""
    from benchmarks.runtime_fidelity import measured_chain

    workload = Workload("gpt-mini", (("n_layer", 8), *TINY[1:]), 8, 2)
    chain = measured_chain(workload, max_blocks=None)
    chunks = virtual_schedules.chunk_cuts(workload, 4)
    ranges = virtual_schedules.chunk_blocks(chain, chunks)
    assert ranges[0][0] == 0 and ranges[-1][1] == chain.num_blocks
    assert all(stop == first for (_, stop), (first, _) in zip(ranges, ranges[1:], strict=False))
    for (first, stop), names in zip(ranges, chunks, strict=True):
        held = {name for block in chain.blocks[first:stop] for name in block.node_names}
        assert set(names) <= held
    with pytest.raises(ValueError, match="coarser than the chunks"):
        virtual_schedules.chunk_blocks(measured_chain(workload, max_blocks=2), chunks)
    times = virtual_schedules.predicted_times(workload, 2, 2)
    assert set(times) == {"1F1B", "interleaved", "zbv"} and all(t > 0 for t in times.values())


def test_the_torch_benchmarks_share_code_without_importing_each_other() -> None:
    import ast
    from pathlib import Path

    for name, other in (("vs_torch_pipelining", "vs_torch_schedules"), ("vs_torch_schedules", "vs_torch_pipelining")):
        tree = ast.parse((Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py").read_text())
        imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom) for alias in node.names}
        assert not any(other in module for module in imported), f"{name} imports {other}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_schedule_memory_smoke() -> None:
    result = schedule_memory.run(tiny(8, 8), num_warmup=0, num_steps=1)
    stage0 = result["peaks"][0]
    assert 0 < stage0["early backward (A)"] < stage0["GPipe"]
    assert "Stage 0" in schedule_memory.report(result)


@pytest.mark.multiprocess
def test_evaluate_vs_step_smoke() -> None:
    result = evaluate_vs_step.run(tiny(8, 4), num_warmup=0, num_steps=1)
    for stage_peaks in result["peaks"]:
        assert stage_peaks["evaluate"] == 0 < stage_peaks["step"]  # forward only saves nothing for backward
    assert "evaluate / step" in evaluate_vs_step.report(result)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_overhead_smoke() -> None:
    result = overhead.run(tiny(4, 1), num_warmup=1, num_steps=2)
    assert len(result["times"]["fxpipe"]) == len(result["times"]["eager"]) == 2
    assert "fxpipe / eager" in overhead.report(result)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_new_lengths_smoke() -> None:
    case = new_lengths.Case("gpt-mini", (("n_layer", 2), ("n_embd", 16), ("block_size", 64), ("vocab_size", 32),
                                         ("n_head", 2)))
    result = new_lengths.run((case,), num_warmup=1, num_lengths=4)
    formulas, fake = result["rows"]
    assert (formulas["mode"], fake["mode"]) == new_lengths.MODES and formulas["lengths"] == fake["lengths"] == 4
    assert formulas["counts"] == {"template": 4, "symbolic": 0, "fake": 0}  # the warm-up length made the formulas
    assert all(row["new_s"] > 0 and row["repeat_s"] > 0 and row["derive_s"] > 0 for row in result["rows"])
    assert formulas["derive_s"] < fake["derive_s"]  # formulas vs a fake run of every stage
    assert "new / repeat" in new_lengths.report(result)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_runtime_fidelity_smoke() -> None:
    cases = (runtime_fidelity.PlanCase(2, "1:1", 2), runtime_fidelity.PlanCase(2, "1:1", 2, "zero_bubble"))
    result = runtime_fidelity.run(tiny(4, 2), cases, num_warmup=0, num_steps=1, num_rounds=2)
    for row in result["rows"]:
        assert row["simulated_s"] > 0 and row["measured_s"] > 0
        assert len(row["round_errors"]) == 2 and len(row["chain_s"]) == 3  # a chain before, between and after
    eb, zb = result["rows"]
    assert eb["auto"] == zb["auto"] in ("early_backward", "zero_bubble") and eb["allreduce"] == "none"
    [pair] = runtime_fidelity.schedule_pairs(result["rows"])
    assert pair[:3] == ["local:2 1:1 M=2", f"{zb['expected_s'] / eb['expected_s']:.3f}",
                        f"{zb['measured_s'] / eb['measured_s']:.3f}"]
    report = runtime_fidelity.report(result)
    assert "local:2 1:1 M=2 zero_bubble" in report and "auto picks" in report


@pytest.mark.multiprocess
@pytest.mark.slow
def test_prediction_fidelity_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FXPIPE_COSTS", raising=False)  # the default a user's script gets: measured here
    result = prediction_fidelity.run((tiny(4, 2),), (2,), num_rounds=1, num_warmup=0, num_steps=1)
    (row,) = result["rows"]
    assert row["sources"] == ["measured"] and row["predicted_s"] > 0 and row["analytic_s"] > 0
    assert row["iteration_s"] >= row["step_s"] > 0 and len(row["errors"]) == 1
    assert "gpt-mini local:2" in prediction_fidelity.report(result)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_small_fidelity_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FXPIPE_COSTS", raising=False)  # the default a user's script gets: measured here
    monkeypatch.setattr(small_fidelity, "CASES", {2: ((small_fidelity.MLP, "1:1", 2),)})
    result = small_fidelity.run((2,), num_rounds=1, num_warmup=0, num_steps=1)
    (row,) = result["rows"]
    # the suite runs uncalibrated (tests/conftest.py): no fixed-cost figures, so both predictions agree (to the last
    # bits: the planner's simulation and this re-simulation may sum the same terms in another order)
    assert row["predicted_s"] == pytest.approx(row["without_s"], rel=1e-12) and row["without_s"] > 0
    assert row["action_s"] == 0 and row["iteration_s"] > 0
    assert "mlp b=8 1:1 M=2 local:2" in small_fidelity.report(result)


def test_memory_fidelity_runs_tiny(tmp_path) -> None:  # type: ignore[no-untyped-def]
    case = memory_fidelity.Case("gpt-mini", TINY, "1:1", global_batch_size=4, num_microbatches=2)
    text = memory_fidelity.report(memory_fidelity.run((case,), str(tmp_path)))
    assert "predicted / measured" in text and memory_fidelity.COMMAND in text


def test_precision_plans_smoke() -> None:
    case = precision_plans.Case("gpt-mini tiny", precision_plans.zoo("gpt-mini", **dict(TINY)), 16)
    rows = precision_plans.plan_rows(case, ("1x2:h100", "1x2:v100"))
    assert [(row.cluster, row.precision) for row in rows] == [
        ("1x2:h100", "fp32"), ("1x2:v100", "fp32"), ("1x2:h100", "bf16"), ("1x2:v100", "fp16")]
    assert all(row.plan is not None and row.plan.precision == row.precision for row in rows)
    lines = precision_plans.report(rows, 1.0).splitlines()
    assert [line.split("|")[2:4] for line in lines if "gpt-mini tiny" in line] == [
        [" 1x2:h100  ", " bf16  "], [" 1x2:v100  ", " fp16  "]]


def test_sharding_study_smoke() -> None:
    rows = sharding_study.study([("gpt-mini", 16, ("1x2:h100",))], ("1x2:h100",))
    assert [(row.model, row.cluster.name) for row in rows] == [("gpt-mini", "1x2:h100")]
    assert rows[0].unsharded is not None and rows[0].sharded is not None  # a tiny model fits either way
    assert sharding_study.speedup(rows[0]) is not None
    assert "| gpt-mini " in sharding_study.table(rows) and sharding_study.summary(rows)


def test_scale_study_smoke() -> None:
    shape = scale_study.Shape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=96)
    case = scale_study.Case("tiny", shape, 16, "1x4:h100", 16, "1x2:2", "-", "test")
    (row,) = scale_study.study([case])
    assert row.planned is not None and row.forced is not None, row.why
    assert row.forced.layout == "1x2:2" and row.forced.stages[0].tensor_parallel == 2
    assert float(scale_study.ratio(row)) <= 1.0 + 1e-9  # the planner's choice is no slower than a forced layout
    assert scale_study.describe(row.planned)[3].endswith("%")  # its MFU
    assert "| tiny " in scale_study.table([row]) and "no slower than published: met" in scale_study.summary([row])[0]


@pytest.mark.multiprocess
def test_tp_fidelity_smoke() -> None:
    """Issue 33 item 7's benchmark end to end at 64 channels: a T=2 stage and its data-parallel control, each
    compiled, stepped and predicted on two gloo ranks, and the table written."""
    result = tp_fidelity.run(num_rounds=1, num_warmup=0, num_steps=1, widths=(64,))
    assert [row["plan"] for row in result["rows"]] == ["1x2 M=2", "dp M=2"]
    for row in result["rows"]:
        assert row["predicted_s"] > 0 and row["iteration_s"] > 0 and len(row["errors"]) == 1
    report = tp_fidelity.report(result)
    assert "gpt-mini b=8 1x2 M=2 n_embd=64 local:2" in report and "--widths 64" in report


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sharding_fidelity_smoke() -> None:
    result = sharding_fidelity.run(1, 0, 1, tiny(8, 4))
    (round_result,) = result["rounds"]
    assert set(round_result["steps"]) == set(sharding_fidelity.LEVELS)
    rows = sharding_fidelity.level_rows(result)
    assert [row["level"] for row in rows] == ["optimizer", "gradients", "parameters"]
    # the model charges ZeRO-3 more collectives than ZeRO-2, and ZeRO-2 more than ZeRO-1 (M = 4)
    charged = [row["charged_calibrated"] for row in rows]
    assert 0 < charged[0] < charged[1] < charged[2]
    assert "| parameters " in sharding_fidelity.report(result, 1.0)
