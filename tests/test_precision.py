"""The precision a job trains in: autocast dtypes in the cost model, the plan field, the flags, measured costs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import models as zoo
from fxpipe.cli import main
from fxpipe.core.hardware import H100_80GB, V100_16GB
from fxpipe.core.meta import COST
from fxpipe.core.plan import Plan, PlanError, StagePlan
from fxpipe.core.precision import PrecisionError, autocast_dtype_name, check_precision, precision_of_dtype
from fxpipe.passes import annotate_costs, to_cost_graph, trace
from fxpipe.train_cli import _check_plan_file
from tests.mp_utils import run_ranks

WIDTH = 4096  # wide enough that a row's matmul is compute-bound on an H100 (2 x 4096^2 FLOPs, ~40 KB moved)


def _matmul_model(num_layers: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``num_layers`` square matmuls on the meta device (also ``fxpipe plan tests.test_precision:_matmul_model``)."""
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(num_layers)))
    return model, (torch.randn(4, WIDTH),)


def _costed(dtype: torch.dtype | None, device: str = "cuda") -> Any:
    model, inputs = _matmul_model()
    return annotate_costs(trace(model, inputs), autocast_dtype=dtype, autocast_device=device)


def test_bf16_matmuls_run_at_the_achievable_tensor_core_rate_with_half_the_activation_bytes() -> None:
    fp32 = to_cost_graph(_costed(None), device=H100_80GB).nodes
    bf16 = to_cost_graph(_costed(torch.bfloat16), device=H100_80GB).nodes
    row_flops = 2 * WIDTH * WIDTH
    # the H100 preset keeps the datasheet peak (MFU's denominator) and costs matmuls at the published achievable
    # rate, measured on an H200: 700.5 of 989.5 TFLOP/s bf16, 51.3 of 67 TFLOP/s fp32 (fxpipe.core.hardware)
    assert dict(H100_80GB.peak_flops)["bfloat16"] == 989.5e12
    bf16_rate, fp32_rate = 700.5e12, 51.3e12
    # every row: 2 x 4096^2 FLOPs at the bf16 rate, not at the fp32 one; backward: the weight's gradient,
    # and the input's for the second layer (the first one's input is data)
    for node, num_matmuls in zip(bf16, (1, 2), strict=True):
        assert node.forward_flops.per_sample == row_flops
        assert node.forward_s.per_sample == pytest.approx(row_flops / bf16_rate, rel=1e-9)
        assert node.backward_s.per_sample == pytest.approx(num_matmuls * row_flops / bf16_rate, rel=1e-9)
    assert fp32[0].forward_s.per_sample == pytest.approx(row_flops / fp32_rate, rel=1e-9)
    # the matmuls' outputs (what crosses a cut, what the next layer saves) are bfloat16: half the bytes
    assert [node.output_bytes.per_sample for node in bf16] == [WIDTH * 2, WIDTH * 2]
    assert [node.output_bytes.per_sample for node in fp32] == [WIDTH * 4, WIDTH * 4]
    assert bf16[1].saved_bytes.per_sample == fp32[1].saved_bytes.per_sample / 2 == WIDTH * 2
    # the weights stay fp32 master weights (gradients and Adam state follow them); autocast's bf16 copy of
    # each weight is saved for backward, a fixed cost
    assert [node.param_bytes for node in bf16] == [node.param_bytes for node in fp32] == [WIDTH * WIDTH * 4] * 2
    assert bf16[1].saved_bytes.fixed == WIDTH * WIDTH * 2


def test_fp32_costs_match_the_single_rate_model_where_matmuls_run_at_the_peak() -> None:
    model, inputs = zoo.build("gpt-mini", **zoo.get("gpt-mini").tiny_overrides)
    annotated = annotate_costs(trace(model, inputs))
    assert annotated.meta["fxpipe.autocast"] is None
    # the V100 preset has no achievable-rate figure: every FLOP at the fp32 peak, as one rate
    assert to_cost_graph(annotated, device=V100_16GB) == to_cost_graph(annotated, device=V100_16GB, dtype="float32")
    # (the H100 preset runs fp32 matmuls at its achievable rate instead: the bf16 test above)


def test_cuda_autocast_keeps_softmax_in_fp32_and_cpu_autocast_does_not() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=-1))
    dtypes = {}
    for device in ("cuda", "cpu"):
        annotated = annotate_costs(trace(model, (torch.randn(2, 8),)), autocast_dtype=torch.bfloat16,
                                   autocast_device=device)
        assert annotated.meta["fxpipe.autocast"] == (device, "bfloat16")
        dtypes[device] = [node.meta[COST].output_dtypes for node in annotated.graph.nodes if node.op == "call_module"]
    assert dtypes == {"cuda": [("bfloat16",), ("float32",)], "cpu": [("bfloat16",), ("bfloat16",)]}
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CUDA op lists are gone after the run
        assert torch.softmax(torch.randn(2, 2).bfloat16(), -1).dtype == torch.bfloat16


