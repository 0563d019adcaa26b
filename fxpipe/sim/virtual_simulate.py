"""Exact event simulation of a plan with virtual stages: device groups running several chunks each."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan, PlanError
from fxpipe.core.row_slices import shared_rows, split_rows
from fxpipe.core.schedule import (
    Op,
    Schedule,
    ScheduleError,
    inflight_peak,
    lower,
    make_schedule,
    validate_schedule,
)
from fxpipe.core.timeline import TimelineEvent, TransferEvent
from fxpipe.sim.events import CODE_OPS
from fxpipe.sim.recompute_cost import selective_figures
from fxpipe.sim.sharding_cost import ShardingComm, plan_sharding_comms
from fxpipe.sim.simulate import SimulationResult, _optimizer_s, _slowdowns
from fxpipe.sim.stagecost import (
    WEIGHT_GRAD_FRACTION,
    action_seconds,
    compute_times,
    gradient_allreduce_time,
    own_allreduce_bytes,
    replica_leads,
    split_backward_times,
    stage_cost,
    stage_memory_bytes,
    stage_split_collectives,
    step_close_time,
    tie_groups,
)
from fxpipe.sim.virtual_events import (
    ChunkCosts,
    ChunkDevice,
    ChunkProgram,
    VirtualRun,
    encode_chunk_program,
    run_chunk_devices,
)

Member = tuple[int, int]  # (group, replica)


@functools.lru_cache(maxsize=64)
def virtual_schedule(name: str, num_chunks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """The plan's schedule, validated (cached: the same few are simulated many times)."""
    schedule = make_schedule(name, num_chunks, num_microbatches, "A", virtual_stages)
    validate_schedule(schedule)
    return schedule


def _check(plan: Plan, chain: CostChain, schedule: Schedule) -> None:
    if schedule.chunk_groups != plan.chunk_groups or schedule.num_microbatches != plan.num_microbatches:
        raise ScheduleError(f"schedule {schedule.name!r} runs chunks on groups {list(schedule.chunk_groups)} with "
                            f"M={schedule.num_microbatches} but the plan has {list(plan.chunk_groups)} and M="
                            f"{plan.num_microbatches}; build it with make_schedule(..., virtual_stages=...)")
    if plan.stages[-1].stop_block != chain.num_blocks:
        raise ValueError(f"plan covers blocks [0, {plan.stages[-1].stop_block}) but the chain has "
                         f"{chain.num_blocks} blocks; plan and chain must come from the same model")
    if plan.allreduce_bucket_bytes:
        raise PlanError("virtual stages are simulated with one gradient allreduce per group after its list; set "
                        "allreduce_bucket_bytes=0 (buckets under virtual stages: not yet)")


def _members(plan: Plan) -> list[Member]:
    return [(g, r) for g in range(plan.num_groups) for r in range(plan.stages[plan.chunks_of_group(g)[0]].replicas)]


def _device_of(plan: Plan, member: Member) -> int:
    """Where a member's transfers are costed: its replica's first device (a T-way group's lead)."""
    return _replica_devices(plan, member)[0]


def _replica_devices(plan: Plan, member: Member) -> tuple[int, ...]:
    return plan.stages[plan.chunks_of_group(member[0])[0]].replica_devices(member[1])


