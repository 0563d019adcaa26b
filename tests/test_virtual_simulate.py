"""Virtual-stage simulator: fxpipe.sim.virtual_simulate against the separately written tests/reference_virtual_sim.py
on random hybrid plans, and the bubbles the schedules are known for on uniform chunks with free communication."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from reference_virtual_sim import reference_virtual_run
from test_oracle_simulate import with_resaved

from fxpipe.core.chain import Block, BlockTensorParallel, CostChain, SharedParam
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, PlanError, StagePlan
from fxpipe.core.schedule import ScheduleError, make_schedule
from fxpipe.core.virtual import chunk_groups_for
from fxpipe.sim.simulate import simulate
from fxpipe.sim.virtual_simulate import simulate_virtual

VIRTUAL_SCHEDULES = ("interleaved", "interleaved_zero_bubble", "zbv")


def random_virtual_setup(seed: int) -> tuple[Plan, CostChain, Cluster, dict[str, float | str]]:
    """Drawn at random: schedule, 1-3 groups of 1-3 replicas on 2 hosts x 3 devices, 2-3 chunks per group, uneven
    chunks of 1-2 blocks, tied parameters, saved (and resaved) activations, recomputing chunks (not under the
    zero-bubble schedules), message overhead with shared cores, split overhead, weight fraction, action, step and
    optimizer costs, the optimizer's memory factor."""
    rng = random.Random(seed)
    schedule = rng.choice(VIRTUAL_SCHEDULES)
    num_groups = rng.randint(1, 3)
    virtual_stages = 2 if schedule == "zbv" else rng.choice([2, 3])
    groups = chunk_groups_for("v" if schedule == "zbv" else "loop", num_groups, virtual_stages)
    num_chunks = len(groups)
    num_blocks = num_chunks + rng.randint(0, 3)
    blocks = tuple(Block(f"b{i}", (), Affine(rng.choice([0.0, 1e-4]), rng.uniform(1e-5, 1e-3)),
                         Affine(rng.choice([0.0, 2e-4]), rng.uniform(2e-5, 2e-3)), int(10 ** rng.uniform(5, 8)),
                         Affine(rng.choice([0.0, 1e5]), 10 ** rng.uniform(3, 6))) for i in range(num_blocks))
    cuts = tuple(Affine(rng.choice([0.0, 1e3]), 10 ** rng.uniform(3, 6)) for _ in range(num_blocks - 1))
    shared: tuple[SharedParam, ...] = ()
    if rng.random() < 0.5:
        tied = tuple(sorted(rng.sample(range(num_blocks), rng.randint(2, min(3, num_blocks)))))
        shared = (SharedParam("tied", min(blocks[tied[0]].param_bytes, int(10 ** rng.uniform(4, 7))), tied),)
    chain = CostChain(with_resaved(blocks, random.Random(seed + 7)), cuts, Affine(0, 1e3), Affine(0, 1e2),
                      shared_params=shared)
    per_message = rng.choice([0.0, 3e-5])
    net = Cluster("2x3", 2, 3, DeviceSpec("dev", 2**40, (("float32", 1e13),), 1e12), LinkSpec(25e9, 5e-6),
                  LinkSpec(rng.choice([1e9, 3e9]), 2e-5), cores_per_host=rng.choice([0, 2]) if per_message else 0,
                  message_overhead_s=per_message, split_backward_overhead=rng.choice([0.0, 0.3]),
                  optimizer_s_per_param_byte=rng.choice([0.0, 2e-11]), action_overhead_s=rng.choice([0.0, 5e-5]),
                  step_overhead_s=rng.choice([0.0, 3e-4]))
    cut_points = sorted(rng.sample(range(1, num_blocks), num_chunks - 1))
    bounds = list(zip([0, *cut_points], [*cut_points, num_blocks], strict=True))
    replicas = [rng.randint(1, 2) for _ in range(num_groups)]
    pool = rng.sample(range(net.num_devices), sum(replicas))
    group_devices = [tuple(pool[sum(replicas[:g]):sum(replicas[:g + 1])]) for g in range(num_groups)]
    recompute = "zero_bubble" not in schedule and schedule != "zbv"
    stages = tuple(StagePlan(c, first, stop, replicas[groups[c]], group_devices[groups[c]],
                             recompute=recompute and rng.random() < 0.4)
                   for c, (first, stop) in enumerate(bounds))
    rows, num_microbatches = rng.choice([3, 5, 7]), rng.choice([num_groups, num_groups + 1, 2 * num_groups + 1, 6])
    plan = Plan(rows * num_microbatches, num_microbatches, stages, schedule=schedule, virtual_stages=virtual_stages,
                chunk_groups=groups)
    options: dict[str, float | str] = {"optimizer": rng.choice(["adam", "sgd"]), "weight_fraction": rng.choice([0.5, 0.3])}
    return plan, chain, net, options


