"""Model FLOPs as Megatron counts them, MFU and tokens/s per device: the count, the plan field, the printed figures."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

import fxpipe
from fxpipe.core.plan import Plan
from fxpipe.core.utilization import (
    model_flops_utilization,
    tokens_per_s_per_device,
    utilization_text,
    utilization_warning,
)
from fxpipe.passes import annotate_costs, trace
from fxpipe.passes.model_flops import model_flops_per_sample, tokens_per_sample
from fxpipe.report import summary_lines

pytest.importorskip("transformers")
hf_examples = pytest.importorskip("fxpipe.hf_examples")

# legend: L layers, h width, s sequence length, V vocabulary, f MLP width, k key/value width (GQA)
L, H, HEADS, S, V = 2, 64, 4, 16, 96


def megatron_flops_per_sample(num_matmul_params: int) -> int:
    """Megatron's model FLOPs of one sequence: (6N + 12 L h s) per token, N the matmul parameters."""
    return S * (6 * num_matmul_params + 12 * L * H * S)


def _count(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[float, int]:
    gm = annotate_costs(trace(model, inputs))
    return model_flops_per_sample(gm), tokens_per_sample(gm)


def test_a_gpt_costs_6n_plus_12lhs_per_token() -> None:
    # GPT-2: fused qkv (h x 3h), output projection, a 4h MLP, the tied output head (V x h) used as a matmul
    model, inputs = hf_examples.gpt2(n_layer=L, n_embd=H, n_head=HEADS, vocab_size=V, seq_len=S)
    flops, tokens = _count(model, inputs)
    num_matmul_params = L * (3 * H * H + H * H + 2 * 4 * H * H) + V * H  # 12 L h^2 + V h; biases are not matmuls
    assert tokens == S
    assert flops == pytest.approx(megatron_flops_per_sample(num_matmul_params), rel=1e-12)


def test_grouped_query_attention_and_a_gated_mlp_count_their_own_matmuls() -> None:
    # Llama: q and o are h x h, k and v h x k (2 KV heads of 4), gate/up/down h x f; the attention products
    # still run over every query head: 12 L h s per token, full (Megatron does not halve causal attention)
    intermediate, kv_heads = 160, 2
    model, inputs = hf_examples.llama(num_layers=L, hidden=H, heads=HEADS, vocab_size=V, seq_len=S,
                                      intermediate=intermediate, kv_heads=kv_heads)
    flops, tokens = _count(model, inputs)
    kv_width = H // HEADS * kv_heads
    num_matmul_params = L * (2 * H * H + 2 * H * kv_width + 3 * H * intermediate) + V * H
    assert tokens == S
    assert flops == pytest.approx(megatron_flops_per_sample(num_matmul_params), rel=1e-12)


def test_inputs_that_are_not_token_ids_have_no_tokens() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    gm = annotate_costs(trace(model, (torch.randn(3, 8),)))
    assert tokens_per_sample(gm) == 0
    assert model_flops_per_sample(gm) == 3 * 2 * 8 * 4


def _planned() -> Plan:
    model, inputs = hf_examples.gpt2(n_layer=L, n_embd=H, n_head=HEADS, vocab_size=V, seq_len=S)
    return fxpipe.plan(model, inputs, cluster="1x4:h100", global_batch_size=32, costs="analytic", precision="bf16")


def test_the_plan_carries_the_count_and_its_mfu_round_trips_through_json() -> None:
    plan = _planned()
    predicted = plan.predicted
    assert predicted is not None
    num_matmul_params = L * 12 * H * H + V * H
    assert predicted.model_flops_per_sample == pytest.approx(megatron_flops_per_sample(num_matmul_params), rel=1e-12)
    assert (predicted.tokens_per_sample, predicted.peak_flops_per_device) == (S, 989.5e12)  # the bf16 datasheet peak
    mfu = predicted.model_flops_per_sample * 32 / predicted.iteration_time_s / (plan.world_size * 989.5e12)
    assert model_flops_utilization(plan) == pytest.approx(mfu, rel=1e-12)
    assert tokens_per_s_per_device(plan) == pytest.approx(S * 32 / predicted.iteration_time_s / plan.world_size)
    data = json.loads(plan.to_json())
    assert data["predicted"]["mfu"] == pytest.approx(mfu, rel=1e-12)  # derived, for readers
    assert Plan.from_json(plan.to_json()) == plan
    # a file written before the count existed: unknown, no MFU, and no keys written back
    for key in ("model_flops_per_sample", "tokens_per_sample", "peak_flops_per_device", "mfu", "tokens_per_s_per_device"):
        del data["predicted"][key]
    old = Plan.from_json(json.dumps(data))
    assert model_flops_utilization(old) is None and tokens_per_s_per_device(old) is None
    assert "mfu" not in json.loads(old.to_json())["predicted"]


def test_the_plan_table_and_a_measured_step_show_mfu_and_tokens_per_device() -> None:
    plan = _planned()
    assert plan.predicted is not None
    line = next(line for line in summary_lines(plan) if "MFU" in line)
    assert f"MFU {model_flops_utilization(plan):.1%}" in line and "tokens/s/device" in line
    slower = 2 * plan.predicted.iteration_time_s  # a measured step twice the prediction: half the MFU
    assert model_flops_utilization(plan, slower) == pytest.approx(model_flops_utilization(plan) / 2)
    assert utilization_text(plan, slower).startswith(f"MFU {model_flops_utilization(plan) / 2:.1%}")


def test_a_measured_step_above_100_percent_mfu_warns_and_names_the_fix() -> None:
    plan = _planned()
    assert plan.predicted is not None
    mfu = model_flops_utilization(plan)
    assert mfu is not None and 0 < mfu < 1
    at_peak = plan.predicted.iteration_time_s * mfu  # the step time at exactly 100% MFU
    assert utilization_warning(plan, at_peak * 1.001) == ""  # just under 100%: no warning
    warning = utilization_warning(plan, at_peak / 1.5)  # 150%: the peak behind it is too low
    assert "MFU 150%" in warning and "989,500.0 GFLOP/s" in warning and "1x4:h100" in warning
    assert "peak_flops" in warning  # a preset: its datasheet figure is the suspect
    local = replace(plan, cluster="local:2")
    assert "fxpipe calibrate" in utilization_warning(local, at_peak / 1.5)
    old = replace(plan, predicted=replace(plan.predicted, peak_flops_per_device=0.0))  # no peak recorded: no MFU
    assert utilization_warning(old, at_peak / 1.5) == ""


def test_no_mfu_against_an_uncalibrated_cpus_default_rates_and_the_flag_round_trips() -> None:
    """An uncalibrated CPU rank's rates are guesses set below the machine (the demo once showed MFU 274% against
    them): plans are costed at them, but carry no peak, so no MFU is predicted or measured; calibrated ones do."""
    from fxpipe.core.cluster import Cluster, parse_cluster
    from fxpipe.core.hardware import cpu_device
    from fxpipe.core.utilization import peak_flops_per_device

    assert os.environ.get("FXPIPE_CALIBRATE") == "0"  # tests/conftest.py: `local` uses the defaults
    cluster = parse_cluster("local:2")
    assert cluster.device.default_rates and peak_flops_per_device(cluster.device, "fp32") == 0.0
    model, inputs = hf_examples.gpt2(n_layer=L, n_embd=H, n_head=HEADS, vocab_size=V, seq_len=S)
    plan = fxpipe.plan(model, inputs, cluster="local:2", global_batch_size=8, costs="analytic")
    assert plan.predicted is not None and plan.predicted.iteration_time_s > 0  # costed at the defaults all the same
    assert model_flops_utilization(plan) is None and "MFU" not in utilization_text(plan)
    assert utilization_warning(plan, plan.predicted.iteration_time_s / 100) == ""
    assert Cluster.from_json(cluster.to_json()) == cluster and cluster.to_json()["device"]["default_rates"] is True
    calibrated = cpu_device(2**30, calibrated={"float32": 9e10})
    assert not calibrated.default_rates and peak_flops_per_device(calibrated, "fp32") == 9e10
    preset = parse_cluster("1x4:h100")
    assert "default_rates" not in preset.to_json()["device"]  # files of every other device keep their bytes
