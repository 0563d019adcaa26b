"""Simulator oracle: fxpipe.simulate against the separately written reference in tests/reference_sim.py
(own row slicing, routing, lowering, allreduce with buckets and ties, message costs, core sharing, split
backward, recomputation, optimizer step, memory) on random hybrid layouts under every training schedule.

Nothing here or there imports the simulator's helpers (``_replica_specs``, ``stage_cost``, ``allreduce_time``,
``split_rows``, ``shared_rows``, ``lower``, ``stage_memory_bytes``): only the F/B/W order of the schedule is
shared, and the cost model is re-derived from the simulator's docstring.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from reference_sim import reference_run, routes, slice_bounds

from fxpipe.core.chain import Block, CostChain, SharedParam
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.sim.simulate import simulate


def random_setup(seed: int, layout: tuple[int, ...], schedule: str, policy: str,
                 per_message_s: float = 0.0) -> tuple[Plan, CostChain, Cluster]:
    """Random costs on 2 hosts x 2 devices; micro-batches of 5 or 7 rows so slices are unequal."""
    rng = random.Random(seed)
    num_stages = len(layout)
    num_blocks = num_stages + rng.randint(0, 2)
    blocks = tuple(Block(f"b{i}", (), Affine(rng.choice([0.0, 1e-4]), rng.uniform(1e-5, 1e-3)),
                         Affine(rng.choice([0.0, 2e-4]), rng.uniform(2e-5, 2e-3)), int(10 ** rng.uniform(5, 8)))
                   for i in range(num_blocks))
    cuts = tuple(Affine(rng.choice([0.0, 1e3]), 10 ** rng.uniform(3, 6)) for _ in range(num_blocks - 1))
    chain = CostChain(blocks, cuts)
    device = DeviceSpec("dev", 2**40, (("float32", 1e13),), 1e12)
    net = Cluster("2x2", 2, 2, device, LinkSpec(25e9, 5e-6), LinkSpec(rng.choice([1e9, 3e9]), 2e-5),
                  cores_per_host=1 if per_message_s > 0 else 0, message_overhead_s=per_message_s)
    cut_points = sorted(rng.sample(range(1, num_blocks), num_stages - 1))
    bounds = list(zip([0, *cut_points], [*cut_points, num_blocks], strict=True))
    devices = list(range(sum(layout)))
    rng.shuffle(devices)  # placements that mix hosts inside a stage and across cuts
    stages, used = [], 0
    for index, (count, (first, stop)) in enumerate(zip(layout, bounds, strict=True)):
        stages.append(StagePlan(index, first, stop, count, tuple(devices[used:used + count])))
        used += count
    rows, num_microbatches = rng.choice([5, 7]), rng.choice([num_stages, num_stages + 2, 6])
    plan = Plan(rows * num_microbatches, num_microbatches, tuple(stages), schedule=schedule, warmup_policy=policy)
    return plan, chain, net


LAYOUTS = [(2, 1), (1, 2), (2, 1, 1), (3, 1), (1, 3), (1, 2, 1), (2, 2)]
SCHEDULES = [("early_backward", "A"), ("early_backward", "B"), ("gpipe", "A")]


def assert_agrees(plan: Plan, chain: CostChain, net: Cluster, where: str, **options: float | str) -> None:
    """fxpipe.simulate and the reference agree on time, allreduce windows, busy seconds and memory."""
    weight_share = options.pop("weight_fraction", 0.5)
    expected = reference_run(plan, chain, net, weight_share=float(weight_share), **options)  # type: ignore[arg-type]
    result = simulate(plan, chain, net, weight_fraction=float(weight_share), **options)  # type: ignore[arg-type]
    assert result.iteration_time_s == pytest.approx(expected.iteration_time_s, rel=1e-9), where
    assert result.allreduce_start_s == pytest.approx(expected.allreduce_start_s, rel=1e-9, abs=1e-15), where
    assert result.allreduce_end_s == pytest.approx(expected.allreduce_end_s, rel=1e-9), where
    assert dict(zip(result.devices, result.busy_s, strict=True)) == pytest.approx(expected.busy, rel=1e-9), where
    assert list(result.inflight_microbatches) == expected.inflight, where
    assert list(result.peak_memory_bytes) == expected.peak_memory_bytes, where


@pytest.mark.parametrize("schedule, policy", SCHEDULES)
def test_simulator_matches_the_separate_reference_on_hybrid_layouts(schedule: str, policy: str) -> None:
    for seed, layout in enumerate(LAYOUTS * 2):
        plan, chain, net = random_setup(seed, layout, schedule, policy)
        assert_agrees(plan, chain, net, f"seed {seed}, layout {layout}, {schedule}/{policy}, M={plan.num_microbatches}")


@pytest.mark.parametrize("schedule, policy", SCHEDULES)
def test_message_overhead_and_shared_cores_match_the_reference(schedule: str, policy: str) -> None:
    for seed, layout in enumerate(LAYOUTS):
        plan, chain, net = random_setup(100 + seed, layout, schedule, policy, per_message_s=3e-5)
        assert_agrees(plan, chain, net, f"seed {100 + seed}, layout {layout}, {schedule}/{policy}")


def rich_setup(seed: int) -> tuple[Plan, CostChain, Cluster, dict[str, float | str]]:
    """Everything at once, drawn at random: any training schedule and policy, 1-4 stages of 1-3 replicas on
    2 hosts x 3 devices, tied parameters, saved activations (values saved again after a cut too), buckets (often several per stage), recomputing
    stages (not under zero-bubble, which cannot rerun a checkpointed forward), an optimizer step, message
    overhead with shared cores, split-backward overhead and weight fraction, and the optimizer's memory factor."""
    rng = random.Random(seed)
    layout = rng.choice([(1,), (3,), (2, 1), (1, 2), (2, 2), (1, 1, 1), (2, 1, 1), (1, 2, 3), (1, 1, 1, 1), (3, 1, 2)])
    num_stages = len(layout)
    num_blocks = num_stages + rng.randint(0, 3)
    blocks = tuple(Block(f"b{i}", (), Affine(rng.choice([0.0, 1e-4]), rng.uniform(1e-5, 1e-3)),
                         Affine(rng.choice([0.0, 2e-4]), rng.uniform(2e-5, 2e-3)), int(10 ** rng.uniform(5, 8.3)),
                         Affine(rng.choice([0.0, 1e5]), 10 ** rng.uniform(3, 6)))
                   for i in range(num_blocks))
    cuts = tuple(Affine(rng.choice([0.0, 1e3]), 10 ** rng.uniform(3, 6)) for _ in range(num_blocks - 1))
    shared: tuple[SharedParam, ...] = ()
    if num_blocks > 1 and rng.random() < 0.4:
        tied = tuple(sorted(rng.sample(range(num_blocks), rng.randint(2, min(3, num_blocks)))))
        shared = (SharedParam("tied", min(blocks[tied[0]].param_bytes, int(10 ** rng.uniform(4, 7))), tied),)
    chain = CostChain(with_resaved(blocks, random.Random(seed + 2 * 10**6)), cuts, Affine(0, 1e3), Affine(0, 1e2),
                      shared_params=shared)
    per_message = rng.choice([0.0, 0.0, 3e-5])
    net = Cluster("2x3", 2, 3, DeviceSpec("dev", 2**40, (("float32", 1e13),), rng.choice([1e11, 1e12])),
                  LinkSpec(25e9, 5e-6), LinkSpec(rng.choice([1e9, 3e9]), 2e-5),
                  inter_host_collective=rng.choice([None, LinkSpec(3e9, 1e-5)]),
                  cores_per_host=rng.choice([0, 2]) if per_message else 0, message_overhead_s=per_message,
                  split_backward_overhead=rng.choice([0.0, 0.3]),
                  optimizer_s_per_param_byte=rng.choice([0.0, 2e-11]))
    schedule, policy = rng.choice([*SCHEDULES, ("zero_bubble", "A"), ("zero_bubble", "B")])
    overlap = random.Random(seed + 10**6)  # its own draws: the cases above stay as they were
    net = replace(net, overlap_compute_slowdown=overlap.choice([0.0, 0.19, 0.4]),
                  overlap_comm_slowdown=overlap.choice([0.0, 0.1, 2.5]))
    measured = random.Random(seed + 3 * 10**6)  # a sharded stage's own collective links, as calibration gives them
    net = replace(net, reduce_scatter_collective=measured.choice([None, LinkSpec(2e9, 4e-5)]),
                  all_gather_collective=measured.choice([None, LinkSpec(8e9, 1e-5)]))
    fixed = random.Random(seed + 4 * 10**6)  # the runtime's own time per action and per step, as calibration gives them
    net = replace(net, action_overhead_s=fixed.choice([0.0, 0.0, 5e-5]), step_overhead_s=fixed.choice([0.0, 3e-4]))
    cut_points = sorted(rng.sample(range(1, num_blocks), num_stages - 1))
    bounds = list(zip([0, *cut_points], [*cut_points, num_blocks], strict=True))
    devices = rng.sample(range(net.num_devices), sum(layout))
    stages, used = [], 0
    for index, (count, (first, stop)) in enumerate(zip(layout, bounds, strict=True)):
        recompute = schedule != "zero_bubble" and rng.random() < 0.4
        stages.append(StagePlan(index, first, stop, count, tuple(devices[used:used + count]), recompute=recompute))
        used += count
    rows, num_microbatches = rng.choice([3, 5, 7]), rng.choice([num_stages, num_stages + 1, 6])
    bucket = rng.choice([0, 2**20, 25 * 2**20, 10**9])
    plan = Plan(rows * num_microbatches, num_microbatches, tuple(stages), schedule=schedule, warmup_policy=policy,
                allreduce_bucket_bytes=bucket)
    options: dict[str, float | str] = {"optimizer": rng.choice(["adam", "sgd", "momentum"]),
                                       "weight_fraction": rng.choice([0.5, 0.3])}
    return plan, chain, net, options


