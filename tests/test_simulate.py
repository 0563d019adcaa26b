"""Exact event simulator: closed-form cases, transfers and port queues, slices, memory, traces, oracles."""

from __future__ import annotations

import dataclasses
import heapq
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

from fxpipe.core.chain import Block, CostChain, SharedParam
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.schedule import ScheduleError, early_backward, gpipe, lower, make_schedule, warmup_forwards
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.sim.chrome_trace import to_chrome_trace, write_chrome_trace
from fxpipe.sim.events import ReplicaSpec, encode_program
from fxpipe.sim.simulate import SimulationResult, simulate
from fxpipe.sim.stagecost import gradient_allreduce_time, stage_cost, stage_memory_bytes, step_end_sync_time

DEVICE = DeviceSpec("test", 2**34, (("float32", 1e12),), 1e11)
# Dyadic numbers (1/16, 1/8, ...) keep every sum exact, so closed forms can be compared with ==.
FORWARD_PER_ROW = 2.0**-6
BACKWARD_PER_ROW = 2.0**-5


def load_benchmark():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "simulate_accuracy.py"
    spec = importlib.util.spec_from_file_location("simulate_accuracy", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["simulate_accuracy"] = module
    spec.loader.exec_module(module)
    return module


def cluster(num_hosts: int = 1, per_host: int = 8, bandwidth: float = 2.0**20, latency: float = 0.0) -> Cluster:
    link = LinkSpec(bandwidth, latency)
    return Cluster("test", num_hosts, per_host, DEVICE, intra_host=link, inter_host=link)


def uniform_chain(num_blocks: int, cut_bytes_per_row: float = 0.0, param_bytes: int = 2**20) -> CostChain:
    block = Block("b", (), Affine(0, FORWARD_PER_ROW), Affine(0, BACKWARD_PER_ROW), param_bytes,
                  Affine(0, 2.0**10))
    return CostChain((block,) * num_blocks, (Affine(0, cut_bytes_per_row),) * (num_blocks - 1))


def plan_of(replicas: tuple[int, ...], blocks_per_stage: int, microbatch_rows: int, num_microbatches: int,
            schedule: str = "early_backward", policy: str = "A") -> Plan:
    stages, next_device = [], 0
    for index, count in enumerate(replicas):
        devices = tuple(range(next_device, next_device + count))
        next_device += count
        stages.append(StagePlan(index, index * blocks_per_stage, (index + 1) * blocks_per_stage, count, devices))
    return Plan(microbatch_rows * num_microbatches, num_microbatches, tuple(stages), schedule=schedule,
                warmup_policy=policy)


SCHEDULES = [("gpipe", "A"), ("early_backward", "A"), ("early_backward", "B")]


@pytest.mark.parametrize("schedule,policy", SCHEDULES)
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 5, 8])
def test_equal_stages_without_communication(schedule: str, policy: str, num_stages: int,
                                            num_microbatches: int) -> None:
    rows = 4
    plan = plan_of((1,) * num_stages, 2, rows, num_microbatches, schedule, policy)
    result = simulate(plan, uniform_chain(2 * num_stages), cluster())
    step = 2 * rows * (FORWARD_PER_ROW + BACKWARD_PER_ROW)  # F + B of one stage
    sync = step_end_sync_time(cluster(), range(num_stages))  # the loss allreduce ending the step
    assert (sync > 0) == (num_stages > 1)
    assert result.iteration_time_s == (num_microbatches + num_stages - 1) * step + sync
    bubble = 1 - num_microbatches * step / result.iteration_time_s
    assert result.bubble_fraction == pytest.approx(bubble, abs=1e-12)
    assert analytic_iteration_time(plan, uniform_chain(2 * num_stages), cluster()) == result.iteration_time_s


