"""Simulator oracle: a separately written event engine (own row slicing, routing, lowering, allreduce,
message costs and core sharing) against fxpipe.simulate on hybrid layouts, for early-backward
(policies A, B) and GPipe.

Nothing here imports the simulator's helpers (``_replica_specs``, ``stage_cost``, ``allreduce_time``,
``split_rows``, ``shared_rows``, ``lower``): only the F/B order of the schedule is shared, and the
cost model is re-derived from the simulator's docstring.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.schedule import make_schedule
from fxpipe.sim.simulate import simulate

Key = tuple[int, int]  # (stage, replica)


def slice_bounds(num_rows: int, num_replicas: int) -> list[tuple[int, int]]:
    """Contiguous row ranges; the first ``num_rows mod num_replicas`` replicas take one extra row."""
    bounds, start = [], 0
    for replica in range(num_replicas):
        size = num_rows // num_replicas + (1 if replica < num_rows % num_replicas else 0)
        bounds.append((start, start + size))
        start += size
    assert start == num_rows
    return bounds


def routes(num_rows: int, senders: int, receivers: int) -> list[tuple[int, int, int]]:
    """``(sender, receiver, shared rows)`` for every overlapping pair (brute force over all pairs)."""
    out = []
    for i, (a, b) in enumerate(slice_bounds(num_rows, senders)):
        for j, (c, d) in enumerate(slice_bounds(num_rows, receivers)):
            if min(b, d) > max(a, c):
                out.append((i, j, min(b, d) - max(a, c)))
    return out


def piece_seconds(net: Cluster, src: int, dst: int, num_bytes: float) -> float:
    if num_bytes <= 0:
        return 0.0
    same_host = src // net.devices_per_host == dst // net.devices_per_host
    link = net.intra_host if same_host else net.inter_host
    return link.latency_s + num_bytes / link.bandwidth_bytes_per_s


def ring_allreduce_seconds(net: Cluster, num_bytes: float, devices: tuple[int, ...]) -> float:
    count = len(devices)
    if count < 2 or num_bytes <= 0:
        return 0.0
    hosts = {d // net.devices_per_host for d in devices}
    if len(hosts) == 1:
        link = net.intra_host_collective or net.intra_host
    else:
        link = net.inter_host_collective or net.inter_host
    return 2 * (count - 1) * link.latency_s + 2 * (count - 1) * num_bytes / (count * link.bandwidth_bytes_per_s)


def gradient_allreduce_seconds(net: Cluster, num_bytes: float, devices: tuple[int, ...]) -> float:
    """The ring allreduce plus copying the gradients into one buffer and back (read + write each time)."""
    ring = ring_allreduce_seconds(net, num_bytes, devices)
    return ring + 4 * num_bytes / net.device.memory_bandwidth_bytes_per_s if ring > 0 else 0.0


def step_end_seconds(net: Cluster, plan: Plan) -> float:
    """The allreduce of seven float64 numbers (loss, count, vote, batch-check folds) over every device."""
    return ring_allreduce_seconds(net, 7 * 8, tuple(sorted({d for stage in plan.stages for d in stage.devices})))


def my_lowering(plan: Plan) -> list[list[tuple[str, int]]]:
    """Per stage: receive before each forward/backward that needs one, send after, allreduce handled apart."""
    order = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, plan.warmup_policy).per_stage
    last = plan.num_stages - 1
    programs = []
    for stage, actions in enumerate(order):
        program: list[tuple[str, int]] = []
        for action in actions:
            kind, m = action.op.value, action.microbatch_index
            receive = (kind == "F" and stage > 0) or (kind == "B" and stage < last)
            send = (kind == "F" and stage < last) or (kind == "B" and stage > 0)
            if receive:
                program.append(("R" + ("A" if kind == "F" else "G"), m))
            program.append((kind, m))
            if send:
                program.append(("S" + ("A" if kind == "F" else "G"), m))
        programs.append(program)
    return programs


@dataclass
class Replica:
    stage: int
    device: int
    forward_s: float
    backward_s: float
    sends: dict[str, list[tuple[Key, float]]] = field(default_factory=dict)  # "A"/"G" -> pieces in issue order
    expects: dict[str, int] = field(default_factory=dict)  # "A"/"G" -> pieces per receive


def stretch(net: Cluster) -> float:
    """Ranks sharing too few cores compute (and pack messages) at cores/ranks of their speed."""
    if 0 < net.cores_per_host < net.devices_per_host:
        return net.devices_per_host / net.cores_per_host
    return 1.0


def build_replicas(plan: Plan, chain: CostChain, net: Cluster) -> dict[Key, Replica]:
    rows_of = plan.global_batch_size // plan.num_microbatches
    replicas: dict[Key, Replica] = {}
    for stage in plan.stages:
        blocks = chain.blocks[stage.first_block:stage.stop_block]
        for r, (start, stop) in enumerate(slice_bounds(rows_of, stage.replicas)):
            rows = stop - start
            forward = sum(b.forward_s.fixed + b.forward_s.per_sample * rows for b in blocks) * stretch(net)
            backward = sum(b.backward_s.fixed + b.backward_s.per_sample * rows for b in blocks) * stretch(net)
            replicas[stage.stage_index, r] = Replica(stage.stage_index, stage.devices[r], forward, backward,
                                                     {"A": [], "G": []}, {"A": 0, "G": 0})
    for left, right in zip(plan.stages, plan.stages[1:], strict=False):
        cut = chain.cut_bytes[left.stop_block - 1]
        pairs = routes(rows_of, left.replicas, right.replicas)
        for i, j, rows in pairs:
            seconds = piece_seconds(net, left.devices[i], right.devices[j], cut.fixed + cut.per_sample * rows)
            replicas[left.stage_index, i].sends["A"].append(((right.stage_index, j), seconds))
            replicas[right.stage_index, j].expects["A"] += 1
        for i, j, rows in sorted(pairs, key=lambda p: (p[1], p[0])):  # gradients: each sender in receiver order
            seconds = piece_seconds(net, right.devices[j], left.devices[i], cut.fixed + cut.per_sample * rows)
            replicas[right.stage_index, j].sends["G"].append(((left.stage_index, i), seconds))
            replicas[left.stage_index, i].expects["G"] += 1
    return replicas


def reference_run(plan: Plan, chain: CostChain, net: Cluster) -> tuple[float, list[float], dict[int, float]]:
    """(iteration time, allreduce start per stage, busy seconds per device) by a plain time-ordered loop.

    Each message costs its sender and its receiver ``message_overhead_s`` (stretched like compute): a send
    first packs all its pieces, then issues them; a receive takes them after the last one arrived.
    """
    replicas = build_replicas(plan, chain, net)
    per_message = net.message_overhead_s * stretch(net)
    packed: set[tuple[Key, int]] = set()
    programs = my_lowering(plan)
    clock = dict.fromkeys(replicas, 0.0)
    cursor = dict.fromkeys(replicas, 0)
    send_free: dict[int, float] = {}
    recv_free: dict[int, float] = {}
    arrivals: dict[tuple[Key, str, int], list[float]] = {}
    blocked: set[Key] = set()
    busy: dict[int, float] = {r.device: 0.0 for r in replicas.values()}
    queue = [(0.0, key) for key in sorted(replicas)]
    while queue:
        now, key = heapq.heappop(queue)
        replica, program = replicas[key], programs[key[0]]
        if cursor[key] == len(program):
            continue
        kind, m = program[cursor[key]]
        if kind in ("F", "B"):
            seconds = replica.forward_s if kind == "F" else replica.backward_s
            busy[replica.device] += seconds
            now += seconds
        elif kind[0] == "R":
            got = arrivals.get((key, kind[1], m), [])
            if len(got) < replica.expects[kind[1]]:
                blocked.add(key)
                clock[key] = now
                continue
            now = max([now, *got]) + per_message * len(got)
        elif per_message > 0 and (key, cursor[key]) not in packed:
            packed.add((key, cursor[key]))  # pack and post, then issue the pieces at that later time
            heapq.heappush(queue, (now + per_message * len(replica.sends[kind[1]]), key))
            continue
        else:
            for other, seconds in replica.sends[kind[1]]:
                device = replicas[other].device
                start = now if seconds == 0 else max(now, send_free.get(replica.device, 0.0),
                                                     recv_free.get(device, 0.0))
                if seconds > 0:
                    send_free[replica.device] = recv_free[device] = start + seconds
                arrivals.setdefault((other, kind[1], m), []).append(start + seconds)
                if other in blocked:
                    blocked.discard(other)
                    heapq.heappush(queue, (clock[other], other))
        cursor[key] += 1
        clock[key] = now
        heapq.heappush(queue, (now, key))
    assert not blocked and all(cursor[k] == len(programs[k[0]]) for k in replicas), "the reference deadlocked"
    starts, ends = [], []
    for stage in plan.stages:
        start = max(clock[stage.stage_index, r] for r in range(stage.replicas))
        weights = sum(b.param_bytes for b in chain.blocks[stage.first_block:stage.stop_block])
        starts.append(start)
        ends.append(start + gradient_allreduce_seconds(net, weights, stage.devices))
    return max(ends) + step_end_seconds(net, plan), starts, busy


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


@pytest.mark.parametrize("schedule, policy", SCHEDULES)
def test_simulator_matches_the_separate_reference_on_hybrid_layouts(schedule: str, policy: str) -> None:
    for seed, layout in enumerate(LAYOUTS * 2):
        plan, chain, net = random_setup(seed, layout, schedule, policy)
        expected, starts, busy = reference_run(plan, chain, net)
        result = simulate(plan, chain, net)
        where = f"seed {seed}, layout {layout}, {schedule}/{policy}, M={plan.num_microbatches}"
        assert result.iteration_time_s == pytest.approx(expected, rel=1e-9), where
        assert result.allreduce_start_s == pytest.approx(starts, rel=1e-9), where
        assert dict(zip(result.devices, result.busy_s, strict=True)) == pytest.approx(busy, rel=1e-9), where


@pytest.mark.parametrize("schedule, policy", SCHEDULES)
def test_message_overhead_and_shared_cores_match_the_reference(schedule: str, policy: str) -> None:
    for seed, layout in enumerate(LAYOUTS):
        plan, chain, net = random_setup(100 + seed, layout, schedule, policy, per_message_s=3e-5)
        expected, starts, busy = reference_run(plan, chain, net)
        result = simulate(plan, chain, net)
        where = f"seed {100 + seed}, layout {layout}, {schedule}/{policy}"
        assert result.iteration_time_s == pytest.approx(expected, rel=1e-9), where
        assert result.allreduce_start_s == pytest.approx(starts, rel=1e-9), where
        assert dict(zip(result.devices, result.busy_s, strict=True)) == pytest.approx(busy, rel=1e-9), where


def test_reference_helpers_on_hand_cases() -> None:
    """The reference's own slicing and routing, checked by hand so its failures point at itself."""
    assert slice_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert routes(5, 2, 1) == [(0, 0, 3), (1, 0, 2)]
    assert routes(7, 3, 2) == [(0, 0, 3), (1, 0, 1), (1, 1, 1), (2, 1, 2)]