def with_resaved(blocks: tuple[Block, ...], rng: random.Random) -> tuple[Block, ...]:
    """``blocks`` where some save again values earlier blocks saved (drawn from their own ``rng``)."""
    return tuple(replace(block, resaved=tuple((saver, Affine(rng.choice([0.0, 1e4]), 10 ** rng.uniform(3, 5)))
                                              for saver in sorted(rng.sample(range(index), rng.randint(0, min(2, index))))))
                 for index, block in enumerate(blocks))


@pytest.mark.parametrize("first_seed", range(0, 400, 100))
def test_simulator_matches_the_reference_with_buckets_zero_bubble_recompute_optimizer_and_memory(
        first_seed: int) -> None:
    for seed in range(first_seed, first_seed + 100):
        plan, chain, net, options = rich_setup(seed)
        where = (f"seed {seed}: layout {plan.layout}, {plan.schedule}/{plan.warmup_policy}, M={plan.num_microbatches}, "
                 f"buckets {plan.allreduce_bucket_bytes}, recompute {[s.recompute for s in plan.stages]}, {options}")
        assert_agrees(plan, chain, net, where, **options)


def test_rich_cases_cover_every_feature() -> None:
    """The random cases above exercise each feature they claim to (else the comparison proves little)."""
    seen: set[str] = set()
    for seed in range(400):
        plan, chain, net, _ = rich_setup(seed)
        seen |= {plan.schedule} | ({"recompute"} if any(s.recompute for s in plan.stages) else set())
        seen |= {"ties"} if chain.shared_params and len({s.stage_index for s in plan.stages for b in
                                                         chain.shared_params[0].blocks
                                                         if s.first_block <= b < s.stop_block}) > 1 else set()
        seen |= {"buckets"} if plan.allreduce_bucket_bytes and max(s.replicas for s in plan.stages) > 1 else set()
        seen |= {"optimizer"} if net.optimizer_s_per_param_byte else set()
        seen |= {"messages"} if net.message_overhead_s else set()
        seen |= {"fixed costs"} if net.action_overhead_s and net.step_overhead_s else set()
        seen |= {"resaved"} if any(saver < s.first_block for s in plan.stages
                                   for b in chain.blocks[s.first_block:s.stop_block] for saver, _ in b.resaved) else set()
        seen |= {"overlap cost"} if plan.allreduce_bucket_bytes and net.overlap_comm_slowdown and max(
            s.replicas for s in plan.stages) > 1 else set()
    assert seen == {"early_backward", "gpipe", "zero_bubble", "recompute", "ties", "buckets", "optimizer",
                    "messages", "overlap cost", "resaved", "fixed costs"}, seen


