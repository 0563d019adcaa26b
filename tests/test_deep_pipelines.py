"""On large (host-aligned) clusters the planner searches a coarsened chain of a few blocks, which cannot make a
pipeline deeper than that. A model whose blocks each need a device of their own (an MoE layer: its fused experts
neither cut nor split by tensor parallelism) must still get its deep pipeline, on every cluster with enough
devices, not only where a uniform grid happens to use all of them. And an infeasible-plan error never shows a
"closest attempt" that fits."""

from __future__ import annotations

import pytest
from planner_cases import GiB, chain, cluster, mixed_case

from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import InfeasiblePlanError

BLOCK_PARAM_BYTES = int(2.5 * GiB)  # x4 with Adam: 10 GiB a block, two do not fit in 16 GiB


def _heavy_chain(num_blocks: int):  # type: ignore[no-untyped-def]
    return chain([1.0] * num_blocks, [BLOCK_PARAM_BYTES] * num_blocks)


@pytest.mark.parametrize("hosts", [7, 8, 12])
def test_blocks_that_each_need_a_device_get_one_stage_each_on_any_large_cluster(hosts: int) -> None:
    """56 such blocks: 7, 8 and 12 hosts of 8 devices all have enough devices (56 on 7 hosts, exactly)."""
    plan = partition(_heavy_chain(56), cluster(hosts, 8), 512)
    assert len(plan.stages) == 56
    assert all(stage.stop_block - stage.first_block == 1 for stage in plan.stages)
    limit = 16 * GiB
    assert all(stage.peak_memory_bytes <= limit for stage in plan.stages)


def test_the_deep_pipeline_is_replicated_where_the_devices_allow() -> None:
    """On 14 hosts (112 devices) each of the 56 one-block stages gets two replicas, faster than one each."""
    plan = partition(_heavy_chain(56), cluster(14, 8), 512)
    assert [len(stage.devices) for stage in plan.stages] == [2] * 56
    single = partition(_heavy_chain(56), cluster(14, 8), 512, layout=":".join(["1"] * 56))
    assert plan.predicted is not None and single.predicted is not None
    assert plan.predicted.iteration_time_s < single.predicted.iteration_time_s


def test_too_few_devices_is_infeasible_and_the_closest_attempt_does_not_fit() -> None:
    """56 blocks on 6 hosts (48 devices): some device must hold two blocks; the error's table shows it."""
    with pytest.raises(InfeasiblePlanError) as caught:
        partition(_heavy_chain(56), cluster(6, 8), 512)
    assert "OVER" in str(caught.value)


def test_every_device_gets_a_role_when_asked() -> None:
    """``all_devices`` (what fxpipe.compile asks) on 8 hosts: 56 stages on all 64 devices, the 8 left over as second
    replicas, with the note that 56 ranks would be faster."""
    plan = partition(_heavy_chain(56), cluster(8, 8), 512, all_devices=True)
    assert len(plan.stages) == 56 and plan.world_size == 64
    assert sorted(len(stage.devices) for stage in plan.stages) == [1] * 48 + [2] * 8
    assert any("a plan on 56 of the 64 devices" in note for note in plan.notes)


def test_virtual_stages_lay_a_block_a_chunk_on_groups_that_need_not_divide_the_devices() -> None:
    """v = 2 on 32 devices of 24 GiB, where a device holds two blocks but not three: 28 groups of one device, a block a
    chunk (4 devices idle). Groups of 2, 4, ... dividing 32 give chunks of two blocks or more (32 x 2 chunks > 56)."""
    plan = partition(_heavy_chain(56), cluster(4, 8, memory_gib=24), 512, virtual_stages=2, schedule="interleaved")
    assert plan.virtual_stages == 2 and plan.num_groups == 28 and len(plan.stages) == 56
    assert all(stage.stop_block - stage.first_block == 1 for stage in plan.stages)
    assert all(stage.peak_memory_bytes <= 24 * GiB for stage in plan.stages)


@pytest.mark.parametrize(("layout", "replicas"), [("48", ["48"]), ("8:8:8:8:8:8", ["8"] * 6)])
def test_the_closest_attempt_of_a_forced_layout_has_its_stages(layout: str, replicas: list[str]) -> None:
    """A forced layout that fits nowhere: the error's table shows the stages asked for, not another layout's."""
    with pytest.raises(InfeasiblePlanError) as caught:
        partition(_heavy_chain(56), cluster(6, 8), 512, layout=layout, sharding="parameters")
    rows = [line.split() for line in str(caught.value).splitlines() if line.strip().endswith(("OVER", "ok"))]
    assert [row[2] for row in rows] == replicas
    assert all(row[-1] == "OVER" for row in rows)


def test_the_free_plan_is_no_slower_than_a_uniform_layout_a_user_could_force() -> None:
    """40 mixed blocks on 3 x 8 devices, batch 64: the free plan was predicted at 1.16x the time of 12 stages of 2
    replicas, forced, when the search of the coarsened chain pruned that layout (0.715 s against 0.616 s)."""
    chain_, devices, batch = mixed_case(4)  # 40 blocks, 3 x 8 devices of 16 GiB, 1 GB/s between hosts, batch 64
    free = partition(chain_, devices, batch)
    forced = partition(chain_, devices, batch, layout=":".join(["2"] * 12))
    assert free.predicted is not None and forced.predicted is not None
    assert free.predicted.iteration_time_s <= forced.predicted.iteration_time_s * (1 + 1e-9)
