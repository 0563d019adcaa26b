"""The virtual planner's per-group choices (passes/partition/virtual_choices.py): per-block recompute on chunks where
a group does not fit, the ZeRO level of each group under sharding="auto", both priced by the virtual simulator."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_virtual_planner import fast_cluster

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, validate_plan
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import InfeasiblePlanError, PlanRequest
from fxpipe.passes.partition.virtual_choices import group_levels, pick_chunk_choices
from fxpipe.passes.partition.virtual_search import Trial, chunk_plan
from fxpipe.sim.virtual_simulate import group_peak_bytes, simulate_virtual, virtual_schedule


def core_chain(num_blocks: int = 8) -> CostChain:
    """Blocks whose saved activations dominate memory, half of them in an attention core that is cheap to rerun."""
    blocks = tuple(Block(f"b{i}", (), Affine(0, 1e-3), Affine(0, 2e-3), 10**6, Affine(0, 4e6),
                         attention_core_bytes=Affine(0, 2e6), attention_core_s=Affine(0, 1e-4))
                   for i in range(num_blocks))
    return CostChain(blocks, tuple(Affine(0, 1e3) for _ in range(num_blocks - 1)), Affine(0, 1e3), Affine(0, 1e2))


def forced(chain: CostChain, memory_bytes: int, **options: object) -> Plan:
    return partition(chain, fast_cluster(memory_bytes=memory_bytes, bandwidth=1e15), 8, layout="1:1",
                     num_microbatches=4, virtual_stages=2, schedule="interleaved", **options)  # type: ignore[arg-type]


def group_peaks(plan: Plan, chain: CostChain) -> list[int]:
    schedule = virtual_schedule(plan.schedule, len(plan.stages), plan.num_microbatches, plan.virtual_stages)
    return [group_peak_bytes(plan, chain, schedule, g, "adam") for g in range(plan.num_groups)]


def with_every_chunk(plan: Plan, **changes: object) -> Plan:
    return plan.with_updates(stages=tuple(replace(s, **changes) for s in plan.stages))  # type: ignore[arg-type]


def test_chunks_that_do_not_fit_recompute_per_block_and_fit() -> None:
    chain = core_chain()
    kept = forced(chain, 2**40, recompute="never")
    peaks = group_peaks(kept, chain)
    limit = max(peaks) - 3 * 10**6  # a few cores' bytes short of keeping everything
    plan = forced(chain, limit)
    validate_plan(plan)
    assert any(stage.block_recompute for stage in plan.stages)
    assert not any(stage.recompute for stage in plan.stages)  # no whole-chunk checkpoint needed
    assert max(group_peaks(plan, chain)) <= limit
    assert [s.block_node_counts for s in plan.stages if s.block_recompute] == [
        (0,) * (s.stop_block - s.first_block) for s in plan.stages if s.block_recompute]
    net = fast_cluster(memory_bytes=limit, bandwidth=1e15)
    assert plan.predicted is not None
    assert simulate_virtual(plan, chain, net).iteration_time_s == pytest.approx(plan.predicted.iteration_time_s)
    # faster than the whole-chunk checkpoints the planner fell back to before (the same cuts, every chunk whole)
    whole = with_every_chunk(plan, recompute=True, block_recompute=(), block_node_counts=())
    assert simulate_virtual(whole, chain, net).iteration_time_s > plan.predicted.iteration_time_s * 1.01
    # cheapest that fits: taking back any one recomputed block's choice overflows the group
    for index, stage in enumerate(plan.stages):
        for offset, choice in enumerate(stage.block_recompute):
            if choice == "keep":
                continue
            cheaper = (*stage.block_recompute[:offset], "keep", *stage.block_recompute[offset + 1:])
            trial = plan.with_updates(stages=tuple(
                replace(s, block_recompute=cheaper) if i == index else s for i, s in enumerate(plan.stages)))
            assert max(group_peaks(trial, chain)) > limit, (index, offset)


def test_a_forced_v_that_fits_only_per_block_or_whole_picks_the_cores() -> None:
    """Only cores recomputed (1e-4 s per block) against whole blocks (1e-3 s): the cores fit, so no block reruns whole."""
    chain = core_chain()
    peaks = group_peaks(forced(chain, 2**40, recompute="never"), chain)
    plan = forced(chain, max(peaks) - 10**7)
    choices = {choice for stage in plan.stages for choice in stage.block_recompute}
    assert choices <= {"keep", "attention"} and "attention" in choices
    with pytest.raises(InfeasiblePlanError):
        forced(chain, max(peaks) - 10**7, recompute="never")


def test_split_backward_schedules_keep_their_chunks_whole() -> None:
    """The runtime cannot rerun a checkpoint under a split backward: interleaved zero-bubble takes no choices."""
    chain = core_chain()
    plan = partition(chain, fast_cluster(bandwidth=1e15), 8, layout="1:1", num_microbatches=4, virtual_stages=2,
                     schedule="interleaved_zero_bubble")
    limit = max(stage.peak_memory_bytes for stage in plan.stages) - 10**6
    with pytest.raises(InfeasiblePlanError):
        partition(chain, fast_cluster(memory_bytes=limit, bandwidth=1e15), 8, layout="1:1", num_microbatches=4,
                  virtual_stages=2, schedule="interleaved_zero_bubble")


def replicated(chain: CostChain, memory_bytes: int, sharding: str, recompute: str = "never") -> Plan:
    """Two groups of two replicas, v = 2: groups whose weights dominate memory."""
    return partition(chain, fast_cluster(memory_bytes=memory_bytes, bandwidth=1e11), 8, layout="2:2",
                     num_microbatches=2, virtual_stages=2, schedule="interleaved", sharding=sharding,
                     recompute=recompute)


def weight_chain() -> CostChain:
    blocks = tuple(Block(f"b{i}", (), Affine(0, 1e-3), Affine(0, 2e-3), 10**8, Affine(0, 1e3)) for i in range(8))
    return CostChain(blocks, tuple(Affine(0, 1e3) for _ in range(7)), Affine(0, 1e3), Affine(0, 1e2))


def test_sharding_auto_shards_the_groups_that_do_not_fit_unsharded() -> None:
    chain = weight_chain()
    unsharded = replicated(chain, 2**40, "none")
    assert {stage.sharding for stage in unsharded.stages} == {"none"}
    roomy = replicated(chain, 2**40, "auto")
    assert {stage.sharding for stage in roomy.stages} == {"none"}  # sharding costs collectives it does not need
    limit = max(group_peaks(unsharded, chain)) - 10**8
    with pytest.raises(InfeasiblePlanError):
        replicated(chain, limit, "none")
    plan = replicated(chain, limit, "auto")
    validate_plan(plan)
    levels = [stage.sharding for stage in plan.stages]
    assert set(levels) - {"none"}, levels
    for group in range(plan.num_groups):  # one level per group
        assert len({plan.stages[c].sharding for c in plan.chunks_of_group(group)}) == 1
    assert max(group_peaks(plan, chain)) <= limit
    assert plan.predicted is not None
    net = fast_cluster(memory_bytes=limit, bandwidth=1e11)
    assert simulate_virtual(plan, chain, net).iteration_time_s == pytest.approx(plan.predicted.iteration_time_s)
    # the lowest level that fits: ZeRO-1 here, as cheap in collectives as the allreduce and enough for the memory
    assert set(levels) == {"optimizer"}


def test_sharding_auto_offers_zero3_only_without_a_split_backward() -> None:
    chain = weight_chain()
    plan = replicated(chain, 2**40, "none")
    request = PlanRequest(chain=chain, cluster=fast_cluster(), global_batch_size=8, sharding="auto")
    for name, split in (("interleaved", False), ("interleaved_zero_bubble", True)):
        schedule = virtual_schedule(name, len(plan.stages), plan.num_microbatches, plan.virtual_stages)
        assert schedule.split_backward is split
        assert group_levels(request, plan, 0, schedule) == (
            ("none", "optimizer", "gradients") if split else ("none", "optimizer", "gradients", "parameters"))
        assert group_levels(replace(request, sharding="gradients"), plan, 0, schedule) == ("gradients",)
        assert group_levels(replace(request, sharding="none"), plan, 0, schedule) == ("none",)


def test_per_block_choices_fit_wherever_recomputing_every_block_does() -> None:
    """Random chains and loops: for a limit between what recomputing every block and keeping everything need, the
    greedy finds choices, and the virtual simulator's memory of them fits (up to a byte per chunk: ceilings)."""
    for seed in range(40):
        rng = random.Random(seed)
        num_groups, virtual_stages = rng.choice([2, 3]), rng.choice([2, 3])
        num_blocks = num_groups * virtual_stages * 2
        blocks = tuple(Block(f"b{i}", (), Affine(0, rng.uniform(1e-4, 1e-3)), Affine(0, 2e-3), rng.choice([10**5, 10**7]),
                             Affine(0, rng.uniform(1e5, 4e6)), attention_core_bytes=Affine(0, rng.choice([0.0, 5e5])),
                             attention_core_s=Affine(0, 1e-4)) for i in range(num_blocks))
        chain = CostChain(blocks, tuple(Affine(0, rng.uniform(1e2, 1e4)) for _ in range(num_blocks - 1)),
                          Affine(0, 1e3), Affine(0, 1e2))
        net = fast_cluster(num_groups, bandwidth=1e15)
        num_microbatches = rng.choice([num_groups, num_groups + 1, 2 * num_groups])
        model = CandidateCosts(chain, net, num_microbatches, "adam", 2**40)
        groups = tuple(((g,), 1) for g in range(num_groups))
        trial = Trial(groups, virtual_stages, "interleaved", 1, tuple(range(2, num_blocks + 1, 2)))
        plan = chunk_plan(model, trial, "dapple")
        schedule = virtual_schedule(plan.schedule, len(plan.stages), plan.num_microbatches, plan.virtual_stages)
        for group in range(num_groups):
            chunks = plan.chunks_of_group(group)
            every = plan.with_updates(stages=tuple(replace(s, block_recompute=("block", "block"))
                                                   if s.stage_index in chunks else s for s in plan.stages))
            low = group_peak_bytes(every, chain, schedule, group, "adam")
            high = group_peak_bytes(plan, chain, schedule, group, "adam")
            limit = low + rng.random() * (high - low)
            picked = pick_chunk_choices(model, plan, group, "none", limit + len(chunks))
            assert picked is not None, (seed, group)
            chosen = plan.with_updates(stages=tuple(replace(s, block_recompute=picked[0][chunks.index(s.stage_index)])
                                                    if s.stage_index in chunks else s for s in plan.stages))
            assert group_peak_bytes(chosen, chain, schedule, group, "adam") <= limit + 2 * len(chunks), (seed, group)