def test_reference_helpers_on_hand_cases() -> None:
    """The reference's own slicing and routing, checked by hand so its failures point at itself."""
    assert slice_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert routes(5, 2, 1) == [(0, 0, 3), (1, 0, 2)]
    assert routes(7, 3, 2) == [(0, 0, 3), (1, 0, 1), (1, 1, 1), (2, 1, 2)]


# Disagreements the reference found, where fxpipe.simulate was wrong (fixed with these checks):


def _three_stage_case(**cluster_options: float) -> tuple[Plan, CostChain, Cluster]:
    block = Block("b", (), Affine(0, 1e-3), Affine(0, 2e-3), 10**8, Affine(0, 1e4))
    chain = CostChain((block,) * 3, (Affine(0, 1e4),) * 2, shared_params=(SharedParam("tied", 10**7, (0, 2)),))
    net = Cluster("1x4", 1, 4, DeviceSpec("dev", 2**40, (("float32", 1e13),), 1e12), LinkSpec(25e9, 5e-6),
                  LinkSpec(25e9, 5e-6), **cluster_options)  # type: ignore[arg-type]
    stages = (StagePlan(0, 0, 1, 1, (0,)), StagePlan(1, 1, 2, 2, (1, 2)), StagePlan(2, 2, 3, 1, (3,)))
    return Plan(16, 4, stages, allreduce_bucket_bytes=10**12), chain, net