def _chunk_costs(plan: Plan, chain: CostChain, cluster: Cluster, slowdowns: Sequence[float],
                 weight_fraction: float | None, index: dict[Member, int],
                 comms: Sequence[ShardingComm]) -> list[dict[int, ChunkCosts]]:
    """Every device's per-chunk compute seconds and pieces (transfers only between chunks on different groups); a
    sharded chunk's collectives on each forward and backward as on a sharded stage (``comms``)."""
    rows_of = plan.microbatch_size
    out: list[dict[int, ChunkCosts]] = [{} for _ in index]
    pieces: dict[tuple[int, int, str], list[tuple[int, int, float]]] = {}  # (chunk, replica, kind) -> pieces
    counts: dict[tuple[int, int, str], int] = {}
    for chunk in range(len(plan.stages) - 1):
        sender, receiver = plan.stages[chunk], plan.stages[chunk + 1]
        if plan.group_of_chunk(chunk) == plan.group_of_chunk(chunk + 1):
            continue  # the local hand-off: no message
        cut = chain.cut_bytes[sender.stop_block - 1]
        routes = [(i, j, cluster.link(sender.replica_devices(i)[0], receiver.replica_devices(j)[0]).transfer_time(
                   cut.at(stop - start)))
                  for i, j, start, stop in shared_rows(rows_of, sender.replicas, receiver.replicas)]
        send_group, receive_group = plan.group_of_chunk(chunk), plan.group_of_chunk(chunk + 1)
        for i, j, seconds in routes:
            pieces.setdefault((chunk, i, "A"), []).append((index[receive_group, j], chunk + 1, seconds))
            counts[chunk + 1, j, "A"] = counts.get((chunk + 1, j, "A"), 0) + 1
        for i, j, seconds in sorted(routes, key=lambda p: (p[1], p[0])):  # each sender in receiver order
            pieces.setdefault((chunk + 1, j, "G"), []).append((index[send_group, i], chunk, seconds))
            counts[chunk, i, "G"] = counts.get((chunk, i, "G"), 0) + 1
    for stage in plan.stages:
        group = plan.group_of_chunk(stage.stage_index)
        for replica, rows in enumerate(split_rows(rows_of, stage.replicas)):
            slowdown = max(slowdowns[d] for d in stage.replica_devices(replica))
            forward_s, backward_s = compute_times(chain, stage.first_block, stage.stop_block, rows, slowdown,
                                                  recompute=stage.recompute, tensor_parallel=stage.tensor_parallel,
                                                  cluster=cluster, block_recompute=stage.block_recompute)
            weight_s = 0.0
            if weight_fraction is not None:
                backward_s, weight_s = split_backward_times(backward_s, stage.stage_index, weight_fraction,
                                                            cluster.split_backward_overhead,
                                                            stage_split_collectives(chain, cluster, stage, rows))
            comm = comms[stage.stage_index]
            # under split backward ZeRO-2's reduce-scatter follows W (fxpipe.runtime.parallel.sharded_stage.after_weights)
            in_b, after_w = (comm.backward_s, 0.0) if weight_fraction is None else (0.0, comm.backward_s)
            action_s = action_seconds(cluster, slowdown)
            key = stage.stage_index, replica
            out[index[group, replica]][stage.stage_index] = ChunkCosts(
                forward_s + comm.forward_s + action_s, backward_s + in_b + action_s, weight_s + after_w,
                tuple(pieces.get((*key, "A"), ())),
                tuple(pieces.get((*key, "G"), ())), counts.get((*key, "A"), 0), counts.get((*key, "G"), 0))
    return out


def group_peak_bytes(plan: Plan, chain: CostChain, schedule: Schedule, group: int, optimizer: str,
                     cluster: Cluster | None = None) -> int:
    """Peak bytes per device of a group: the most, over its list, of what its chunks hold together, each chunk
    its weights, buffers and the micro-batches it holds at that point (F done, B, or W when split, not yet), less
    what its per-block recompute choices drop (as :func:`fxpipe.sim.simulate.simulate` charges a stage's); a
    T-way group member holds its share (``cluster``: needed when T > 1), a sharded chunk its level's split over the
    group's replicas (as :func:`fxpipe.sim.simulate.simulate` charges a sharded stage)."""
    chunks = plan.chunks_of_group(group)
    costs = {c: stage_cost(chain, plan.stages[c].first_block, plan.stages[c].stop_block, plan.microbatch_size,
                           plan.stages[c].replicas, tensor_parallel=plan.stages[c].tensor_parallel, cluster=cluster)
             for c in chunks}
    release = Op.WEIGHT if schedule.split_backward else Op.BACKWARD
    held = dict.fromkeys(chunks, 0)
    selective = {c: selective_figures(chain, plan.stages[c].first_block, plan.stages[c].block_recompute, costs[c].rows,
                                      tensor_parallel=plan.stages[c].tensor_parallel) for c in chunks}

    def total() -> int:
        return sum(stage_memory_bytes(costs[c], held[c], optimizer, plan.stages[c].recompute,
                                      sharding=plan.stages[c].sharding, replicas=plan.stages[c].replicas,
                                      num_microbatches=plan.num_microbatches,
                                      reshard_after_forward=plan.stages[c].reshard_after_forward,
                                      selective=selective[c]) for c in chunks)

    peak = total()
    for action in schedule.per_stage[group]:
        held[action.chunk_index] += 1 if action.op is Op.FORWARD else -1 if action.op is release else 0
        peak = max(peak, total())
    return peak


