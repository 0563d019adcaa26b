"""Sharded and tensor-parallel chunks priced as stages are (fxpipe.sim.virtual_simulate): each chunk of a virtual plan
against the same blocks as one stage of a plan without virtual stages, on the same devices' links: its forward, backward
and W (ZeRO's collectives and T's share included), the memory its ZeRO level saves, its reduce-scatter tail and its
step all-gather."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.core.chain import Block, BlockTensorParallel, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.timeline import TimelineEvent
from fxpipe.sim.sharding_cost import plan_sharding_comms
from fxpipe.sim.simulate import SimulationResult, simulate
from fxpipe.sim.virtual_simulate import simulate_virtual

NUM_MICROBATCHES = 4
# (plain schedule, virtual schedule); ZeRO-3 does not run under a split backward (compile_plan.check_sharded_schedule)
SCHEDULES = (("early_backward", "interleaved"), ("zero_bubble", "interleaved_zero_bubble"))
LEVELS = ("optimizer", "gradients", "parameters")


def _chain(tensor_parallel: bool) -> CostChain:
    """Four uneven blocks with parameters, saved activations and cut bytes; with a tensor-parallel share and
    collective bytes (BlockTensorParallel) when asked."""
    split = BlockTensorParallel(0.8, 2**21, 0.7, Affine(2e3, 0.0), 2) if tensor_parallel else None
    blocks = tuple(Block(f"b{i}", (), Affine(1e-4, (1 + i) * 1e-3), Affine(2e-4, (2 + i) * 1e-3), (4 + i) * 2**20,
                         Affine(1e5, 1e4), tp=split) for i in range(4))
    return CostChain(blocks, tuple(Affine(1e3, 1e4) for _ in range(3)), Affine(0, 1e3), Affine(0, 1e2))


def _cluster() -> Cluster:
    """One host (every collective on the same link), with per-action, per-message, FSDP-call, step and optimizer costs."""
    return Cluster("1x16", 1, 16, DeviceSpec("dev", 2**40, (("float32", 1e13),), 1e12), LinkSpec(25e9, 5e-6),
                   LinkSpec(3e9, 2e-5), optimizer_s_per_param_byte=2e-11, action_overhead_s=5e-5,
                   step_overhead_s=3e-4, message_overhead_s=1e-5, fsdp_call_overhead_s=4e-4)


def _plans(level: str, degree: int, schedules: tuple[str, str]) -> tuple[Plan, Plan]:
    """Four one-block chunks on two groups of 2 replicas x T (a loop, group 0 sharded at ``level``), and the same four
    blocks as four stages of 2 replicas x T on their own devices (stages 0 and 2 sharded)."""
    width = 2 * degree
    chunks = tuple(StagePlan(c, c, c + 1, 2, tuple(range((c % 2) * width, (c % 2 + 1) * width)), tensor_parallel=degree,
                             sharding=level if c % 2 == 0 else "none") for c in range(4))
    stages = tuple(replace(chunk, devices=tuple(range(c * width, (c + 1) * width))) for c, chunk in enumerate(chunks))
    batch = 2 * NUM_MICROBATCHES * 3
    return (Plan(batch, NUM_MICROBATCHES, chunks, schedule=schedules[1], virtual_stages=2, chunk_groups=(0, 1, 0, 1)),
            Plan(batch, NUM_MICROBATCHES, stages, schedule=schedules[0]))


def _durations(result: SimulationResult, device: int) -> dict[tuple[int, str], set[float]]:
    """(stage or chunk, op) -> the distinct durations of its compute actions on ``device`` (rounded: float sums)."""
    out: dict[tuple[int, str], set[float]] = {}
    for event in result.events:
        if isinstance(event, TimelineEvent) and event.device == device and event.op in ("F", "B", "W"):
            out.setdefault((event.stage_index, event.op), set()).add(round(event.end_s - event.start_s, 12))
    return out


CASES = [(level, degree, schedules) for level in LEVELS for degree in (1, 2) for schedules in SCHEDULES
         if not (level == "parameters" and schedules[0] == "zero_bubble")]


@pytest.mark.parametrize("level, degree, schedules", CASES)
def test_a_chunk_is_priced_as_the_same_blocks_as_one_stage(level: str, degree: int,
                                                           schedules: tuple[str, str]) -> None:
    chain, net = _chain(degree > 1), _cluster()
    virtual, plain = _plans(level, degree, schedules)
    unsharded = [replace(stage, sharding="none") for stage in virtual.stages]
    chunked, flat = simulate_virtual(virtual, chain, net), simulate(plain, chain, net)
    whole = simulate_virtual(virtual.with_updates(stages=tuple(unsharded)), chain, net)
    flat_whole = simulate(plain.with_updates(stages=tuple(replace(s, sharding="none") for s in plain.stages)), chain, net)
    # every F, B and W of a chunk takes what the same stage's does (its ZeRO collectives and T's share included)
    group_devices = {0: 0, 1: 2 * degree}
    for chunk in range(4):
        mine = _durations(chunked, group_devices[chunk % 2])
        theirs = _durations(flat, plain.stages[chunk].devices[0])
        for op in ("F", "B", "W"):
            assert mine.get((chunk, op)) == theirs.get((chunk, op)), (chunk, op, mine, theirs)
    # what a level changes in memory (ZeRO-2 here holds more: its per-unit gradient buffers): the sum of what it
    # changes on the two stages (the model state's part is constant over the list: it does not move the peak)
    saved = whole.peak_memory_bytes[0] - chunked.peak_memory_bytes[0]
    assert saved != 0
    assert saved == sum(flat_whole.peak_memory_bytes[s] - flat.peak_memory_bytes[s] for s in (0, 2))
    assert chunked.peak_memory_bytes[1] == whole.peak_memory_bytes[1]  # group 1 is not sharded
    # after its list: the sharded chunks' reduce-scatter tails (ZeRO-1), as each stage's span after its last backward
    span = chunked.allreduce_end_s[0] - chunked.allreduce_start_s[0]
    assert span == pytest.approx(sum(flat.allreduce_end_s[s] - flat.allreduce_start_s[s] for s in (0, 2)), abs=1e-12)
    comms = plan_sharding_comms(plain, chain, net)
    assert (span > 0) == (level == "optimizer") and comms[0].tail_s + comms[2].tail_s == pytest.approx(span)
    # before it: both chunks' step all-gathers (ZeRO-1/2) delay group 0's first forward
    first = min(e.start_s for e in chunked.events if isinstance(e, TimelineEvent) and e.device == 0 and e.op == "F")
    assert first == pytest.approx(comms[0].start_s + comms[2].start_s, abs=1e-12)
    assert (first > 0) == (level != "parameters")


@pytest.mark.parametrize("level, schedule", [("optimizer", "zbv"), ("gradients", "interleaved_zero_bubble"),
                                             ("parameters", "interleaved")])
def test_the_planner_shards_chunks_at_a_forced_level_and_predicts_what_the_simulator_says(level: str,
                                                                                         schedule: str) -> None:
    from fxpipe.passes.partition.dapple import partition

    chain, net = _chain(False), replace(_cluster(), devices_per_host=4)
    plan = partition(chain, net, 24, layout="2:2", num_microbatches=NUM_MICROBATCHES, virtual_stages=2,
                     schedule=schedule, sharding=level)
    assert (plan.layout, plan.virtual_stages, plan.schedule) == ("2:2", 2, schedule)
    assert [stage.sharding for stage in plan.stages] == [level] * 4
    assert any(f"sharded at {level!r}" in note for note in plan.notes), plan.notes
    again = simulate_virtual(plan, chain, net)
    assert plan.predicted is not None and plan.predicted.iteration_time_s == pytest.approx(again.iteration_time_s)
    assert [stage.peak_memory_bytes for stage in plan.stages] == list(again.peak_memory_bytes)
    unsharded = simulate_virtual(plan.with_updates(stages=tuple(replace(s, sharding="none") for s in plan.stages)),
                                 chain, net)
    assert again.peak_memory_bytes != unsharded.peak_memory_bytes  # the level is priced, not just recorded


def test_zero3_chunks_under_a_split_backward_and_levels_per_stage_are_not_planned() -> None:
    from fxpipe.passes.partition.dapple import partition
    from fxpipe.passes.partition.virtual_request import VirtualStagesError

    chain, net = _chain(False), replace(_cluster(), devices_per_host=4)
    plan = partition(chain, net, 24, layout="2:2", num_microbatches=NUM_MICROBATCHES, virtual_stages=2,
                     schedule="auto", sharding="parameters")  # the runtime refuses ZeRO-3 where W runs after forwards
    assert plan.schedule == "interleaved" and [stage.sharding for stage in plan.stages] == ["parameters"] * 4
    with pytest.raises(VirtualStagesError, match="levels per stage do not name chunks"):
        partition(chain, net, 24, layout="2:2", num_microbatches=NUM_MICROBATCHES, virtual_stages=2,
                  schedule="interleaved", sharding=("optimizer", "none"))