@pytest.mark.parametrize("replicas", [1, 2, 3, 8])
def test_one_stage_is_m_compute_plus_allreduce(replicas: int) -> None:
    rows, num_microbatches = 24, 5
    chain, net = uniform_chain(3, param_bytes=2**16), cluster(2, 4, latency=2.0**-12)
    plan = plan_of((replicas,), 3, rows, num_microbatches)
    result = simulate(plan, chain, net)
    compute = num_microbatches * 3 * (rows // replicas) * (FORWARD_PER_ROW + BACKWARD_PER_ROW)
    devices = tuple(range(replicas))
    # ring allreduce, plus the gradients copied into one buffer and back at memory bandwidth
    allreduce = net.allreduce_time(3 * 2**16, devices) + 4 * 3 * 2**16 / DEVICE.memory_bandwidth_bytes_per_s
    assert gradient_allreduce_time(net, 3 * 2**16, devices) == (allreduce if replicas > 1 else 0.0)
    allreduce = gradient_allreduce_time(net, 3 * 2**16, devices)
    assert result.iteration_time_s == compute + allreduce + step_end_sync_time(net, devices)
    assert result.allreduce_end_s == (compute + allreduce,)
    assert analytic_iteration_time(plan, chain, net) == pytest.approx(result.iteration_time_s, rel=1e-15)


def test_transfer_time_adds_on_a_straight_pipeline() -> None:
    rows, cut = 4, 2.0**10  # bytes per row
    net = cluster(bandwidth=2.0**20, latency=2.0**-10)
    transfer = 2.0**-10 + rows * cut / 2.0**20
    forward, backward = rows * FORWARD_PER_ROW, rows * BACKWARD_PER_ROW
    chain = uniform_chain(2, cut)
    sync = step_end_sync_time(net, [0, 1])
    one = simulate(plan_of((1, 1), 1, rows, 1), chain, net)
    assert one.iteration_time_s == 2 * forward + 2 * backward + 2 * transfer + sync
    # GPipe, transfer shorter than a forward: (M+1)(F+B) + 2 X
    for num_microbatches in (2, 3, 6):
        result = simulate(plan_of((1, 1), 1, rows, num_microbatches, "gpipe"), chain, net)
        assert result.iteration_time_s == (num_microbatches + 1) * (forward + backward) + 2 * transfer + sync
        assert analytic_iteration_time(plan_of((1, 1), 1, rows, num_microbatches, "gpipe"), chain, net) == \
            result.iteration_time_s


def test_pieces_queue_on_the_receiving_port() -> None:
    # 2:1 plan, one micro-batch of 2 rows: both 1-row pieces share the receiver's port, and the two
    # gradient pieces share its send port; replica 1 gets its gradient one transfer later.
    rows, cut = 2, 2.0**12
    net = cluster(bandwidth=2.0**20)
    piece = cut / 2.0**20
    result = simulate(plan_of((2, 1), 1, rows, 1), uniform_chain(2, cut, param_bytes=0), net)
    f1, b1 = FORWARD_PER_ROW, BACKWARD_PER_ROW
    assert result.iteration_time_s == f1 + 2 * piece + 2 * f1 + 2 * b1 + 2 * piece + b1 + step_end_sync_time(net, range(3))
    starts = sorted((t.start_s, t.end_s, t.op) for t in result.transfers)
    assert starts == [(f1, f1 + piece, "SA"), (f1 + piece, f1 + 2 * piece, "SA"),
                      (f1 + 2 * piece + 2 * f1 + 2 * b1, f1 + 3 * piece + 2 * f1 + 2 * b1, "SG"),
                      (f1 + 3 * piece + 2 * f1 + 2 * b1, f1 + 4 * piece + 2 * f1 + 2 * b1, "SG")]


def test_three_to_one_slices() -> None:
    rows = 10  # slices 4, 3, 3 on stage 0; all 10 rows on stage 1
    net = cluster(bandwidth=2.0**20)
    plan = plan_of((3, 1), 1, rows, 2)
    result = simulate(plan, uniform_chain(2, 2.0**10), net)
    forward_rows = {e.device: round(e.end_s - e.start_s, 12) / FORWARD_PER_ROW
                    for e in result.events if e.op == "F"}
    assert forward_rows == {0: 4, 1: 3, 2: 3, 3: 10}
    assert result.busy_s == (2 * 4 * (FORWARD_PER_ROW + BACKWARD_PER_ROW),
                             *(2 * 3 * (FORWARD_PER_ROW + BACKWARD_PER_ROW),) * 2,
                             2 * 10 * (FORWARD_PER_ROW + BACKWARD_PER_ROW))
    pieces = sorted((t.src_device, (t.end_s - t.start_s) * 2.0**20 / 2.0**10)
                    for t in result.transfers if t.op == "SA" and t.microbatch_index == 0)
    assert pieces == [(0, 4.0), (1, 3.0), (2, 3.0)]
    assert result.iteration_time_s == max(result.allreduce_end_s) + step_end_sync_time(net, range(4))
    assert all(i == pytest.approx(result.iteration_time_s - b) for i, b in zip(result.idle_s, result.busy_s,
                                                                                 strict=True))


def test_early_backward_memory_is_k_s_and_gpipe_is_m() -> None:
    num_stages, num_microbatches, rows = 3, 8, 4
    chain, net = uniform_chain(3), cluster()
    eager = simulate(plan_of((1,) * 3, 1, rows, num_microbatches), chain, net)
    lazy = simulate(plan_of((1,) * 3, 1, rows, num_microbatches, "gpipe"), chain, net)
    assert eager.inflight_microbatches == tuple(warmup_forwards(s, 3, 8, "A") for s in range(num_stages)) \
        == (3, 2, 1)
    assert lazy.inflight_microbatches == (8, 8, 8)
    for stage_index in range(num_stages):
        cost = stage_cost(chain, stage_index, stage_index + 1, rows, 1)
        assert lazy.peak_memory_bytes[stage_index] == stage_memory_bytes(cost, 8)
        assert eager.peak_memory_bytes[stage_index] == stage_memory_bytes(cost, 3 - stage_index)
        assert lazy.peak_memory_bytes[stage_index] > eager.peak_memory_bytes[stage_index]
    assert eager.iteration_time_s == lazy.iteration_time_s


def test_chrome_trace_has_one_event_per_action(tmp_path: Path) -> None:
    plan = plan_of((2, 1, 3), 1, 6, 4)
    result = simulate(plan, uniform_chain(3, 2.0**8), cluster(2, 4))
    path = tmp_path / "trace.json"
    write_chrome_trace(result, path)
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(to_chrome_trace(result)))
    lowered = lower(early_backward(3, 4))
    stage_events = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "transfer"]
    assert len(stage_events) == sum(len(lowered[s.stage_index]) * s.replicas for s in plan.stages)
    assert {(e["pid"], e["tid"]) for e in stage_events} == {(0, 0), (0, 1), (1, 2), (2, 3), (2, 4), (2, 5)}
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {f"device {d}" for d in range(6)} <= names
    transfers = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "transfer"]
    assert len(transfers) == len(result.transfers) > 0
    assert all(e["dur"] >= 0 for e in stage_events + transfers)