def test_a_device_without_bf16_names_the_precision_to_use() -> None:
    with pytest.raises(PrecisionError, match="fp16 on a V100"):
        to_cost_graph(_costed(torch.bfloat16), device=V100_16GB)
    fp16 = to_cost_graph(_costed(torch.float16), device=V100_16GB).nodes
    assert fp16[0].forward_s.per_sample == pytest.approx(2 * WIDTH * WIDTH / 125e12, rel=1e-9)


def test_precision_names() -> None:
    assert [autocast_dtype_name(name) for name in ("fp32", "bf16", "fp16")] == [None, "bfloat16", "float16"]
    assert precision_of_dtype("bfloat16") == "bf16" and precision_of_dtype(None) == "fp32"
    with pytest.raises(PrecisionError, match=r"'fp8' is unknown; choose one of \['bf16', 'bf16-params', 'fp16', 'fp32'\]"):
        check_precision("fp8")


def _plan(**changes: Any) -> Plan:
    return Plan(global_batch_size=4, num_microbatches=2, stages=(StagePlan(0, 0, 1, 1, (0,)),), **changes)


def test_plan_files_carry_the_precision_and_old_files_are_fp32() -> None:
    plan = _plan(precision="bf16")
    assert json.loads(plan.to_json())["precision"] == "bf16"
    assert Plan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())
    del old["precision"]  # written before the field existed
    assert Plan.from_json(json.dumps(old)).precision == "fp32"
    with pytest.raises(PlanError, match="precision 'int8' is unknown"):
        Plan.from_json(json.dumps({**old, "precision": "int8"}))


def _cli_plan(tmp_path: Path, precision: str) -> dict[str, Any]:
    out = tmp_path / f"{precision}.json"
    assert main(["plan", "tests.test_precision:_matmul_model", "--cluster", "1x2:h100", "--global-batch", "256",
                 "--precision", precision,
                 "--json", str(out), "--no-run-info"]) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_plan_flag_records_the_precision_and_predicts_faster_bf16(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    fp32, bf16 = _cli_plan(tmp_path, "fp32"), _cli_plan(tmp_path, "bf16")
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    # the matmuls run 14.8x faster; autocast's weight casts (reading 64 MiB of fp32 weights per micro-batch) stay
    assert bf16["predicted"]["iteration_time_s"] < fp32["predicted"]["iteration_time_s"] / 2
    assert "precision=bf16" in capsys.readouterr().out
    args = argparse.Namespace(plan=str(tmp_path / "bf16.json"), model="tests.test_precision:_matmul_model",
                              precision=None)
    assert _check_plan_file(args) == "bf16"  # `fxpipe train --plan FILE` trains in the file's precision
    assert _check_plan_file(argparse.Namespace(**{**vars(args), "precision": "fp32"})) == "fp32"


def test_profile_plans_take_no_precision(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "p.txt"
    profile.write_text("")
    assert main(["plan", "--profile", str(profile), "--profile-batch", "4", "--cluster", "1x2:h100",
                 "--global-batch", "8", "--precision", "bf16"]) == 2
    assert "--precision bf16 is for MODEL" in capsys.readouterr().err


def _compile_in_bf16(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    import fxpipe.block_costs as block_costs

    entry = zoo.get("mlp")
    seen: list[Any] = []
    measure = block_costs.measure_costs

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("autocast_dtype"))
        return measure(*args, **kwargs)

    block_costs.measure_costs = recording  # type: ignore[assignment]
    model, example_inputs = zoo.build("mlp", **entry.tiny_overrides)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=8, costs="measured",
                          autocast_dtype=torch.bfloat16)
    inputs, targets = entry.make_batch(8, 1, **entry.tiny_overrides)
    loss = pipe.step(inputs, targets)
    return {"seen": seen, "precision": pipe.plan.precision, "source": pipe.plan.predicted.cost_source,
            "loss": float(loss)}


@pytest.mark.multiprocess
def test_a_bf16_compile_measures_and_plans_under_autocast(tmp_path: Path) -> None:
    (result,) = run_ranks(_compile_in_bf16, 1, tmp_path)
    assert result["seen"] == [torch.bfloat16]
    assert (result["precision"], result["source"]) == ("bf16", "measured")
    assert result["loss"] > 0