def _allreduces(plan: Plan, chain: CostChain, cluster: Cluster, readies: Sequence[float],
                comms: Sequence[ShardingComm]) -> list[float]:
    """When each group's gradient sums end: its unsharded chunks' own bytes over its replicas from its ready time,
    then its sharded chunks' reduce-scatter tails (ZeRO-1; FSDP2 reduces the other levels in their backwards), and
    one allreduce per set of groups sharing parameters (over their distinct devices) once all of them are ready."""
    bounds = [(stage.first_block, stage.stop_block) for stage in plan.stages]
    ties = tie_groups(chain, bounds)
    own = own_allreduce_bytes(chain, bounds, ties, [stage.tensor_parallel for stage in plan.stages])
    leads = [replica_leads(first.devices, first.tensor_parallel)
             for first in (plan.stages[plan.chunks_of_group(g)[0]] for g in range(plan.num_groups))]
    ends = []
    for group in range(plan.num_groups):  # a T-way group's members of one index sum one member's bytes
        chunks = plan.chunks_of_group(group)
        summed = sum(own[c] for c in chunks if plan.stages[c].sharding == "none")
        ends.append(readies[group] + gradient_allreduce_time(cluster, summed, leads[group])
                    + sum(comms[c].tail_s for c in chunks))
    for holders, num_bytes in ties:
        groups = sorted({plan.group_of_chunk(c) for c in holders})
        tie_devices = sorted({d for g in groups for d in leads[g]})
        tie_end = max(readies[g] for g in groups) + gradient_allreduce_time(cluster, num_bytes, tie_devices)
        for g in groups:
            ends[g] = max(ends[g], tie_end)
    return ends