def test_simulator_matches_the_separate_reference_on_random_virtual_plans() -> None:
    seen = set()
    for seed in range(60):
        plan, chain, net, options = random_virtual_setup(seed)
        seen.add((plan.schedule, plan.layout))
        weight_share = float(options.pop("weight_fraction"))
        optimizer = str(options["optimizer"])
        expected = reference_virtual_run(plan, chain, net, optimizer=optimizer, weight_share=weight_share)
        result = simulate_virtual(plan, chain, net, optimizer=optimizer, weight_fraction=weight_share)
        where = f"seed {seed}: {plan.schedule} {plan.layout} v={plan.virtual_stages} M={plan.num_microbatches}"
        assert result.iteration_time_s == pytest.approx(expected.iteration_time_s, rel=1e-9), where
        assert result.allreduce_end_s == pytest.approx(expected.allreduce_end_s, rel=1e-9), where
        assert dict(zip(result.devices, result.busy_s, strict=True)) == pytest.approx(expected.busy, rel=1e-9), where
        assert list(result.inflight_microbatches) == expected.inflight, where
        assert list(result.peak_memory_bytes) == expected.peak_memory_bytes, where
    assert len({schedule for schedule, _ in seen}) == 3 and len(seen) > 10  # the draws cover the cases


def uniform_plan(schedule: str, num_groups: int, virtual_stages: int, num_microbatches: int,
                 forward_s: float = 1.0, backward_s: float = 2.0) -> tuple[Plan, CostChain, Cluster]:
    """Equal chunks of one block each, one device per group, nothing crossing the cuts, no parameters: free
    communication, no allreduce, no fixed costs (links without latency, so the closing sync takes nothing)."""
    groups = chunk_groups_for("v" if schedule == "zbv" else "loop", num_groups, virtual_stages)
    blocks = tuple(Block(f"b{i}", (), Affine(0.0, forward_s), Affine(0.0, backward_s), 0) for i in range(len(groups)))
    chain = CostChain(blocks, tuple(Affine(0.0, 0.0) for _ in range(len(groups) - 1)))
    free = LinkSpec(1e30, 0.0)
    net = Cluster("free", num_groups, 1, DeviceSpec("dev", 2**40, (("float32", 1e13),), 1e12), free, free)
    stages = tuple(StagePlan(c, c, c + 1, 1, (g,)) for c, g in enumerate(groups))
    plan = Plan(num_microbatches, num_microbatches, stages, schedule=schedule, virtual_stages=virtual_stages,
                chunk_groups=groups)
    return plan, chain, net


@pytest.mark.parametrize("num_groups, virtual_stages, num_microbatches",
                         [(2, 2, 4), (4, 2, 8), (4, 3, 4), (3, 4, 6), (4, 2, 12), (2, 3, 2)])
def test_interleaved_bubble_is_megatrons_formula(num_groups: int, virtual_stages: int, num_microbatches: int) -> None:
    """On uniform chunks with free communication the interleaved 1F1B bubble is (G - 1) / (v M) of the ideal
    time v M (F + B) (Narayanan et al. 2021), v times less than 1F1B's (G - 1) / M on the same chunks."""
    plan, chain, net = uniform_plan("interleaved", num_groups, virtual_stages, num_microbatches)
    ideal = virtual_stages * num_microbatches * 3.0
    result = simulate_virtual(plan, chain, net)
    assert result.iteration_time_s == pytest.approx(ideal * (1 + (num_groups - 1) / (virtual_stages * num_microbatches)))
    # the same blocks as one stage per group: DAPPLE's early backward on v-block stages
    stages = tuple(StagePlan(g, g * virtual_stages, (g + 1) * virtual_stages, 1, (g,)) for g in range(num_groups))
    flat = simulate(Plan(num_microbatches, num_microbatches, stages), chain, net)
    assert flat.iteration_time_s == pytest.approx(ideal * (1 + (num_groups - 1) / num_microbatches))