def test_timeline_off_gives_the_same_figures_and_deterministic() -> None:
    bench = load_benchmark()
    plan, chain, net = bench.random_case(7)
    full, bare = simulate(plan, chain, net), simulate(plan, chain, net, timeline=False)
    assert bare.events == () and bare.transfers == ()
    assert (full.iteration_time_s, full.busy_s, full.peak_memory_bytes) == \
        (bare.iteration_time_s, bare.busy_s, bare.peak_memory_bytes)
    assert simulate(plan, chain, net) == full
    with pytest.raises(ValueError, match="timeline=True"):
        to_chrome_trace(bare)


def test_schedule_must_match_plan() -> None:
    plan = plan_of((1, 1), 1, 2, 4)
    with pytest.raises(ScheduleError, match="S=3, M=4 but the plan has S=2, M=4"):
        simulate(plan, uniform_chain(2), cluster(), schedule=gpipe(3, 4))
    custom = simulate(plan, uniform_chain(2), cluster(), schedule=make_schedule("gpipe", 2, 4))
    assert custom.schedule_name == "gpipe"


def reference_iteration_time(plan: Plan, chain: CostChain, net: Cluster) -> float:
    """A naive re-implementation (one heap event per action, no run-ahead, no sharing) of the same model."""
    from fxpipe.sim.simulate import _Node, _replica_specs  # the same inputs, a different engine

    nodes: dict[tuple[int, int], _Node] = _replica_specs(plan, chain, net)
    keys = sorted(nodes)
    programs = [encode_program(a) for a in lower(make_schedule(plan.schedule, plan.num_stages,
                                                               plan.num_microbatches, plan.warmup_policy))]
    cursor, port_send, port_recv = dict.fromkeys(keys, 0), dict.fromkeys(keys, 0.0), dict.fromkeys(keys, 0.0)
    arrived: dict[tuple[tuple[int, int], int, int], list[float]] = {}
    waiting: dict[tuple[int, int], float] = {}
    done: dict[tuple[int, int], float] = {}
    paid: dict[tuple[int, int], int] = {}
    heap = [(0.0, i, key) for i, key in enumerate(keys)]
    sequence = len(heap)
    while heap:
        now, _, key = heapq.heappop(heap)
        code, m = programs[key[0]][cursor[key]]
        node, after = nodes[key], now
        if code in (0, 1):
            after = now + (node.forward_s if code == 0 else node.backward_s)
        elif code in (2, 3):
            need = node.num_activation_in if code == 2 else node.num_gradient_in
            pieces = arrived.get((key, code - 2, m), [])
            if len(pieces) < need:
                waiting[key] = now
                continue
            after = max([now, *pieces]) + node.message_s * need
        elif code in (4, 5) and node.message_s > 0 and paid.get(key) != cursor[key]:
            paid[key] = cursor[key]  # the device packs and posts first, then issues in global time order
            heapq.heappush(heap, (now + node.message_s * len(node.activation_out if code == 4 else node.gradient_out),
                                  sequence, key))
            sequence += 1
            continue
        elif code in (4, 5):
            for other, seconds in (node.activation_out if code == 4 else node.gradient_out):
                start = max(now, port_send[key], port_recv[other]) if seconds > 0 else now
                if seconds > 0:
                    port_send[key] = port_recv[other] = start + seconds
                arrived.setdefault((other, code - 4, m), []).append(start + seconds)
                other_code, other_m = programs[other[0]][cursor[other]]
                if other in waiting and (other_code - 2, other_m) == (code - 4, m):
                    heapq.heappush(heap, (waiting.pop(other), sequence, other))
                    sequence += 1
        else:
            done[key] = now
            continue
        cursor[key] += 1
        heapq.heappush(heap, (after, sequence, key))
        sequence += 1
    assert len(done) == len(keys)
    ends = []
    for stage in plan.stages:
        start = max(done[stage.stage_index, r] for r in range(stage.replicas))
        ends.append(start + gradient_allreduce_time(net, stage_cost(chain, stage.first_block, stage.stop_block, 1, 1)
                                                        .param_bytes, stage.devices))
    return max(ends) + step_end_sync_time(net, [d for stage in plan.stages for d in stage.devices])