def simulate_virtual(plan: Plan, chain: CostChain, cluster: Cluster, *, optimizer: str = "adam",
                     schedule: Schedule | None = None, timeline: bool = True,
                     compute_scale: Sequence[float] | None = None,
                     weight_fraction: float = WEIGHT_GRAD_FRACTION) -> SimulationResult:
    """Simulate one iteration of a plan with virtual stages exactly, under :func:`fxpipe.sim.simulate.simulate`'s model:

    - Every replica device of a group runs the group's lowered list (:func:`fxpipe.core.schedule.lower`): the
      actions of all its chunks in the schedule's order, one at a time. A chunk's compute takes its blocks'
      time on the device's slice (:func:`split_rows` of the group's replicas), plus the action overhead; under a
      split backward B and W share it as :func:`split_backward_times` says (chunk 0: all in B).
    - Between chunks on different groups, pieces go over the links as between stages (:func:`shared_rows`,
      ``cut_bytes`` of the sending chunk's last block), with the same ports and message costs; between two
      chunks of one group the hand-off is local: no message, no time.
    - Each group sums its chunks' own gradients in one allreduce over its replicas once its slowest replica
      finished its list; parameters several groups hold are summed in one allreduce over those groups' devices
      once all are ready. Then the step's closing sync, the fixed step cost and the slowest optimizer step.
    - Memory per device of a group: the most, over its list, of its chunks' weights, buffers and in-flight
      micro-batches together (:func:`group_peak_bytes`); every chunk of the group reports its group's peak.
      ``inflight_microbatches`` is per chunk (:func:`inflight_peak`).

    A replica that is a T-way tensor-parallel group is one member simulated (its time, collectives and bytes as
    :mod:`fxpipe.sim.tensor_parallel_cost` says, as :func:`fxpipe.sim.simulate.simulate` charges them); its
    transfers and allreduces are costed on its lead device, its figures hold for every member.

    A sharded chunk (ZeRO-1/2/3 over its group's replicas) is charged as a sharded stage is
    (:mod:`fxpipe.sim.sharding_cost`, :mod:`fxpipe.sim.sharding_memory`): its collectives on each of its forwards and
    backwards (W under a split backward), its step all-gather before the group starts, its reduce-scatter tail
    after the group's list in place of its share of the allreduce, its optimizer step on its shard.

    Not modelled yet (refused): gradient buckets.
    """
    schedule = schedule or virtual_schedule(plan.schedule, len(plan.stages), plan.num_microbatches,
                                            plan.virtual_stages)
    _check(plan, chain, schedule)
    slowdowns = _slowdowns(cluster, compute_scale)
    members = _members(plan)
    index = {member: i for i, member in enumerate(members)}
    comms = plan_sharding_comms(plan, chain, cluster)
    costs = _chunk_costs(plan, chain, cluster, slowdowns, weight_fraction if schedule.split_backward else None, index,
                         comms)
    message_s = [cluster.message_overhead_s * slowdowns[_device_of(plan, member)] for member in members]
    # sharded chunks' step all-gathers (ZeRO-1/2) before the group starts its list, one after another
    start_s = [sum(comms[c].start_s for c in plan.chunks_of_group(group)) for group, _ in members]
    programs: list[ChunkProgram] = [encode_chunk_program(actions) for actions in lower(schedule)]
    run = run_chunk_devices([ChunkDevice(c, s, t) for c, s, t in zip(costs, message_s, start_s, strict=True)],
                            [programs[group] for group, _ in members], timeline)
    readies = [max(run.ready_s[index[g, r]] for r in range(plan.stages[plan.chunks_of_group(g)[0]].replicas))
               for g in range(plan.num_groups)]
    ends = _allreduces(plan, chain, cluster, readies, comms)
    devices = plan.all_devices()
    optimizer_s = max(sum(_optimizer_s(chain, cluster, plan.stages[i], slowdowns) for i in c)
                      for c in (plan.chunks_of_group(g) for g in range(plan.num_groups)))
    iteration_s = max(ends) + step_close_time(cluster, devices, max(slowdowns[d] for d in devices)) + optimizer_s
    busy = {device: plan.num_microbatches * sum(c.forward_s + c.backward_s + c.weight_s for c in costs[index[m]].values())
            for m in members for device in _replica_devices(plan, m)}  # a group's members run together
    peaks = [group_peak_bytes(plan, chain, schedule, g, optimizer, cluster) for g in range(plan.num_groups)]
    groups = [plan.group_of_chunk(c) for c in range(len(plan.stages))]
    ordered = tuple(sorted(busy))
    return SimulationResult(
        schedule_name=schedule.name, iteration_time_s=iteration_s,
        throughput_samples_per_s=plan.global_batch_size / iteration_s if iteration_s > 0 else float("inf"),
        bubble_fraction=1.0 - sum(busy.values()) / (iteration_s * len(ordered)) if iteration_s > 0 else 0.0,
        devices=ordered, busy_s=tuple(busy[d] for d in ordered), idle_s=tuple(iteration_s - busy[d] for d in ordered),
        peak_memory_bytes=tuple(peaks[g] for g in groups),
        inflight_microbatches=tuple(inflight_peak(schedule, c) for c in range(len(plan.stages))),
        allreduce_start_s=tuple(readies[g] for g in groups), allreduce_end_s=tuple(ends[g] for g in groups),
        events=_events(plan, members, run, readies, ends), transfers=_transfers(plan, members, run))


def _events(plan: Plan, members: Sequence[Member], run: VirtualRun, readies: Sequence[float],
            ends: Sequence[float]) -> tuple[TimelineEvent, ...]:
    """Per device (in device order) its actions as executed (``stage_index``: the chunk), then its allreduce."""
    by_device = []
    for local, member in enumerate(members):
        if not run.events[local]:
            continue  # nothing recorded: timeline=False
        group = member[0]
        for device in _replica_devices(plan, member):  # a T-way group's members run together
            events = [TimelineEvent(device, chunk, CODE_OPS[code].value, m, start, end)
                      for code, chunk, m, start, end in run.events[local]]
            events.append(TimelineEvent(device, plan.chunks_of_group(group)[0], "AR", -1, readies[group], ends[group]))
            by_device.append((device, events))
    return tuple(event for _, events in sorted(by_device, key=lambda item: item[0]) for event in events)


def _transfers(plan: Plan, members: Sequence[Member], run: VirtualRun) -> tuple[TransferEvent, ...]:
    devices = [_device_of(plan, member) for member in members]
    out = [TransferEvent(devices[src], devices[dst], CODE_OPS[code].value, m, start, end)
           for src, dst, code, _, m, start, end in run.transfers]
    return tuple(sorted(out, key=lambda t: (t.start_s, t.src_device, t.dst_device, t.op, t.microbatch_index)))
