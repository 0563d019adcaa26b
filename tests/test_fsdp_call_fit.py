"""FSDP2's host time per call, per kind and by the unit's bytes: the fit's formulas, its JSON round trip, and the
charge per unit in the simulator, the pivot model's sharding terms and the reference simulator."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from reference_sim import reference_run
from test_tensor_parallel_plan import _hand_chain

from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec, parse_cluster
from fxpipe.core.cluster_spec import ClusterSpecError, calibrated_link_fields
from fxpipe.core.fsdp_calls import (
    FIGURE_KEYS,
    FsdpCallCost,
    call_seconds,
    fsdp_calls_from_figures,
)
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.runtime.calibration.calibrate_fsdp import (
    FSDP_UNITS,
    FSDP_WIDTHS,
    block_units,
    per_call_excess,
    two_size_fit,
)
from fxpipe.sim.sharding_cost import sharding_comm, unit_collectives
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import num_units, stage_param_bytes

# memory at 1e12 B/s: the flat-buffer copies stay exact but small
# a CPU device: FSDP2 blocks on gloo, so every sharding charge stays on the critical path (fxpipe.sim.unit_overlap)
NET = Cluster("1x2", 1, 2, DeviceSpec("CPU", 2**40, (("float32", 1e13),), 1e12), LinkSpec(1e9, 1e-5),
              LinkSpec(1e9, 1e-5))
# all-gather 1 ms + 2 ns/B, reduce-scatter 0.5 ms + 1 ns/B
FIT = FsdpCallCost(1e-3, 2e-9, 5e-4, 1e-9)


def test_a_call_costs_its_kinds_intercept_plus_slope_times_the_units_bytes() -> None:
    assert FIT.seconds("all_gather", 1e6) == pytest.approx(1e-3 + 2e-3, rel=1e-12)
    assert FIT.seconds("reduce_scatter", 1e6) == pytest.approx(5e-4 + 1e-3, rel=1e-12)
    assert call_seconds(FIT, 7e-3, "all_gather", 0.0) == 1e-3  # the fit wins over the flat figure
    assert call_seconds(None, 7e-3, "reduce_scatter", 1e9) == 7e-3  # no fit: the flat figure per call
    with pytest.raises(ValueError, match="kind must be one of"):
        FIT.seconds("all_reduce", 1.0)
    with pytest.raises(ValueError, match="reduce_scatter_s_per_byte must be a finite number >= 0"):
        FsdpCallCost(1e-3, 0.0, 0.0, -1e-9)


def test_the_fit_round_trips_through_the_cluster_file_and_presets_keep_their_bytes() -> None:
    net = replace(NET, fsdp_calls=FIT)
    loaded = Cluster.from_json(json.loads(json.dumps(net.to_json())))
    assert loaded == net and loaded.fsdp_calls == FIT
    preset = parse_cluster("dapple-a")
    assert preset.fsdp_calls is None and "fsdp_calls" not in preset.to_json()  # files written before are unchanged
    assert Cluster.from_json(preset.to_json()) == preset
    fit = FIT.to_json()
    # a file written before the pass was measured loads with pass figures of 0
    older = {key: value for key, value in fit.items() if not key.startswith("pass_")}
    assert Cluster.from_json({**net.to_json(), "fsdp_calls": older}).fsdp_calls == FIT
    for broken, message in (({k: v for k, v in fit.items() if k != "all_gather_s"}, "all_gather_s"),
                            ({**fit, "reduce_scatter_s": -1e-3}, "reduce_scatter_s -0.001 must be non-negative"),
                            ({**fit, "per_call": 1.0}, "unknown keys \\['per_call'\\]"),
                            ([1e-3], "fsdp_calls")):
        with pytest.raises(ClusterSpecError, match=message):
            Cluster.from_json({**net.to_json(), "fsdp_calls": broken})


def test_calibrated_figures_make_the_clusters_fit() -> None:
    figures = dict(zip(FIGURE_KEYS, (1e-3, 2e-9, 5e-4, 1e-9, 0.0, 0.0), strict=True))
    assert fsdp_calls_from_figures(figures) == FIT
    assert fsdp_calls_from_figures({key: value for key, value in figures.items() if key != "fsdp_pass_call"}) is None
    assert fsdp_calls_from_figures({"fsdp_call_overhead": 2e-3}) is None  # a cache written before the fit
    fields = calibrated_link_fields({**figures, "fsdp_call_overhead": 2e-3})
    assert (fields["fsdp_calls"], fields["fsdp_call_overhead_s"]) == (FIT, 2e-3)


def test_per_call_excess_subtracts_the_whole_step_and_each_units_bare_collectives() -> None:
    # 4 units; bare all-gather 2 ms, reduce-scatter 3 ms per unit; FSDP2's host time 1.5 ms per all-gather and
    # 1 ms per reduce-scatter: ZeRO-2 = whole + 4 (3 + 1), ZeRO-3 = whole + 4 (2 (2 + 1.5) + 3 + 1)
    whole = 0.010
    zero2, zero3 = whole + 4 * 4e-3, whole + 4 * 11e-3
    gather, scatter = per_call_excess(whole, zero2, zero3, 2e-3, 3e-3, 4)
    assert (gather, scatter) == (pytest.approx(1.5e-3, rel=1e-9), pytest.approx(1e-3, rel=1e-9))
    assert per_call_excess(whole, whole, whole, 2e-3, 3e-3, 4) == (0.0, 0.0)  # faster than its collectives: 0
    with pytest.raises(ValueError, match="at least one FSDP unit"):
        per_call_excess(whole, zero2, zero3, 2e-3, 3e-3, 0)


def test_calibration_times_units_with_a_transformer_blocks_tensors_at_both_sizes() -> None:
    # FSDP2's host time grows with a unit's parameter tensors as well as its bytes: each unit holds GPT-2 block's 12
    # (two layer norms, four linears with biases), 4 w^2 + 8 w floats: 17.4 KB and 2.37 MB at the two widths
    sizes = []
    for width in FSDP_WIDTHS:
        units = block_units(width)
        assert len(units) == FSDP_UNITS
        for unit in units:
            params = list(unit.parameters())
            assert len(params) == 12
            assert sum(param.numel() for param in params) == 4 * width**2 + 8 * width
        sizes.append(4 * sum(param.numel() for param in units[0].parameters()))
        assert units(torch.randn(3, width)).shape == (3, width)
    assert sizes == [17_408, 2_371_584]
    again = zip(block_units(32).parameters(), block_units(32).parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in again)  # the same weights on every call


def test_two_size_fit_goes_through_both_sizes_and_never_below_zero() -> None:
    call, per_byte = two_size_fit((1e4, 1.2e-3), (1e6, 3.2e-3))
    assert per_byte == pytest.approx(2e-3 / 0.99e6, rel=1e-12)
    assert call + per_byte * 1e4 == pytest.approx(1.2e-3, rel=1e-12)
    assert call + per_byte * 1e6 == pytest.approx(3.2e-3, rel=1e-12)
    assert two_size_fit((1e4, 3e-3), (1e6, 1e-3)) == (pytest.approx(2e-3), 0.0)  # larger cheaper (noise): flat
    assert two_size_fit((1e4, 0.0), (1e6, 5e-3)) == (0.0, pytest.approx(5e-9))  # intercept below 0: through the larger
    with pytest.raises(ValueError, match="small bytes < large bytes"):
        two_size_fit((1e6, 1e-3), (1e4, 2e-3))


def test_each_unit_call_is_charged_by_its_kind_and_its_bytes() -> None:
    net = replace(NET, fsdp_calls=FIT)
    # 4 units of 1e6 bytes: each half a ring allreduce (10 us + 0.5e6 B / 1 GB/s) and its copy (2e6 B at 1e12 B/s)
    wire = 1e-5 + 0.5e6 / 1e9 + 2e6 / 1e12
    assert unit_collectives(net, 4e6, (0, 1), 4, "all_gather") == pytest.approx(4 * (wire + 3e-3), rel=1e-12)
    assert unit_collectives(net, 4e6, (0, 1), 4, "reduce_scatter") == pytest.approx(4 * (wire + 1.5e-3), rel=1e-12)
    # the same bytes in 2 units: fewer intercepts, the same bytes' slope
    assert unit_collectives(net, 4e6, (0, 1), 2, "all_gather") - 2 * (1e-5 + 1e6 / 1e9 + 4e6 / 1e12) == \
        pytest.approx(2 * 1e-3 + 4e6 * 2e-9, rel=1e-9)
    plain = sharding_comm(NET, "gradients", (0, 1), 4e6, 4e6, num_units=4)
    zero2 = sharding_comm(net, "gradients", (0, 1), 4e6, 4e6, num_units=4)
    assert zero2.backward_s - plain.backward_s == pytest.approx(4 * 1.5e-3, rel=1e-9)  # reduce-scatters only
    assert zero2.start_s - plain.start_s == pytest.approx(4 * 3e-3, rel=1e-9)  # the step's all-gathers


@pytest.mark.parametrize("level", ["optimizer", "gradients", "parameters"])
def test_both_simulators_charge_the_fit_per_unit(level: str) -> None:
    chain = _hand_chain()
    plan = Plan(4, 2, (StagePlan(0, 0, 2, 2, (0, 1), sharding=level),))
    units = num_units(chain, 0, 2)
    unit_bytes = stage_param_bytes(chain, 0, 2) / units
    flat = replace(NET, fsdp_call_overhead_s=4e-3)  # ignored once the fit is there
    fitted = replace(flat, fsdp_calls=FIT)
    gather, scatter = FIT.seconds("all_gather", unit_bytes), FIT.seconds("reduce_scatter", unit_bytes)
    # per step, per unit: ZeRO-1 one all-gather and one reduce-scatter; ZeRO-2 one all-gather and M reduce-scatters;
    # ZeRO-3 2M all-gathers and M reduce-scatters (M = 2); on one stage every charge is on the critical path
    calls = {"optimizer": gather + scatter, "gradients": gather + 2 * scatter, "parameters": 4 * gather + 2 * scatter}
    expected = simulate(plan, chain, NET).iteration_time_s + units * calls[level]
    assert simulate(plan, chain, fitted).iteration_time_s == pytest.approx(expected, rel=1e-9)
    assert reference_run(plan, chain, fitted).iteration_time_s == pytest.approx(expected, rel=1e-9)
    # the pivot model adds the same seconds (one stage: its own figure, the charges on its critical path)
    pivot = analytic_iteration_time(plan, chain, fitted) - analytic_iteration_time(plan, chain, NET)
    assert pivot == pytest.approx(units * calls[level], rel=1e-9)


def test_zero1_is_charged_each_micro_batchs_hooks_and_the_reduce_scatter_beyond_the_last() -> None:
    """ZeRO-1 makes one all-gather and one reduce-scatter per step, yet FSDP2 runs every unit's hooks (and
    accumulates its unsynced gradients) in every micro-batch: M - 1 passes beyond the reduce-scatter's own figure,
    which holds the last micro-batch's. Simulator, pivot model and reference simulator charge the same."""
    passes = replace(FIT, pass_s=2e-4, pass_s_per_byte=1e-10)  # below the reduce-scatter's figure, as measured
    assert passes.pass_seconds(1e6) == pytest.approx(2e-4 + 1e-4, rel=1e-12)
    without = sharding_comm(replace(NET, fsdp_calls=FIT), "optimizer", (0, 1), 4e6, 4e6, num_units=4)
    with_passes = sharding_comm(replace(NET, fsdp_calls=passes), "optimizer", (0, 1), 4e6, 4e6, num_units=4)
    hooks = 4 * passes.pass_seconds(1e6)
    assert (with_passes.backward_s, with_passes.start_s) == (pytest.approx(hooks, rel=1e-12), without.start_s)
    assert with_passes.tail_s == pytest.approx(without.tail_s - hooks, rel=1e-12)
    for num_microbatches in (1, 2, 4):
        assert with_passes.step_seconds(num_microbatches) - without.step_seconds(num_microbatches) == \
            pytest.approx((num_microbatches - 1) * hooks, rel=1e-9)
    # a pass timed above the reduce-scatter's whole figure (noise) leaves the tail at 0, never below
    noisy = sharding_comm(replace(NET, fsdp_calls=replace(FIT, pass_s=1e-2)), "optimizer", (0, 1), 4e6, 4e6, num_units=4)
    assert noisy.tail_s == 0.0 and noisy.backward_s == pytest.approx(4e-2, rel=1e-12)
    # no fit (a flat figure per call, or a preset): no pass charge
    assert sharding_comm(NET, "optimizer", (0, 1), 4e6, 4e6, num_units=4).backward_s == 0.0
    chain = _hand_chain()
    plan = Plan(4, 2, (StagePlan(0, 0, 2, 2, (0, 1), sharding="optimizer"),))
    units = num_units(chain, 0, 2)
    unit_bytes = stage_param_bytes(chain, 0, 2) / units
    fitted, hooked = replace(NET, fsdp_calls=FIT), replace(NET, fsdp_calls=passes)
    extra = (plan.num_microbatches - 1) * units * passes.pass_seconds(unit_bytes)  # M = 2
    assert simulate(plan, chain, hooked).iteration_time_s - simulate(plan, chain, fitted).iteration_time_s == \
        pytest.approx(extra, rel=1e-9)
    assert reference_run(plan, chain, hooked).iteration_time_s - reference_run(plan, chain, fitted).iteration_time_s == \
        pytest.approx(extra, rel=1e-9)
    pivot = analytic_iteration_time(plan, chain, hooked) - analytic_iteration_time(plan, chain, fitted)
    assert pivot == pytest.approx(extra, rel=1e-9)
