"""ZeRO-2/3's per-unit collectives beside each micro-batch's compute (fxpipe.sim.unit_overlap): the formula by hand,
which clusters overlap, the simulator, pivot model and reference agreeing with it, and the planner's choice of
``reshard_after_forward`` (fxpipe.passes.partition.reshard_choice) by memory and time."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from reference_sim import reference_run
from test_oracle_simulate import assert_agrees, rich_setup

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec, parse_cluster
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.report import stage_table
from fxpipe.sim.sharding_cost import plan_sharding_comms, sharding_comm
from fxpipe.sim.simulate import simulate
from fxpipe.sim.unit_overlap import UnitCompute, exposed_backward, exposed_forward, prefetch_overlaps


def _net(name: str = "gpu", compute: float = 0.0, comm: float = 0.0, memory_bytes: int = 2**40,
         per_host: int = 4) -> Cluster:
    device = DeviceSpec(name, memory_bytes, (("float32", 1e13),), 1e12)
    return Cluster("net", 1, per_host, device, LinkSpec(1e9, 1e-5), LinkSpec(1e8, 1e-4),
                   overlap_compute_slowdown=compute, overlap_comm_slowdown=comm)


def _layers(num_blocks: int, param_bytes: int, seconds: float) -> CostChain:
    """Blocks of ``seconds`` forward and twice that backward per row, ``param_bytes`` each."""
    blocks = tuple(Block(f"b{i}", (f"n{i}",), Affine(0.0, seconds), Affine(0.0, 2 * seconds), param_bytes,
                         Affine(0.0, 1e3)) for i in range(num_blocks))
    return CostChain(blocks, tuple(Affine(0.0, 1e3) for _ in range(num_blocks - 1)), Affine(0, 1e3), Affine(0, 1e2))


def test_exposed_time_by_hand() -> None:
    free = _net()
    compute = UnitCompute((2.0, 0.5, 1.0), (1.0, 1.0, 0.2))
    # forward, 1 s per unit's all-gather: the first waits; the second hides behind 2 s, the third 0.5 s beyond 0.5 s
    assert exposed_forward(3.0, compute, free) == pytest.approx(1.0 + 0.0 + 0.5)
    # backward, last unit first, 1 s gathers and 0.4 s scatters: the first gather waits; 0.2 s beside the next
    # gather (0.8 s late); 1 s beside a scatter and a gather (1.4 s: 0.4 late); 1 s beside a scatter (hidden);
    # the last scatter ends it
    assert exposed_backward(3.0, 1.2, compute, free) == pytest.approx(1.0 + 0.8 + 0.4 + 0.0 + 0.4)
    # kept or ZeRO-2: no gathers; each scatter hides behind the next unit's 1 s, the last one ends the backward
    assert exposed_backward(0.0, 1.2, compute, free) == pytest.approx(0.0 + 0.0 + 0.0 + 0.4)
    # contention: beside 2 s of compute a 1 s gather takes 1.1 s, the compute 1.19x as long meanwhile
    slowed = _net(compute=0.19, comm=0.1)
    hidden_late = 1.1 - 1.1 / 1.19  # the compute lost while the gather ran
    # 0.5 s beside 1 s: compute ends at 0.595, the gather has 1 - 0.595 / 1.1 left alone
    short_late = 0.595 + (1.0 - 0.595 / 1.1) - 0.5
    assert exposed_forward(3.0, compute, slowed) == pytest.approx(1.0 + hidden_late + short_late)


def test_cpu_ranks_charge_the_collectives_whole_and_gpus_overlap_them() -> None:
    chain = _layers(4, 10**8, 1e-3)
    plan = Plan(8, 2, (StagePlan(0, 0, 4, 4, (0, 1, 2, 3), sharding="parameters"),), allreduce_bucket_bytes=0)
    whole = sharding_comm(_net(), "parameters", (0, 1, 2, 3), 4e8, 4e8, num_units=4)
    cpu = parse_cluster("1x4:cpu")
    assert not prefetch_overlaps(cpu) and not prefetch_overlaps(_net("CPU(calibrated)"))
    assert prefetch_overlaps(parse_cluster("dgx-h100")) and prefetch_overlaps(_net())
    assert plan_sharding_comms(plan, chain, replace(_net(), device=replace(_net().device, name="CPU")))[0] == whole
    overlapped = plan_sharding_comms(plan, chain, _net())[0]
    assert 0 < overlapped.forward_s < whole.forward_s and 0 < overlapped.backward_s < whole.backward_s
    # one unit has nothing to prefetch: the whole charge
    one = Plan(8, 2, (StagePlan(0, 0, 1, 4, (0, 1, 2, 3), sharding="parameters"),), allreduce_bucket_bytes=0)
    assert plan_sharding_comms(one, chain, _net())[0] == sharding_comm(_net(), "parameters", (0, 1, 2, 3), 1e8, 1e8)


def test_zero2_overlaps_its_scatters_except_under_split_backward() -> None:
    chain = _layers(4, 10**8, 1e-3)
    stages = (StagePlan(0, 0, 2, 2, (0, 1), sharding="gradients"), StagePlan(1, 2, 4, 2, (2, 3), sharding="gradients"))
    fused = plan_sharding_comms(Plan(8, 2, stages, allreduce_bucket_bytes=0), chain, _net())
    split = plan_sharding_comms(Plan(8, 2, stages, schedule="zero_bubble", allreduce_bucket_bytes=0), chain, _net())
    whole = sharding_comm(_net(), "gradients", (0, 1), 2e8, 2e8, num_units=2)
    assert split[1] == whole and fused[1].backward_s < whole.backward_s and fused[1].start_s == whole.start_s


@pytest.mark.parametrize("seconds", [1e-4, 1e-2])  # collectives longer than a unit's compute, and hidden by it
@pytest.mark.parametrize("level, reshard", [("gradients", None), ("parameters", None), ("parameters", False)])
def test_simulator_pivot_model_and_reference_agree_on_a_sharded_stage(seconds: float, level: str,
                                                                     reshard: bool | None) -> None:
    chain, net = _layers(4, 10**7, seconds), _net(compute=0.19, comm=0.1)
    plan = Plan(16, 4, (StagePlan(0, 0, 4, 4, (0, 1, 2, 3), sharding=level, reshard_after_forward=reshard),),
                allreduce_bucket_bytes=0)
    time_s = simulate(plan, chain, net).iteration_time_s
    assert time_s == pytest.approx(reference_run(plan, chain, net).iteration_time_s, rel=1e-12)
    assert time_s == pytest.approx(analytic_iteration_time(plan, chain, net), rel=1e-12)
    blocking = replace(net, device=replace(net.device, name="CPU"))
    assert time_s < simulate(plan, chain, blocking).iteration_time_s


def test_random_pipelines_with_zero3_agree_with_the_reference_under_contention() -> None:
    for seed in range(300, 340):
        plan, chain, net, options = rich_setup(seed)
        pick = random.Random(seed)
        levels = ("gradients", "parameters") if plan.schedule != "zero_bubble" else ("gradients",)
        stages = tuple(replace(stage, sharding=pick.choice(levels), reshard_after_forward=pick.choice((None, False)))
                       if stage.replicas > 1 else stage for stage in plan.stages)
        stages = tuple(stage if stage.sharding == "parameters" else replace(stage, reshard_after_forward=None)
                       for stage in stages)
        net = replace(net, overlap_compute_slowdown=0.19, overlap_comm_slowdown=0.1)
        assert_agrees(plan.with_updates(stages=stages), chain, net, f"seed {seed}", **options)


def _forced_zero3(memory_bytes: int) -> Plan:
    chain = _layers(4, 10**8, 1e-3)
    return partition(chain, _net(memory_bytes=memory_bytes), 16, layout="dp", sharding="parameters",
                     num_microbatches=4, recompute="never")


def test_the_planner_keeps_the_weights_where_they_fit_and_frees_them_where_memory_forces_it() -> None:
    # one stage of 4 replicas, P = 4e8 in 4 units (U = P/4), M = 4: ZeRO-3 P + 5U = 2.25P, kept 2.5P
    # (ZeRO-2's figure, fxpipe.sim.sharding_memory); keeping saves the backward's gathers: time picks it
    roomy = _forced_zero3(int(2.6 * 4e8))
    assert roomy.stages[0].reshard_after_forward is False
    assert 2.5 * 4e8 <= roomy.stages[0].peak_memory_bytes <= 2.6 * 4e8
    freed = _forced_zero3(int(2.4 * 4e8))  # the kept weights do not fit: memory forces freeing them
    assert freed.stages[0].reshard_after_forward is True
    assert freed.stages[0].peak_memory_bytes <= 2.4 * 4e8
    assert roomy.predicted.iteration_time_s < freed.predicted.iteration_time_s  # type: ignore[union-attr]
    # the step's collectives, whole: M all-gathers and M reduce-scatters kept, 2M and M freed (4 units each)
    gather = sharding_comm(_net(), "parameters", (0, 1, 2, 3), 4e8, 4e8, num_units=4).forward_s
    assert freed.stages[0].allreduce_s - roomy.stages[0].allreduce_s == pytest.approx(4 * gather)
    chain, net = _layers(4, 10**8, 1e-3), _net(memory_bytes=int(2.6 * 4e8))
    assert simulate(roomy, chain, net).iteration_time_s == pytest.approx(roomy.predicted.iteration_time_s)  # type: ignore[union-attr]
    assert simulate(roomy, chain, net).peak_memory_bytes == (roomy.stages[0].peak_memory_bytes,)
    # the plan JSON and the plan table carry the choice
    assert json.loads(roomy.to_json())["stages"][0]["reshard_after_forward"] is False
    assert Plan.from_json(roomy.to_json()).stages[0].reshard_after_forward is False
    assert "parameters (kept after fwd)" in stage_table(roomy, chain, net)
    assert "parameters (reshard after fwd)" in stage_table(freed, chain, net)


def test_forcing_another_level_on_a_kept_plan_drops_the_zero3_choice() -> None:
    from fxpipe.core.sharding import force_sharding

    roomy = _forced_zero3(int(2.6 * 4e8))
    forced = force_sharding(roomy, "optimizer")
    assert [(s.sharding, s.reshard_after_forward) for s in forced.stages] == [("optimizer", None)]
    assert Plan.from_json(forced.to_json()) == forced  # a valid plan: the field belongs to ZeRO-3 stages only
    assert force_sharding(roomy, "parameters").stages[0].reshard_after_forward is False
