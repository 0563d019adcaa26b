"""A separately written reference of fxpipe's virtual-stage simulator (fxpipe.sim.virtual_simulate), for oracle tests.

Like tests/reference_sim.py it shares no code with ``fxpipe.sim``: only plain data (Plan, CostChain, Cluster) and
the F/B/W order of each device group's list (``make_schedule(..., virtual_stages=v).per_stage``) come from
fxpipe; slicing, routing, costs and memory reuse the reference's own helpers. Written the plain way: the
lowering from the chunk-to-group map, one time-ordered loop over every (group, replica), dictionaries keyed by
(chunk, micro-batch), memory by walking each group's list.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from reference_sim import (
    gradient_allreduce_seconds,
    held_bytes,
    piece_seconds,
    routes,
    slice_bounds,
    stage_peak_bytes,
    stage_seconds,
    step_end_seconds,
    stretch,
    tie_sets,
)

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan
from fxpipe.core.schedule import make_schedule

Member = tuple[int, int]  # (group, replica)
Step = tuple[str, int, int]  # (kind, chunk, micro-batch); kind F, B, W, RA, SA, RG, SG


def group_orders(plan: Plan) -> list[list[tuple[str, int, int]]]:
    """Per group, its compute actions ``(kind, chunk, micro-batch)`` in the schedule's order."""
    schedule = make_schedule(plan.schedule, len(plan.stages), plan.num_microbatches, plan.warmup_policy,
                             plan.virtual_stages)
    return [[(a.op.value, a.chunk_index, a.microbatch_index) for a in actions] for actions in schedule.per_stage]


def my_lowering(plan: Plan, orders: list[list[tuple[str, int, int]]]) -> list[list[Step]]:
    """Receive before a forward whose previous chunk is on another group, send after it if the next chunk is;
    backwards the other way round; W moves nothing; two chunks of one group hand over locally."""
    group = plan.chunk_groups
    last = len(plan.stages) - 1
    programs = []
    for g, order in enumerate(orders):
        program: list[Step] = []
        for kind, chunk, m in order:
            before = chunk > 0 and group[chunk - 1] != g
            after = chunk < last and group[chunk + 1] != g
            if kind == "F" and before:
                program.append(("RA", chunk, m))
            if kind == "B" and after:
                program.append(("RG", chunk, m))
            program.append((kind, chunk, m))
            if kind == "F" and after:
                program.append(("SA", chunk, m))
            if kind == "B" and before:
                program.append(("SG", chunk, m))
        programs.append(program)
    return programs


@dataclass
class Device:
    device: int
    seconds: dict[int, dict[str, float]] = field(default_factory=dict)  # chunk -> F/B/W seconds
    sends: dict[tuple[int, str], list[tuple[Member, int, float]]] = field(default_factory=dict)  # (chunk, A/G)
    expects: dict[tuple[int, str], int] = field(default_factory=dict)


def build_devices(plan: Plan, chain: CostChain, net: Cluster, split: bool, weight_share: float) -> dict[Member, Device]:
    rows_of = plan.global_batch_size // plan.num_microbatches
    group = plan.chunk_groups
    devices: dict[Member, Device] = {}
    for stage in plan.stages:
        for r, (start, stop) in enumerate(slice_bounds(rows_of, stage.replicas)):
            member = (group[stage.stage_index], r)
            devices.setdefault(member, Device(stage.devices[r]))
            devices[member].seconds[stage.stage_index] = stage_seconds(plan, chain, net, stage.stage_index,
                                                                       stop - start, split, weight_share)
    for left, right in zip(plan.stages, plan.stages[1:], strict=False):
        a, b = group[left.stage_index], group[right.stage_index]
        if a == b:
            continue
        cut = chain.cut_bytes[left.stop_block - 1]
        pairs = routes(rows_of, left.replicas, right.replicas)
        for i, j, rows in pairs:
            seconds = piece_seconds(net, left.devices[i], right.devices[j], cut.fixed + cut.per_sample * rows)
            devices[a, i].sends.setdefault((left.stage_index, "A"), []).append(((b, j), right.stage_index, seconds))
            devices[b, j].expects[right.stage_index, "A"] = devices[b, j].expects.get((right.stage_index, "A"), 0) + 1
        for i, j, rows in sorted(pairs, key=lambda p: (p[1], p[0])):
            seconds = piece_seconds(net, right.devices[j], left.devices[i], cut.fixed + cut.per_sample * rows)
            devices[b, j].sends.setdefault((right.stage_index, "G"), []).append(((a, i), left.stage_index, seconds))
            devices[a, i].expects[left.stage_index, "G"] = devices[a, i].expects.get((left.stage_index, "G"), 0) + 1
    return devices


