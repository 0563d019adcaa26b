"""Activation recomputation as data: the setting, memory and time models, plan JSON, and the planner's choice."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from conftest import SHARED_PROFILES as PROFILES

from fxpipe import planning
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.plan import Plan
from fxpipe.core.recompute import RecomputeError, choose_recompute, force_recompute, parse_recompute
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.passes.partition.request import InfeasiblePlanError, PlanningError
from fxpipe.report import stage_table
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import compute_times, stage_cost, stage_memory_bytes, step_end_sync_time
from tests.test_simulate import BACKWARD_PER_ROW, FORWARD_PER_ROW, cluster, plan_of, uniform_chain

needs_profiles = pytest.mark.needs_profiles  # conftest: skip locally, fail under CI=true
GIB = 2**30


def test_parse_recompute_modes_and_per_stage_choices() -> None:
    assert [parse_recompute(mode) for mode in ("auto", "never", "always")] == ["auto", "never", "always"]
    assert parse_recompute("keep,recompute") == (False, True)
    assert parse_recompute(["recompute", False, True]) == (True, False, True)
    assert parse_recompute("recompute") == (True,)
    for bad in ("sometimes", "keep,maybe", [], 3, [1, 0]):
        with pytest.raises(RecomputeError):
            parse_recompute(bad)


def test_choose_recompute_auto_only_when_keeping_does_not_fit() -> None:
    assert not choose_recompute("auto", 0, 2, keep_bytes=100, limit_bytes=100)
    assert choose_recompute("auto", 0, 2, keep_bytes=101, limit_bytes=100)
    assert not choose_recompute("never", 0, 2, keep_bytes=10**9, limit_bytes=100)
    assert choose_recompute("always", 1, 2, keep_bytes=1, limit_bytes=100)
    assert choose_recompute((False, True), 1, 2, keep_bytes=1, limit_bytes=100)
    with pytest.raises(RecomputeError, match="3 per-stage choices but the plan has 2 stages"):
        choose_recompute((False, True, True), 1, 2, keep_bytes=1, limit_bytes=100)


def test_memory_keeps_inputs_per_microbatch_and_one_microbatch_of_activations() -> None:
    chain = uniform_chain(4, cut_bytes_per_row=64.0)
    cost = stage_cost(chain, 1, 3, microbatch_rows=4, replicas=1)
    weights = cost.param_bytes * 4  # adam
    buffers = cost.input_bytes + cost.output_bytes
    assert stage_memory_bytes(cost, 3) == weights + 3 * (cost.activation_bytes + cost.input_bytes) + buffers
    assert stage_memory_bytes(cost, 3, recompute=True) == weights + 3 * cost.input_bytes + cost.activation_bytes \
        + buffers
    assert stage_memory_bytes(cost, 1, recompute=True) == stage_memory_bytes(cost, 1)  # one in flight: no saving


def test_backward_includes_the_forward_again() -> None:
    chain = uniform_chain(3)
    forward, backward = compute_times(chain, 0, 3, 4)
    assert compute_times(chain, 0, 3, 4, recompute=True) == (forward, backward + forward)


@pytest.mark.parametrize("num_stages,num_microbatches", [(1, 3), (2, 4), (4, 8)])
def test_simulator_and_pivot_model_charge_one_forward_per_microbatch(num_stages: int, num_microbatches: int) -> None:
    rows, chain, net = 4, uniform_chain(2 * num_stages), cluster()
    plan = force_recompute(plan_of((1,) * num_stages, 2, rows, num_microbatches), "always")
    result = simulate(plan, chain, net)
    forward, backward = 2 * rows * FORWARD_PER_ROW, 2 * rows * BACKWARD_PER_ROW
    sync = step_end_sync_time(net, range(num_stages))  # the loss allreduce ending the step
    assert result.iteration_time_s == (num_microbatches + num_stages - 1) * (2 * forward + backward) + sync
    assert analytic_iteration_time(plan, chain, net) == result.iteration_time_s
    assert result.busy_s == (num_microbatches * (2 * forward + backward),) * num_stages
    kept = simulate(plan_of((1,) * num_stages, 2, rows, num_microbatches), chain, net)
    for index, (peak, inflight) in enumerate(zip(result.peak_memory_bytes, result.inflight_microbatches,
                                                 strict=True)):
        cost = stage_cost(chain, 2 * index, 2 * index + 2, rows, 1)
        assert peak == stage_memory_bytes(cost, inflight, recompute=True)
        assert (peak < kept.peak_memory_bytes[index]) == (inflight > 1)


def test_one_recomputing_stage_adds_its_forwards_to_its_device_only() -> None:
    rows, num_microbatches, chain, net = 4, 6, uniform_chain(6), cluster()
    kept = simulate(plan_of((1, 1, 1), 2, rows, num_microbatches), chain, net)
    plan = force_recompute(plan_of((1, 1, 1), 2, rows, num_microbatches), "keep,recompute,keep")
    mixed = simulate(plan, chain, net)
    extra = num_microbatches * 2 * rows * FORWARD_PER_ROW
    assert mixed.busy_s == (kept.busy_s[0], kept.busy_s[1] + extra, kept.busy_s[2])
    assert kept.iteration_time_s < mixed.iteration_time_s <= kept.iteration_time_s + extra


def test_plan_json_records_recompute_and_reads_old_files_as_keep() -> None:
    plan = force_recompute(plan_of((1, 1), 2, 4, 2), "recompute,keep")
    data = json.loads(plan.to_json())
    assert [stage["recompute"] for stage in data["stages"]] == [True, False]
    assert Plan.from_json(plan.to_json()) == plan
    for stage in data["stages"]:
        del stage["recompute"]  # a plan file written before the field existed
    assert [stage.recompute for stage in Plan.from_json(json.dumps(data)).stages] == [False, False]
    assert force_recompute(plan, "auto") == plan
    with pytest.raises(RecomputeError, match="plan has 2 stages"):
        force_recompute(plan, "keep,keep,keep")


def test_plan_table_shows_which_stages_recompute() -> None:
    plan = force_recompute(plan_of((1, 1), 2, 4, 2), "recompute,keep")
    plan = plan.with_updates(stages=tuple(dataclasses.replace(s, forward_s=0.00125, backward_s=0.0025)
                                          for s in plan.stages))
    rows = stage_table(plan).splitlines()
    assert "activations" in rows[0]
    assert "recompute" in rows[2] and "3.75" in rows[2].split()  # backward ms includes the forward again
    assert "keep" in rows[3] and "2.5" in rows[3].split()


def test_per_stage_setting_needs_a_fixed_stage_count() -> None:
    chain = uniform_chain(4)
    with pytest.raises(PlanningError, match="stage count is the planner's choice"):
        planning.plan_chain(chain, cluster(), 16, recompute="keep,recompute")
    with pytest.raises(PlanningError, match="2 per-stage choices but the plan has 4 stages"):
        planning.plan_chain(chain, cluster(), 16, layout="1:1:1:1", recompute="keep,recompute")
    plan = planning.plan_chain(chain, cluster(), 16, layout="1:1", num_microbatches=4, recompute="keep,recompute")
    assert [stage.recompute for stage in plan.stages] == [False, True]


def _bert48():  # type: ignore[no-untyped-def]
    return planning.profile_chain(str(PROFILES / "bert-48-pbs-2.txt"), 2)


@needs_profiles
def test_bert48_on_16gb_devices_needs_recompute_where_memory_binds() -> None:
    """A 4-stage BERT-48 pipeline with 256-row micro-batches holds 4 in flight on stage 0: over 16 GiB unless
    stages recompute; "auto" recomputes exactly the stages that would not fit and keeps the rest."""
    chain, cluster_b = _bert48(), parse_cluster("dapple-b")
    options = {"layout": "1:1:1:1", "num_microbatches": 4}
    with pytest.raises(InfeasiblePlanError):
        planning.plan_chain(chain, cluster_b, 1024, recompute="never", **options)
    plan = planning.plan_chain(chain, cluster_b, 1024, **options)
    limit = cluster_b.device.memory_bytes
    assert any(stage.recompute for stage in plan.stages) and not all(stage.recompute for stage in plan.stages)
    for stage in plan.stages:
        cost = stage_cost(chain, stage.first_block, stage.stop_block, plan.microbatch_size, stage.replicas)
        keep = stage_memory_bytes(cost, stage.inflight_microbatches)
        assert stage.recompute == (keep > limit)
        assert stage.peak_memory_bytes == stage_memory_bytes(cost, stage.inflight_microbatches,
                                                             recompute=stage.recompute) <= limit
    assert simulate(plan, chain, cluster_b).peak_memory_bytes == tuple(s.peak_memory_bytes for s in plan.stages)
    always = planning.plan_chain(chain, cluster_b, 1024, recompute="always", **options)
    assert always.predicted is not None and plan.predicted is not None
    assert always.predicted.iteration_time_s > plan.predicted.iteration_time_s


@needs_profiles
def test_bert48_recompute_lets_the_planner_choose_a_faster_pipeline() -> None:
    """Free search on dapple-b (16 x V100-16GB) at 1,024-row micro-batches: the kept-activation plans are
    slower than one whose first stage recomputes (fewer replicas there, more for the rest)."""
    chain, cluster_b = _bert48(), parse_cluster("dapple-b")
    never = planning.plan_chain(chain, cluster_b, 4096, num_microbatches=4, recompute="never")
    auto = planning.plan_chain(chain, cluster_b, 4096, num_microbatches=4)
    assert never.predicted is not None and auto.predicted is not None
    assert not any(stage.recompute for stage in never.stages)
    assert any(stage.recompute or set(stage.block_recompute) - {"keep"} for stage in auto.stages)  # whole or per block
    assert auto.predicted.iteration_time_s < never.predicted.iteration_time_s


@needs_profiles
def test_bert48_small_microbatches_keep_activations() -> None:
    """Where memory does not bind, "auto" gives the same plan as "never"."""
    chain, cluster_b = _bert48(), parse_cluster("dapple-b")
    auto = planning.plan_chain(chain, cluster_b, 64, num_microbatches=8)
    never = planning.plan_chain(chain, cluster_b, 64, num_microbatches=8, recompute="never")
    assert not any(stage.recompute for stage in auto.stages)
    assert auto.with_updates(planning_time_s=0.0) == never.with_updates(planning_time_s=0.0)


def test_checkpointed_forward_updates_batch_norm_statistics_once() -> None:
    import torch

    from fxpipe.runtime.autograd.recompute import checkpointed_call

    torch.manual_seed(0)
    kept = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))
    recomputed = copy.deepcopy(kept)
    inputs = torch.randn(8, 4)
    torch.manual_seed(1)
    kept(inputs).square().sum().backward()
    torch.manual_seed(1)
    checkpointed_call(recomputed, (inputs,)).square().sum().backward()
    for (name, a), b in zip(kept.state_dict().items(), recomputed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # running_mean/var and num_batches_tracked: one update
    for a, b in zip(kept.parameters(), recomputed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0.0)


def test_recompute_refuses_deferred_batch_norm_on_a_recomputing_stage() -> None:
    import torch

    from fxpipe.runtime.autograd.recompute import check_recompute_batch_norm
    from fxpipe.runtime.faults.errors import PipelineSetupError

    plan = force_recompute(plan_of((1, 1), 2, 4, 2), "keep,recompute")
    modules = [torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.BatchNorm1d(2))]
    check_recompute_batch_norm(plan, modules, "microbatch")
    check_recompute_batch_norm(force_recompute(plan, "never"), modules, "deferred")
    with pytest.raises(PipelineSetupError, match="stage 1 recomputes .* batch norm '0'"):
        check_recompute_batch_norm(plan, modules, "deferred")


def test_zero_bubble_and_recomputation_are_refused_together_not_run() -> None:
    """Split backward (B, then W on the same graph) cannot rerun a checkpointed forward: the planner keeps
    zero-bubble plans free of recomputation, and a plan given whole with both fails on every rank at compile."""
    import torch
    from torch import nn

    from fxpipe.passes import trace
    from fxpipe.runtime.autograd.recompute import check_recompute_batch_norm
    from fxpipe.runtime.faults.errors import PipelineSetupError
    from tests.mp_utils import plan_from_cuts

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    gm = trace(model, (torch.randn(8, 4),))
    plan = force_recompute(plan_from_cuts(gm, (1, 1), 8, 4, schedule="zero_bubble"), "always")
    with pytest.raises(PipelineSetupError, match="zero_bubble's split backward"):
        check_recompute_batch_norm(plan, [model, model], "microbatch")
    check_recompute_batch_norm(force_recompute(plan, "never"), [model, model], "microbatch")  # either alone is fine
    from tests.test_virtual_simulate import uniform_plan

    for name in ("interleaved_zero_bubble", "zbv"):  # the virtual split-backward schedules alike; interleaved runs it
        chunked = force_recompute(uniform_plan(name, 2, 2, 4)[0], "always")
        with pytest.raises(PipelineSetupError, match=f"{name}'s split backward.*schedule='interleaved'"):
            check_recompute_batch_norm(chunked, [model] * 4, "microbatch")
    check_recompute_batch_norm(force_recompute(uniform_plan("interleaved", 2, 2, 4)[0], "always"), [model] * 4,
                               "microbatch")
    from fxpipe.passes.partition.dapple import partition
    from tests.planner_cases import chain as planner_chain
    from tests.planner_cases import cluster as planner_cluster

    small = planner_chain([1.0, 1.0], [10**6, 10**6])
    with pytest.raises(PlanningError, match="zero_bubble"):
        partition(small, planner_cluster(1, 2), 8, layout="1:1", schedule="zero_bubble", recompute="always")
    auto = partition(small, planner_cluster(1, 2), 8, layout="1:1", schedule="auto", recompute="always")
    assert auto.schedule != "zero_bubble" and all(stage.recompute for stage in auto.stages)