def check_events_consistent(result: SimulationResult, message_s: float = 0.0) -> None:
    """Per device, actions run back to back in order; every receive ends ``message_s`` per piece after its
    last piece arrived (or its start), every send lasts ``message_s`` per piece."""
    last_end: dict[int, float] = {}
    for event in result.events:
        assert event.start_s >= last_end.get(event.device, 0.0) - 1e-15 or event.op == "AR"
        assert event.end_s >= event.start_s
        last_end[event.device] = event.end_s
    arrivals: dict[tuple[int, str, int], float] = {}
    pieces: dict[tuple[int, str, int], int] = {}
    for t in result.transfers:
        key = (t.dst_device, "RA" if t.op == "SA" else "RG", t.microbatch_index)
        arrivals[key] = max(arrivals.get(key, 0.0), t.end_s)
        pieces[key] = pieces.get(key, 0) + 1
        sent = (t.src_device, t.op, t.microbatch_index)
        pieces[sent] = pieces.get(sent, 0) + 1
    for event in result.events:
        key = (event.device, event.op, event.microbatch_index)
        if event.op in ("RA", "RG"):
            assert event.end_s == pytest.approx(max(event.start_s, arrivals[key]) + message_s * pieces[key],
                                                rel=1e-12, abs=1e-15)
        if event.op in ("SA", "SG"):
            assert event.end_s - event.start_s == pytest.approx(message_s * pieces[key], rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("seed", range(40))
def test_against_reference_engine_and_invariants(seed: int) -> None:
    plan, chain, net = load_benchmark().random_case(seed)
    result = simulate(plan, chain, net)
    assert result.iteration_time_s == pytest.approx(reference_iteration_time(plan, chain, net), rel=1e-12)
    check_events_consistent(result)


@pytest.mark.parametrize("seed", range(20))
def test_message_overhead_against_reference_engine(seed: int) -> None:
    plan, chain, net = load_benchmark().random_case(500 + seed)
    seconds = max(simulate(plan, chain, net).busy_s) / (50 * plan.num_microbatches)  # a few % of compute
    net = dataclasses.replace(net, message_overhead_s=seconds)
    result = simulate(plan, chain, net)
    assert result.iteration_time_s == pytest.approx(reference_iteration_time(plan, chain, net), rel=1e-12)
    check_events_consistent(result, seconds)


def test_message_overhead_on_a_straight_pipeline_is_exact() -> None:
    rows, cut, overhead = 4, 2.0**10, 2.0**-8
    chain, net = uniform_chain(2, cut_bytes_per_row=cut), dataclasses.replace(cluster(latency=2.0**-10),
                                                                               message_overhead_s=2.0**-8)
    plan = plan_of((1, 1), 1, rows, 1)
    transfer = 2.0**-10 + rows * cut / 2.0**20
    forward, backward = rows * FORWARD_PER_ROW, rows * BACKWARD_PER_ROW
    # F0, pack+post, transfer, take it, F1, B1, pack+post, transfer, take it, B0
    expected = 2 * (forward + backward) + 2 * (2 * overhead + transfer) + step_end_sync_time(net, [0, 1])
    result = simulate(plan, chain, net)
    assert result.iteration_time_s == expected
    sends = [(e.op, e.end_s - e.start_s) for e in result.events if e.op in ("SA", "SG")]
    assert sends == [("SA", overhead), ("SG", overhead)]
    assert analytic_iteration_time(plan, chain, net) == expected


@pytest.mark.parametrize("seed", range(20))
def test_shared_component_runs_are_exact(seed: int) -> None:
    from fxpipe.sim import simulate as module

    plan, chain, net = load_benchmark().random_case(1000 + seed)
    nodes = module._replica_specs(plan, chain, net)
    programs = [encode_program(a) for a in lower(make_schedule(plan.schedule, plan.num_stages,
                                                               plan.num_microbatches, plan.warmup_policy))]
    shared = module._simulate_components(nodes, programs, plan.num_microbatches, True, dedupe=True)
    alone = module._simulate_components(nodes, programs, plan.num_microbatches, True, dedupe=False)
    assert [(m, r.allreduce_ready_s, r.events) for m, r in shared] == \
        [(m, r.allreduce_ready_s, r.events) for m, r in alone]


def test_replica_spec_is_hashable_for_sharing() -> None:
    spec = ReplicaSpec(0, 1.0, 2.0, ((1, 0.5),), (), 0, 1)
    assert {spec: 1}[ReplicaSpec(0, 1.0, 2.0, ((1, 0.5),), (), 0, 1)] == 1


def test_analytic_error_distribution_on_random_plans() -> None:
    """Documented in fxpipe/latency.py: the formula is a screen, the simulator the judge."""
    from fxpipe.passes.partition.latency import (
        ANALYTIC_MEAN_ERROR,
        ANALYTIC_MEDIAN_ERROR,
        ANALYTIC_WORST_ERROR,
    )

    errors = load_benchmark().relative_errors(200, 0)
    assert statistics.median(errors) <= ANALYTIC_MEDIAN_ERROR
    assert statistics.mean(errors) <= ANALYTIC_MEAN_ERROR
    assert max(errors) <= ANALYTIC_WORST_ERROR


def test_ranks_sharing_too_few_cores_stretch_compute_by_ranks_over_cores() -> None:
    rows, num_microbatches = 4, 3
    chain = uniform_chain(4, cut_bytes_per_row=2.0**8)
    plan = plan_of((1, 1, 1, 1), 1, rows, num_microbatches)
    dedicated = cluster(per_host=4, latency=2.0**-12)
    shared = Cluster("shared", 1, 4, DEVICE, dedicated.intra_host, dedicated.inter_host, cores_per_host=2)
    enough = Cluster("enough", 1, 4, DEVICE, dedicated.intra_host, dedicated.inter_host, cores_per_host=4)
    assert (shared.compute_slowdown, enough.compute_slowdown, dedicated.compute_slowdown) == (2.0, 1.0, 1.0)
    base, slow = simulate(plan, chain, dedicated), simulate(plan, chain, shared)
    assert simulate(plan, chain, enough) == base
    assert slow.busy_s == tuple(2 * busy for busy in base.busy_s)
    for fast_event, slow_event in zip(base.events, slow.events, strict=True):
        if fast_event.op in ("F", "B"):
            assert slow_event.end_s - slow_event.start_s == 2 * (fast_event.end_s - fast_event.start_s)
    # Transfers keep their time, so the iteration is longer but less than twice as long.
    assert base.iteration_time_s < slow.iteration_time_s < 2 * base.iteration_time_s
    no_transfers = uniform_chain(4)
    sync = step_end_sync_time(dedicated, range(4))  # a collective: not stretched
    assert simulate(plan, no_transfers, shared).iteration_time_s - sync == 2 * (
        simulate(plan, no_transfers, dedicated).iteration_time_s - sync)
    assert analytic_iteration_time(plan, no_transfers, shared) == simulate(plan, no_transfers, shared).iteration_time_s


def test_tied_parameters_are_summed_across_their_stages_after_both_are_ready() -> None:
    base = uniform_chain(4)
    tied = CostChain(base.blocks, base.cut_bytes, shared_params=(SharedParam("wte", 2**18, (0, 3)),))
    plan = plan_of((1, 1), 2, 4, 4)
    link = cluster()
    untied, result = simulate(plan, base, link), simulate(plan, tied, link)
    assert result.allreduce_start_s == untied.allreduce_start_s  # stages are ready at the same times
    tie_s = gradient_allreduce_time(link, 2**18, [0, 1])
    assert tie_s > 0
    expected_end = max(untied.allreduce_start_s) + tie_s  # the one-replica stages have no allreduce of their own
    assert result.allreduce_end_s == (expected_end, expected_end)
    assert result.iteration_time_s == expected_end + step_end_sync_time(link, [0, 1]) > untied.iteration_time_s
    # the second stage keeps a copy of the tied weight: its memory grows by the optimizer factor x the copy
    assert result.peak_memory_bytes[1] - untied.peak_memory_bytes[1] == 4 * 2**18
    assert result.peak_memory_bytes[0] == untied.peak_memory_bytes[0]


def test_compute_scale_stretches_each_device_alone() -> None:
    rows, num_microbatches = 4, 3
    chain, net = uniform_chain(4), cluster()
    plan = plan_of((1, 1), 2, rows, num_microbatches)
    plain = simulate(plan, chain, net)
    assert simulate(plan, chain, net, compute_scale=[1.0] * net.num_devices) == plain
    stage = 2 * rows * (FORWARD_PER_ROW + BACKWARD_PER_ROW)
    # stage 1 three times slower: it is the bottleneck of every micro-batch after the first forward
    slow_last = simulate(plan, chain, net, compute_scale=[1.0, 3.0] + [1.0] * (net.num_devices - 2))
    assert slow_last.busy_s == (num_microbatches * stage, 3 * num_microbatches * stage)
    forward = 2 * rows * FORWARD_PER_ROW
    assert slow_last.iteration_time_s == pytest.approx(forward + 3 * num_microbatches * stage + 2 * rows * BACKWARD_PER_ROW
                                                       + step_end_sync_time(net, [0, 1]))


@pytest.mark.parametrize("scale", [[1.0], [1.0] * 7 + [0.0], [1.0] * 7 + [-2.0]])
def test_compute_scale_needs_one_positive_factor_per_device(scale: list[float]) -> None:
    with pytest.raises(ValueError, match=r"one positive factor per device of cluster 'test' \(8\)"):
        simulate(plan_of((1,), 1, 2, 2), uniform_chain(1), cluster(), compute_scale=scale)


def test_measured_optimizer_step_ends_each_stage_after_its_allreduce() -> None:
    chain, base = uniform_chain(4, param_bytes=2**16), cluster(1, 4, latency=2.0**-12)
    per_byte = 2.0**-24  # dyadic: exact sums
    net = dataclasses.replace(base, optimizer_s_per_param_byte=per_byte, cores_per_host=2)  # 4 ranks on 2 cores: 2x
    plan = plan_of((2, 2), 2, 8, 2)
    without = simulate(plan, chain, dataclasses.replace(base, cores_per_host=2))
    result = simulate(plan, chain, net)
    optimizer = 2 * per_byte * 2 * 2**16  # 2 blocks' parameters per stage, stretched 2x
    assert result.allreduce_end_s == without.allreduce_end_s  # the allreduces are not moved
    # every rank leaves the step with the loss allreduce after the last stage's allreduce, then steps
    assert result.iteration_time_s == max(without.allreduce_end_s) + step_end_sync_time(net, range(4)) + optimizer
    assert Cluster.from_json(net.to_json()) == net
    with pytest.raises(ValueError, match="optimizer_s_per_param_byte"):
        dataclasses.replace(base, optimizer_s_per_param_byte=-1.0)
