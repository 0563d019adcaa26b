"""The runtime's fixed costs (per forward/backward action, per step): charged alike by the simulator, the
reference simulator and the pivot model; calibrated with the runtime's own driver and cached; carried by
local CPU clusters only; and, where a cluster has no figures and they would dominate, the plan says its
prediction is a lower bound."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from reference_sim import reference_run

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, ClusterSpecError, DeviceSpec, LinkSpec, parse_cluster
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import step_end_sync_time

FORWARD_S, BACKWARD_S = 1e-3, 2e-3  # per block and micro-batch, at any rows
ACTION_S, STEP_S = 2.5e-4, 7e-4


def _chain(num_blocks: int, forward_s: float = FORWARD_S, backward_s: float = BACKWARD_S) -> CostChain:
    block = Block("b", (), Affine(forward_s, 0.0), Affine(backward_s, 0.0), 10**6)
    return CostChain((block,) * num_blocks, (Affine(),) * (num_blocks - 1))


def _cluster(action_s: float = ACTION_S, step_s: float = STEP_S, latency_s: float = 0.0) -> Cluster:
    """One host of 2 devices on 1 core (compute at half speed: stretch 2), links free unless ``latency_s``."""
    link = LinkSpec(1e15, latency_s)
    return Cluster("1x2", 1, 2, DeviceSpec("dev", 2**40, (("float32", 1e13),), 1e12), link, link,
                   cores_per_host=1, action_overhead_s=action_s, step_overhead_s=step_s)


def _all_three(plan: Plan, chain: CostChain, net: Cluster) -> tuple[float, float, float]:
    return (simulate(plan, chain, net).iteration_time_s, reference_run(plan, chain, net).iteration_time_s,
            analytic_iteration_time(plan, chain, net))


def test_one_stage_pays_each_action_and_the_step_once_stretched_like_compute() -> None:
    num_microbatches, stretch = 3, 2.0
    plan = Plan(6, num_microbatches, (StagePlan(0, 0, 2, 1, (0,)),))
    expected = stretch * (num_microbatches * 2 * (FORWARD_S + BACKWARD_S) + 2 * num_microbatches * ACTION_S + STEP_S)
    assert _all_three(plan, _chain(2), _cluster()) == pytest.approx((expected,) * 3, rel=1e-12)
    result = simulate(plan, _chain(2), _cluster())
    assert result.busy_s[0] == pytest.approx(stretch * num_microbatches * (2 * (FORWARD_S + BACKWARD_S) + 2 * ACTION_S))
    # without the figures: the model as before
    assert _all_three(plan, _chain(2), _cluster(0.0, 0.0)) == pytest.approx(
        (stretch * num_microbatches * 2 * (FORWARD_S + BACKWARD_S),) * 3, rel=1e-12)


def test_a_pipeline_of_equal_stages_pays_the_actions_on_its_critical_path() -> None:
    """(M + S - 1)(F + B) with F and B each an action longer, then the closing sync and the step's own cost."""
    num_microbatches, stretch = 4, 2.0
    net = _cluster()
    plan = Plan(8, num_microbatches, (StagePlan(0, 0, 1, 1, (0,)), StagePlan(1, 1, 2, 1, (1,))))
    cycle = stretch * (FORWARD_S + BACKWARD_S + 2 * ACTION_S)
    expected = (num_microbatches + 1) * cycle + step_end_sync_time(net, [0, 1]) + stretch * STEP_S
    assert _all_three(plan, _chain(2), net) == pytest.approx((expected,) * 3, rel=1e-12)
    split = replace(plan, schedule="zero_bubble")  # the action stays whole in B; W has none of its own
    assert simulate(split, _chain(2), net).iteration_time_s == pytest.approx(
        reference_run(split, _chain(2), net).iteration_time_s, rel=1e-12)


def test_cluster_json_carries_the_figures_and_files_without_them_read_as_zero() -> None:
    cluster = _cluster()
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster
    old = cluster.to_json()
    del old["action_overhead_s"], old["step_overhead_s"]  # a file written before them
    assert (Cluster.from_json(old).action_overhead_s, Cluster.from_json(old).step_overhead_s) == (0.0, 0.0)
    with pytest.raises(ClusterSpecError, match="action_overhead_s"):
        Cluster.from_json({**cluster.to_json(), "action_overhead_s": -1e-4})
    with pytest.raises(ValueError, match="step_overhead_s must be >= 0"):
        replace(cluster, step_overhead_s=-1.0)
    for spec in ("dapple-a", "4x8:h100", "dgx-h100:2", "2x4:cpu"):  # presets: none, so they plan as before
        preset = parse_cluster(spec)
        assert (preset.action_overhead_s, preset.step_overhead_s) == (0.0, 0.0), spec