def event_loop(devices: dict[Member, Device], programs: list[list[Step]], net: Cluster) -> tuple[dict[Member, float],
                                                                                                  dict[int, float]]:
    """A plain time-ordered loop (reference_sim.event_loop's rules) over every (group, replica); returns when each
    reached the end of its list and every device's compute seconds."""
    per_message = net.message_overhead_s * stretch(net)
    clock = dict.fromkeys(devices, 0.0)
    cursor = dict.fromkeys(devices, 0)
    packed: set[tuple[Member, int]] = set()
    send_free: dict[int, float] = {}
    recv_free: dict[int, float] = {}
    arrivals: dict[tuple[Member, str, int, int], list[float]] = {}
    blocked: set[Member] = set()
    busy = {d.device: 0.0 for d in devices.values()}
    queue = [(0.0, key) for key in sorted(devices)]
    while queue:
        now, key = heapq.heappop(queue)
        me, program = devices[key], programs[key[0]]
        if cursor[key] == len(program):
            continue
        kind, chunk, m = program[cursor[key]]
        if kind in ("F", "B", "W"):
            busy[me.device] += me.seconds[chunk][kind]
            now += me.seconds[chunk][kind]
        elif kind[0] == "R":
            got = arrivals.get((key, kind[1], chunk, m), [])
            if len(got) < me.expects[chunk, kind[1]]:
                blocked.add(key)
                clock[key] = now
                continue
            now = max([now, *got]) + per_message * len(got)
        elif per_message > 0 and (key, cursor[key]) not in packed:
            packed.add((key, cursor[key]))
            heapq.heappush(queue, (now + per_message * len(me.sends[chunk, kind[1]]), key))
            continue
        else:
            for other, other_chunk, seconds in me.sends[chunk, kind[1]]:
                target = devices[other].device
                start = now if seconds == 0 else max(now, send_free.get(me.device, 0.0), recv_free.get(target, 0.0))
                if seconds > 0:
                    send_free[me.device] = recv_free[target] = start + seconds
                arrivals.setdefault((other, kind[1], other_chunk, m), []).append(start + seconds)
                if other in blocked:
                    blocked.discard(other)
                    heapq.heappush(queue, (clock[other], other))
        cursor[key] += 1
        clock[key] = now
        heapq.heappush(queue, (now, key))
    assert not blocked and all(cursor[k] == len(programs[k[0]]) for k in devices), "the reference deadlocked"
    return clock, busy


@dataclass
class VirtualReference:
    iteration_time_s: float
    allreduce_end_s: list[float]  # per chunk: its group's
    busy: dict[int, float]
    peak_memory_bytes: list[int]  # per chunk: its group's
    inflight: list[int]  # per chunk


def group_memory(plan: Plan, chain: CostChain, order: list[tuple[str, int, int]], split: bool,
                 optimizer: str) -> tuple[int, dict[int, int]]:
    """Walk a group's list: the most its chunks hold together, and each chunk's own most in-flight micro-batches."""
    chunks = sorted({chunk for _, chunk, _ in order})
    held = dict.fromkeys(chunks, 0)
    most = dict.fromkeys(chunks, 0)
    worst = sum(stage_peak_bytes(plan, chain, c, 0, optimizer) for c in chunks)
    for kind, chunk, _ in order:
        if kind == "F":
            held[chunk] += 1
        elif kind == ("W" if split else "B"):
            held[chunk] -= 1
        most[chunk] = max(most[chunk], held[chunk])
        worst = max(worst, sum(stage_peak_bytes(plan, chain, c, held[c], optimizer) for c in chunks))
    return worst, most


def reference_virtual_run(plan: Plan, chain: CostChain, net: Cluster, *, optimizer: str = "adam",
                          weight_share: float = 0.5) -> VirtualReference:
    """One iteration of a virtual-stage plan under the documented model (fxpipe.sim.virtual_simulate)."""
    orders = group_orders(plan)
    split = any(kind == "W" for order in orders for kind, _, _ in order)
    devices = build_devices(plan, chain, net, split, weight_share)
    clock, busy = event_loop(devices, my_lowering(plan, orders), net)
    num_groups = len(orders)
    chunks_of = {g: [c for c, owner in enumerate(plan.chunk_groups) if owner == g] for g in range(num_groups)}
    group_devices = {g: plan.stages[chunks_of[g][0]].devices for g in range(num_groups)}
    ready = {g: max(t for (owner, _), t in clock.items() if owner == g) for g in range(num_groups)}
    ties = tie_sets(plan, chain)
    own = {c: held_bytes(chain, s.first_block, s.stop_block) - sum(n for holders, n in ties.items() if c in holders)
           for c, s in enumerate(plan.stages)}
    ends = {g: ready[g] + gradient_allreduce_seconds(net, sum(own[c] for c in chunks_of[g]), group_devices[g])
            for g in range(num_groups)}
    for holders, num_bytes in ties.items():
        groups = {plan.chunk_groups[c] for c in holders}
        everyone = tuple(sorted({d for g in groups for d in group_devices[g]}))
        tie_end = max(ready[g] for g in groups) + gradient_allreduce_seconds(net, num_bytes, everyone)
        for g in groups:
            ends[g] = max(ends[g], tie_end)
    optimizer_s = max(net.optimizer_s_per_param_byte * stretch(net) * sum(
        held_bytes(chain, plan.stages[c].first_block, plan.stages[c].stop_block) for c in chunks_of[g])
        for g in range(num_groups))
    memory = [group_memory(plan, chain, orders[g], split, optimizer) for g in range(num_groups)]
    return VirtualReference(
        iteration_time_s=max(ends.values()) + step_end_seconds(net, plan) + net.step_overhead_s * stretch(net)
        + optimizer_s,
        allreduce_end_s=[ends[g] for g in plan.chunk_groups], busy=busy,
        peak_memory_bytes=[memory[g][0] for g in plan.chunk_groups],
        inflight=[memory[g][1][c] for c, g in enumerate(plan.chunk_groups)],
    )
