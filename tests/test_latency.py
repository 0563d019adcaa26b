"""DAPPLE's analytic latency: pivot choice, the closed form, transfers as stages."""

from __future__ import annotations

import dataclasses

import pytest

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes.partition.latency import (
    analytic_iteration_time,
    pipeline_latency,
    pivot_stage,
    stage_times,
)
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import gradient_allreduce_time, message_seconds, step_end_sync_time


def test_pivot_is_the_last_of_equal_stages() -> None:
    assert pivot_stage([1.0] * 4, [2.0] * 4, 8) == 3


def test_pivot_is_a_dominant_middle_stage() -> None:
    # stage 1 is heavy: its (M-1)(F+B) outweighs what stages 2, 3 add after it
    assert pivot_stage([1.0, 3.0, 1.0, 1.0], [2.0, 6.0, 2.0, 2.0], 8) == 1
    # with one micro-batch the steady phase vanishes and the last stage wins
    assert pivot_stage([1.0, 3.0, 1.0, 1.0], [2.0, 6.0, 2.0, 2.0], 1) == 3


def test_latency_by_hand() -> None:
    forward, backward, allreduce = [1.0, 3.0, 1.0], [2.0, 6.0, 2.0], [5.0, 0.0, 20.0]
    # Q = 1: warm-up 1 + 3, steady 3 * 9, ending max(5 + 2 + 6, 0 + 6, 20 - 0)
    assert pipeline_latency(forward, backward, allreduce, 4) == 4 + 27 + 20


def test_equal_stages_give_the_known_makespan() -> None:
    assert pipeline_latency([0.25] * 3, [0.5] * 3, [0.125] * 3, 5) == (5 + 3 - 1) * 0.75 + 0.125


def test_lengths_are_checked() -> None:
    with pytest.raises(ValueError, match="one entry per stage"):
        pipeline_latency([1.0], [1.0, 2.0], [0.0], 2)
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        pivot_stage([1.0], [1.0], 0)


def test_transfers_become_stages() -> None:
    device = DeviceSpec("t", 2**34, (("float32", 1e12),), 1e11)
    net = Cluster("t", 2, 1, device, LinkSpec(2.0**20), LinkSpec(2.0**10, 2.0**-4))
    block = Block("b", (), Affine(0, 2.0**-4), Affine(0, 2.0**-3), 0)
    chain = CostChain((block, block), (Affine(0, 2.0**8),))
    plan = Plan(8, 2, (StagePlan(0, 0, 1, 1, (0,)), StagePlan(1, 1, 2, 1, (1,))))
    transfer = 2.0**-4 + 4 * 2.0**8 / 2.0**10
    forward, backward, allreduce, groups, *_ = stage_times(plan, chain, net)
    assert forward == [0.25, transfer, 0.25] and backward == [0.5, transfer, 0.5]
    assert allreduce == [0.0, 0.0, 0.0] and groups == []
    # the link carries activations and gradients at once (full duplex): a transfer's steady time is max(F, B)
    cycles = [0.75, transfer, 0.75]
    assert pipeline_latency(forward, backward, allreduce, 2, cycle_s=cycles) == 4.375
    # the loss allreduce ending every step crosses the slow inter-host link
    assert analytic_iteration_time(plan, chain, net) == 4.375 + step_end_sync_time(net, [0, 1])
    assert pipeline_latency(forward, backward, allreduce, 2) == 5.0  # F + B charged per transfer: DAPPLE's formula
    assert simulate(plan, chain, net).iteration_time_s == 4.6875 + step_end_sync_time(net, [0, 1])  # M = 2: in between
    with pytest.raises(ValueError, match="cycle_s needs one entry per step"):
        pipeline_latency(forward, backward, allreduce, 2, cycle_s=[1.0])


@pytest.mark.parametrize(("replicas", "expected"), [((1, 1), [1, 1]), ((3, 1), [1, 3]), ((2, 3), [2, 2]),
                                                    ((2, 1, 2), [1, 4, 1]), ((4,), [0])])
def test_message_seconds_count_the_busiest_replicas_pieces(replicas: tuple[int, ...], expected: list[int]) -> None:
    device = DeviceSpec("t", 2**34, (("float32", 1e12),), 1e11)
    net = Cluster("t", 1, 8, device, LinkSpec(2.0**20), LinkSpec(2.0**20), message_overhead_s=2.0**-10)
    got = [message_seconds(net, 12, replicas, s) / 2.0**-10 for s in range(len(replicas))]
    assert got == expected
    assert message_seconds(dataclasses.replace(net, message_overhead_s=0.0), 12, replicas, 0) == 0.0
    shared = dataclasses.replace(net, cores_per_host=4)  # 8 ranks on 4 cores: stretched like compute
    assert message_seconds(shared, 12, replicas, 0) == 2 * expected[0] * 2.0**-10