def test_buckets_launch_during_the_last_backward_not_after_its_gradient_send() -> None:
    """One bucket holding everything launches when the last backward ends, before the gradient send's
    packing (message overhead); it used to start after the send."""
    plan, chain, net = _three_stage_case(message_overhead_s=1e-3)
    result = simulate(plan, chain, net)
    last_backward = max(e.end_s for e in result.events if e.stage_index == 1 and e.op == "B")
    last_send = max(e.end_s for e in result.events if e.stage_index == 1 and e.op == "SG")
    assert last_send > last_backward
    assert result.allreduce_start_s[1] == last_backward


def test_optimizer_step_covers_the_stages_tied_copies() -> None:
    """The last stage holds a copy of the tied parameter and its optimizer steps it too (the memory rule
    already counted the copy's optimizer state); it used to be left out of the step's time."""
    plan, chain, net = _three_stage_case(optimizer_s_per_param_byte=1e-10)
    without = simulate(plan, chain, replace(net, optimizer_s_per_param_byte=0.0)).iteration_time_s
    assert simulate(plan, chain, net).iteration_time_s == pytest.approx(without + 1e-10 * (10**8 + 10**7), rel=1e-12)


def test_busy_time_includes_what_splitting_the_backward_costs() -> None:
    plan, chain, net = _three_stage_case(split_backward_overhead=0.5)
    result = simulate(replace(plan, schedule="zero_bubble"), chain, net)
    computed: dict[int, float] = {}
    for event in result.events:
        if event.op in ("F", "B", "W"):
            computed[event.device] = computed.get(event.device, 0.0) + event.end_s - event.start_s
    assert dict(zip(result.devices, result.busy_s, strict=True)) == pytest.approx(computed, rel=1e-12)