def test_calibration_times_the_runtimes_own_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sane, not timed: a positive per-action figure well under a second, a non-negative per-step one, taken
    from real PipelineDriver steps at 1 and 8 micro-batches, under keys whose absence re-measures a cache."""
    from fxpipe.runtime.calibration import calibrate_fixed, calibrate_measure
    from fxpipe.runtime.execution.driver import PipelineDriver

    counts: dict[int, int] = {}
    real_step = PipelineDriver.step

    def counted(self: PipelineDriver, *args: object, **kwargs: object) -> float:
        counts[self.plan.num_microbatches] = counts.get(self.plan.num_microbatches, 0) + 1
        return real_step(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PipelineDriver, "step", counted)
    import torch.distributed as dist

    # calibration runs inside a job's process group, one rank at a time: the driver must not touch it
    for name, value in (("is_initialized", lambda: True), ("get_world_size", lambda group=None: 2),
                        ("get_rank", lambda group=None: 1)):
        monkeypatch.setattr(dist, name, value)
    for name in ("all_reduce", "all_gather", "barrier", "broadcast", "new_group", "send", "recv"):
        monkeypatch.setattr(dist, name, lambda *args, _name=name, **kwargs: pytest.fail(f"dist.{_name} called"))
    figures = calibrate_fixed.measure_fixed_costs(repeats=5)
    assert counts == {1: calibrate_fixed.FIXED_WARMUP + 5, 8: calibrate_fixed.FIXED_WARMUP + 5}
    assert 0 < figures["action_overhead"] < 0.05 and 0 <= figures["step_overhead"] < 0.05, figures
    assert {"action_overhead", "step_overhead"} <= set(calibrate_measure.DEVICE_KEYS)


def test_a_cache_from_before_the_fixed_costs_is_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    device = {"float32": 2e10, "bfloat16": 1e9, "float16": 1.5e9, "memory_bandwidth": 8e9, "kernel_launch": 7e-6,
              "split_backward_overhead": 0.375}
    path = calibrate.cache_path("cpu")
    calibrate.write_cache(path, {"device": device})  # what calibration wrote before these figures
    fresh = {**device, "action_overhead": 6e-5, "step_overhead": 3e-5}
    monkeypatch.setattr(calibrate, "measure_device", lambda device=None: fresh)
    assert calibrate.calibrate_here().device == fresh  # measured once ...
    monkeypatch.setattr(calibrate, "measure_device", lambda device=None: pytest.fail("measured twice"))
    assert calibrate.calibrate_here().device == fresh  # ... then cached
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # local: CPU ranks, also on a GPU machine
    cluster = parse_cluster("local:1", calibrate=True)
    assert (cluster.action_overhead_s, cluster.step_overhead_s) == (6e-5, 3e-5)


def test_a_prediction_fixed_costs_would_dominate_is_marked_a_lower_bound_without_the_figures() -> None:
    from fxpipe.planning import plan_chain

    tiny = _chain(4, 1e-6, 2e-6)
    bare = _cluster(0.0, 0.0, latency_s=1e-4)
    plan = plan_chain(tiny, bare, 8, layout="2", num_microbatches=2)
    assert [note for note in plan.notes if "is a lower bound" in note], plan.notes
    assert plan.predicted is not None and f"{plan.predicted.iteration_time_s * 1e3:.3g} ms" in plan.notes[-1]
    counted = plan_chain(tiny, replace(bare, action_overhead_s=ACTION_S), 8, layout="2", num_microbatches=2)
    assert not [note for note in counted.notes if "is a lower bound" in note]  # counted now
    assert counted.predicted is not None and counted.predicted.iteration_time_s > plan.predicted.iteration_time_s
    # ... but still most of the step: measured steps of that kind ran longer than predicted, and the note says so
    likely = [note for note in counted.notes if "is likely a lower bound" in note]
    assert likely and f"{counted.predicted.iteration_time_s * 1e3:.3g} ms" in likely[0], counted.notes
    counted_heavy = plan_chain(_chain(4, 0.1, 0.2), replace(bare, action_overhead_s=ACTION_S), 8, layout="2",
                               num_microbatches=2)
    assert not [note for note in counted_heavy.notes if "lower bound" in note]
    heavy = plan_chain(_chain(4, 0.1, 0.2), bare, 8, layout="2", num_microbatches=2)
    assert not [note for note in heavy.notes if "lower bound" in note]  # compute dominates: an honest estimate


def test_compile_scales_the_calibrated_cpu_work_by_the_jobs_stretch_as_the_blocks() -> None:
    from fxpipe.job_costs import JobCosts
    from fxpipe.passes.profile import MeasuredCosts

    cluster = _cluster()  # 2 ranks on 1 core: the simulator stretches compute 2x itself
    measured = MeasuredCosts((), (2, 8), "cpu", stretch=3.0)
    planned = JobCosts("measured", measured).planning_cluster(cluster)
    assert (planned.action_overhead_s, planned.step_overhead_s) == pytest.approx((ACTION_S * 1.5, STEP_S * 1.5))
    on_gpu = JobCosts("measured", replace(measured, device="cuda")).planning_cluster(cluster)
    assert (on_gpu.action_overhead_s, on_gpu.step_overhead_s) == (ACTION_S, STEP_S)  # wall clock: as calibrated