@pytest.mark.parametrize("layout", ["1:1", "3:1", "2:2", "1:2:1"])
def test_the_planners_model_counts_messages_like_the_plan_level_model(layout: str) -> None:
    from fxpipe.passes.partition.dapple import partition

    device = DeviceSpec("t", 2**34, (("float32", 1e12),), 1e11)
    net = Cluster("t", 1, 4, device, LinkSpec(2.0**30, 2.0**-12), LinkSpec(2.0**30), message_overhead_s=2.0**-9)
    block = Block("b", (), Affine(2.0**-8, 2.0**-6), Affine(2.0**-8, 2.0**-5), 2**10, Affine(0, 2.0**10))
    chain = CostChain((block,) * 8, (Affine(0, 2.0**12),) * 7)
    plan = partition(chain, net, 24, layout=layout, num_microbatches=4)
    assert plan.predicted is not None
    assert plan.predicted.analytic_iteration_time_s == pytest.approx(analytic_iteration_time(plan, chain, net),
                                                                     rel=1e-12)
    without = dataclasses.replace(net, message_overhead_s=0.0)
    assert analytic_iteration_time(plan, chain, net) > analytic_iteration_time(plan, chain, without)


def _tied_chain(num_blocks: int, tied_bytes: int, cut_bytes_per_row: float = 2.0**8,
                param_bytes: int = 2**16) -> CostChain:
    from fxpipe.core.chain import SharedParam

    block = Block("b", (), Affine(2.0**-8, 2.0**-6), Affine(2.0**-8, 2.0**-5), param_bytes, Affine(0, 2.0**10))
    return CostChain((block,) * num_blocks, (Affine(0, cut_bytes_per_row),) * (num_blocks - 1),
                     shared_params=(SharedParam("wte", tied_bytes, (0, num_blocks - 1)),))


def test_tied_parameters_are_one_allreduce_after_their_last_stage() -> None:

    device = DeviceSpec("t", 2**34, (("float32", 1e12),), 1e11)
    net = Cluster("t", 1, 2, device, LinkSpec(2.0**20), LinkSpec(2.0**20))
    tied = _tied_chain(4, 2**20, cut_bytes_per_row=0.0)
    plan = Plan(16, 4, (StagePlan(0, 0, 2, 1, (0,)), StagePlan(1, 2, 4, 1, (1,))))
    forward, backward, allreduce, groups, *_ = stage_times(plan, tied, net)
    assert allreduce == [0.0, 0.0]  # one device per stage: nothing of its own to sum
    assert groups == [((0, 1), gradient_allreduce_time(net, 2**20, [0, 1]))]
    # equal stages, free transfers: the pivot formula is exact, tie allreduce included
    assert analytic_iteration_time(plan, tied, net) == simulate(plan, tied, net).iteration_time_s
    untied = CostChain(tied.blocks, tied.cut_bytes)
    assert analytic_iteration_time(plan, tied, net) - analytic_iteration_time(plan, untied, net) == \
        pytest.approx(groups[0][1], rel=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_exhaustive_lower_bound_holds_with_tied_parameters_and_buckets(seed: int) -> None:
    import random

    from fxpipe.passes.partition.candidates import CandidateCosts
    from fxpipe.passes.partition.exhaustive import _lower_bound, exhaustive_candidates
    from fxpipe.passes.partition.plan_build import build_plan

    rng = random.Random(seed)
    device = DeviceSpec("t", 2**34, (("float32", 1e12),), 1e11)
    # one host, so a tie group's allreduce runs on the links of its stages' own replica allreduces, and
    # own parameters about as large as the tied ones: summing both in one replica allreduce overestimates
    net = Cluster("t", 1, 4, device, LinkSpec(2.0**27, 1e-5), LinkSpec(2.0**27, 1e-5),
                  message_overhead_s=rng.choice([0.0, 1e-4]))
    chain = _tied_chain(rng.randint(3, 5), 2**22, param_bytes=rng.choice([2**20, 2**21]))
    # odd seeds: buckets overlap the allreduce with the last backward, so only its tail may count
    model = CandidateCosts(chain, net, 16, "adam", 2**40, allreduce_bucket_bytes=(seed % 2) * 2**19)
    for candidate in exhaustive_candidates(model, [2, 4, 8], None):
        plan = build_plan(model, candidate, schedule="early_backward", warmup_policy="A", planner="test")
        assert plan.allreduce_bucket_bytes == model.allreduce_bucket_bytes
        assert _lower_bound(model, candidate) <= simulate(plan, chain, net).iteration_time_s * (1 + 1e-12)