def test_interleaved_takes_m_not_a_multiple_of_g() -> None:
    """Megatron's micro-batch groups let M be other than a multiple of G (the last group takes 6 here): the bubble
    is at least the formula's (G - 1)(F + B) and well under 1F1B's (G - 1) v (F + B) on the same chunks."""
    plan, chain, net = uniform_plan("interleaved", 4, 2, 10)
    bubble = simulate_virtual(plan, chain, net).iteration_time_s - 2 * 10 * 3.0
    assert 3 * 3.0 <= bubble < 3 * 2 * 3.0 / 1.5
    with pytest.raises(ScheduleError, match="M=3 is fewer"):
        make_schedule("interleaved", 8, 3, virtual_stages=2)


@pytest.mark.parametrize("num_groups, num_microbatches", [(2, 4), (4, 8), (3, 9), (4, 12)])
def test_zero_bubble_schedules_reach_the_start_up_bound_when_f_b_w_are_equal(num_groups: int,
                                                                             num_microbatches: int) -> None:
    """With F = B = W (backward 2F, split in half; chunk 0 runs its backward whole) no schedule beats the ideal
    v M (F + B) plus the last group's wait for micro-batch 0 to cross the G - 1 groups before it, (G - 1) F.
    ZB-V (M >= 2G - 1) and the interleaved zero bubble reach exactly that; interleaved 1F1B has Megatron's
    (G - 1)(F + B)."""
    ideal = 2 * num_microbatches * 3.0
    bubbles = {name: simulate_virtual(*uniform_plan(name, num_groups, 2, num_microbatches)).iteration_time_s - ideal
               for name in VIRTUAL_SCHEDULES}
    assert bubbles == pytest.approx({"zbv": num_groups - 1.0, "interleaved_zero_bubble": num_groups - 1.0,
                                     "interleaved": 3.0 * (num_groups - 1)})


def test_what_the_virtual_simulator_does_not_model_yet_is_refused() -> None:
    plan, chain, net = uniform_plan("interleaved", 2, 2, 4)
    with pytest.raises(ValueError, match="simulate_virtual"):
        simulate(plan, chain, net)  # the one-stage-per-group simulator points to the virtual one
    with pytest.raises(PlanError, match="gradient buckets are not supported with virtual stages"):
        plan.with_updates(allreduce_bucket_bytes=2**20)  # the plan itself: the runtime would run it unbucketed
    # sharded chunks are simulated: tests/test_virtual_sharded_cost.py
    with pytest.raises(ScheduleError, match="build it with make_schedule"):
        simulate_virtual(plan, chain, net, schedule=make_schedule("interleaved", 4, 8, virtual_stages=2))


def test_the_command_line_simulates_and_shows_a_virtual_plan(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from fxpipe.cli import main
    from fxpipe.core.planfile import save_plan_file

    plan, chain, net = uniform_plan("zbv", 2, 2, 4)
    save_plan_file(tmp_path / "plan.json", plan, chain, net)
    assert main(["simulate", str(tmp_path / "plan.json")]) == 0
    printed = capsys.readouterr().out
    assert f'"iteration_time_s": {simulate_virtual(plan, chain, net).iteration_time_s}' in printed
    assert main(["show", str(tmp_path / "plan.json"), "--schedule"]) == 0
    assert "group 1  1F0  2F0  1F1" in capsys.readouterr().out


def test_tensor_parallel_groups_run_their_share() -> None:
    """Chunks of 2-way tensor-parallel groups whose blocks split whole (every second of time and byte of weights
    and activations divides by T, no collective bytes, free links): the iteration takes half the time and each
    member holds half the bytes of the same plan without tensor parallelism, and both members of a group are busy."""
    plan, chain, net = uniform_plan("interleaved", 2, 2, 4)
    split = BlockTensorParallel(1.0, 2**20, 1.0, Affine(0.0, 0.0), 0)
    chain = replace(chain, blocks=tuple(replace(b, param_bytes=2**20, saved_bytes=Affine(0.0, 2**20), tp=split)
                                        for b in chain.blocks))
    net = replace(net, num_hosts=1, devices_per_host=4)
    whole = simulate_virtual(plan, chain, net)
    stages = tuple(replace(stage, devices=(2 * stage.devices[0], 2 * stage.devices[0] + 1), tensor_parallel=2)
                   for stage in plan.stages)
    halved = simulate_virtual(plan.with_updates(stages=stages), chain, net)
    assert halved.iteration_time_s == pytest.approx(whole.iteration_time_s / 2)
    assert [2 * peak for peak in halved.peak_memory_bytes] == pytest.approx(whole.peak_memory_bytes, rel=1e-6)
    assert halved.devices == (0, 1, 2, 3) and halved.busy_s[0] == halved.busy_s[1] > 0
