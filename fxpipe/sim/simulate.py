"""Exact event simulation of a plan's lowered schedule: iteration time, busy/idle, memory and timeline."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.row_slices import shared_rows, split_rows
from fxpipe.core.schedule import Schedule, ScheduleError
from fxpipe.core.timeline import TimelineEvent, TransferEvent
from fxpipe.sim.allreduce_overlap import Overlap, last_pass_share, stage_allreduce_overlap
from fxpipe.sim.events import (
    CODE_OPS,
    ComponentRun,
    Program,
    ReplicaSpec,
    run_component,
)
from fxpipe.sim.programs import Prepared, built_programs, prepared
from fxpipe.sim.recompute_cost import selective_figures
from fxpipe.sim.sharding_cost import ShardingComm, plan_sharding_comms
from fxpipe.sim.sharding_memory import chain_in_precision
from fxpipe.sim.stagecost import (
    WEIGHT_GRAD_FRACTION,
    action_seconds,
    allreduce_times,
    compute_times,
    own_allreduce_bytes,
    replica_leads,
    split_backward_times,
    stage_cost,
    stage_memory_bytes,
    stage_param_bytes,
    stage_split_collectives,
    step_close_time,
)

__all__ = ["SimulationResult", "TimelineEvent", "TransferEvent", "simulate"]

Replica = tuple[int, int]  # (stage_index, replica_index)


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of simulating one training iteration; per-device tuples align with ``devices``."""

    schedule_name: str
    iteration_time_s: float
    throughput_samples_per_s: float
    bubble_fraction: float
    devices: tuple[int, ...]
    busy_s: tuple[float, ...]  # forward + backward compute per device
    idle_s: tuple[float, ...]
    peak_memory_bytes: tuple[int, ...]  # per stage, per device of that stage
    inflight_microbatches: tuple[int, ...]  # per stage
    allreduce_start_s: tuple[float, ...]  # per stage
    allreduce_end_s: tuple[float, ...]  # per stage
    events: tuple[TimelineEvent, ...] = ()  # by device, then in execution order
    transfers: tuple[TransferEvent, ...] = ()


def simulate(plan: Plan, chain: CostChain, cluster: Cluster, *, optimizer: str = "adam",
             schedule: Schedule | None = None, timeline: bool = True,
             compute_scale: Sequence[float] | None = None,
             weight_fraction: float = WEIGHT_GRAD_FRACTION) -> SimulationResult:
    """Simulate one iteration of ``plan`` exactly under this model (deterministic):

    - Every replica device runs its stage's lowered action list (:func:`fxpipe.core.schedule.lower`) in
      order. Compute takes the time of its own slice (:func:`split_rows`; smaller slices are faster).
    - A send is asynchronous (buffered): it issues one transfer piece per receiving replica
      (:func:`shared_rows`) and the device goes on. A receive blocks until every piece of that
      micro-batch arrived. Each piece costs its sender and its receiver
      ``cluster.message_overhead_s`` of their own time (packing and posting; stretched like
      compute). Compute is stretched by ``cluster.compute_slowdown`` (CPU ranks sharing too few cores) and, when ``compute_scale`` is given, by ``compute_scale[d]`` on
      device ``d`` (one factor per cluster device: a slower or straggling device; see
      :mod:`fxpipe.sim.stragglers`). A piece takes ``latency + cut_bytes(rows) / bandwidth`` of its link
      (:meth:`Cluster.link`); gradients are the same size as activations.
    - Each device has one send port and one receive port (full duplex). A piece holds its sender's
      send port and its receiver's receive port; ports serve pieces first come, first served in
      issue-time order, with no backfilling. Zero-byte pieces arrive at once.
    - ``cut_bytes`` already counts skip values crossing a cut, so values read by a non-adjacent
      stage are modelled as relayed through the stages between (bytes per cut are exact).
      Loading inputs (every rank slices the batch itself) is local: not modelled.
    - With ``plan.allreduce_bucket_bytes`` > 0 the stage's own gradients go in buckets launched during
      the last gradient pass (B, or W under split backward), before that pass's gradient send:
      :mod:`fxpipe.sim.allreduce_overlap`'s offsets count from the end of that pass on the slowest
      replica, and the stage is done once its buckets are and every replica reached its allreduce.
      Overlap costs both sides (:attr:`Cluster.overlap_compute_slowdown`, ``overlap_comm_slowdown``): the
      stage's last gradient pass takes the offsets' ``stretch`` longer on every replica (computed for the
      stage's largest slice at the cluster's core sharing), and the buckets end as the fluid schedule
      there says. Busy time is each device's F, B and W, split-backward overhead and stretch included.
    - Otherwise a stage's allreduce starts when all its replicas finished their last backward and lasts
      :meth:`Cluster.allreduce_time` of its own parameters. Parameters several stages hold (tied
      weights, :func:`tie_groups`) are summed in one allreduce over all those stages' devices,
      starting when the last of them is ready; the stages' allreduce ends with it. Each includes
      copying the gradients into one buffer and back (:func:`gradient_allreduce_time`).
    - The step ends on every rank together, with an allreduce of a few numbers over all devices
      (the loss sum: :func:`step_end_sync_time`) once the last stage's allreduce is done, and the
      runtime's fixed per-step cost (:attr:`Cluster.step_overhead_s`, stretched like the slowest device).
      Every forward and backward action also takes :attr:`Cluster.action_overhead_s` (stretched like
      compute; busy time counts it): the driver's own time per action (:func:`action_seconds`).
      Then each stage's optimizer step takes :attr:`Cluster.optimizer_s_per_param_byte` per byte of
      its parameters (stretched like compute; 0 unless measured); the iteration ends with the
      slowest of them.

    - A sharded stage (``stage.sharding``, ZeRO-1/2/3; :mod:`fxpipe.sim.sharding_cost`) has no gradient
      allreduce: its replicas start their list after its step all-gather (ZeRO-1/2), every forward and
      backward takes its per-micro-batch all-gathers and reduce-scatters longer (ZeRO-2/3; busy time
      counts them; under split backward ZeRO-2's reduce-scatter lengthens W, which it follows), and
      its reduce-scatter tail (ZeRO-1) follows the last backward (W), anchored as the allreduce is. Its optimizer step covers its shard; its peak memory the level's split
      (:mod:`fxpipe.sim.sharding_memory`).

    - Under a split-backward schedule (W actions, zero-bubble) B takes ``1 - weight_fraction`` of
      the stage's backward and W the rest, both stretched by what splitting costs
      (``cluster.split_backward_overhead``; :func:`split_backward_times`; stage 0's B takes it all).

    Groups of replicas that exchange nothing with each other are simulated separately, and groups
    with identical inputs once (exact: see :func:`_simulate_components`). ``timeline=False`` skips
    recording events and transfers (faster; figures unchanged).
    """
    if plan.chunk_groups:
        raise ValueError(f"plan has virtual_stages={plan.virtual_stages} (several chunks per device group): simulate "
                         "it with fxpipe.sim.virtual_simulate.simulate_virtual")
    if schedule is not None:
        _check_schedule(plan, chain, schedule)
    _check_chain(plan, chain)
    ready = prepared(schedule) if schedule is not None else built_programs(
        plan.schedule, plan.num_stages, plan.num_microbatches, plan.warmup_policy)
    chain = chain_in_precision(chain, plan.precision)  # bf16-params: compute copies, bf16 all-gathers
    slowdowns = _slowdowns(cluster, compute_scale)
    comms = plan_sharding_comms(plan, chain, cluster)
    overlaps = _overlaps(plan, chain, cluster, ready.split_backward, weight_fraction, comms)
    specs = _replica_specs(plan, chain, cluster, slowdowns,
                           weight_fraction if ready.split_backward else None,
                           [overlap.stretch for overlap in overlaps], comms)
    runs = _simulate_components(specs, ready.programs, plan.num_microbatches, timeline)
    return _collect(plan, chain, cluster, ready, runs, optimizer, slowdowns, overlaps)


def _overlaps(plan: Plan, chain: CostChain, cluster: Cluster, split_backward: bool,
              weight_fraction: float, comms: Sequence[ShardingComm]) -> list[Overlap]:
    """Each stage's bucket offsets from the end of its last gradient pass run alone, and that pass's stretch;
    a sharded stage's only collective after it is its reduce-scatter tail (:mod:`fxpipe.sim.sharding_cost`)."""
    own_bytes = own_allreduce_bytes(chain, [(s.first_block, s.stop_block) for s in plan.stages],
                                    tensor_parallel=[s.tensor_parallel for s in plan.stages])
    return [Overlap(0.0, comms[stage.stage_index].tail_s) if stage.sharding != "none" else stage_allreduce_overlap(
        chain, cluster, stage.first_block, stage.stop_block, replica_leads(stage.devices, stage.tensor_parallel),
        max(split_rows(plan.microbatch_size, stage.replicas)), own_bytes[stage.stage_index],
        plan.allreduce_bucket_bytes, last_pass_share(stage.stage_index, split_backward, weight_fraction,
                                                     cluster.split_backward_overhead), stage.tensor_parallel)
        for stage in plan.stages]


def _slowdowns(cluster: Cluster, compute_scale: Sequence[float] | None) -> tuple[float, ...]:
    """Each cluster device's compute stretch: the cluster's core sharing times ``compute_scale``."""
    if compute_scale is None:
        return (cluster.compute_slowdown,) * cluster.num_devices
    scale = tuple(float(factor) for factor in compute_scale)
    if len(scale) != cluster.num_devices or not all(factor > 0 for factor in scale):
        raise ValueError(f"compute_scale needs one positive factor per device of cluster {cluster.name!r} "
                         f"({cluster.num_devices}); got {list(compute_scale)}")
    return tuple(cluster.compute_slowdown * factor for factor in scale)


def _check_schedule(plan: Plan, chain: CostChain, schedule: Schedule) -> None:
    if (schedule.num_stages, schedule.num_microbatches) != (plan.num_stages, plan.num_microbatches):
        raise ScheduleError(f"schedule {schedule.name!r} is for S={schedule.num_stages}, M="
                            f"{schedule.num_microbatches} but the plan has S={plan.num_stages}, "
                            f"M={plan.num_microbatches}; build it with make_schedule for this plan")


def _check_chain(plan: Plan, chain: CostChain) -> None:
    if plan.stages[-1].stop_block != chain.num_blocks:
        raise ValueError(f"plan covers blocks [0, {plan.stages[-1].stop_block}) but the chain has "
                         f"{chain.num_blocks} blocks; plan and chain must come from the same model")


def _pieces(plan: Plan, chain: CostChain, cluster: Cluster, stage_index: int) -> list[tuple[int, int, float]]:
    """``(sender replica, receiver replica, seconds)`` for every piece crossing the cut after ``stage_index``."""
    sender, receiver = plan.stages[stage_index], plan.stages[stage_index + 1]
    bytes_per_rows = chain.cut_bytes[sender.stop_block - 1]
    return [
        (i, j, cluster.link(sender.replica_devices(i)[0], receiver.replica_devices(j)[0])
         .transfer_time(bytes_per_rows.at(stop - start)))
        for i, j, start, stop in shared_rows(plan.microbatch_size, sender.replicas, receiver.replicas)
    ]


def _replica_specs(plan: Plan, chain: CostChain, cluster: Cluster, slowdowns: Sequence[float] | None = None,
                   weight_fraction: float | None = None, stretches: Sequence[float] | None = None,
                   comms: Sequence[ShardingComm] | None = None) -> dict[Replica, _Node]:
    """Every replica's compute times and transfer pieces, keyed by (stage, replica), globally indexed.

    ``weight_fraction`` (split-backward schedules only) moves that share of backward into W;
    ``stretches[s]`` lengthens stage s's last gradient pass (overlapped buckets); ``comms[s]`` adds a
    sharded stage's collectives to each forward and backward (under split backward ZeRO-2's reduce-scatter
    to W, which it follows at runtime) and delays its start (:mod:`fxpipe.sim.sharding_cost`).
    """
    slowdowns = slowdowns or _slowdowns(cluster, None)
    comms = comms or plan_sharding_comms(plan, chain, cluster)
    nodes: dict[Replica, _Node] = {}
    for stage in plan.stages:
        for replica_index, rows in enumerate(split_rows(plan.microbatch_size, stage.replicas)):
            slowdown = max(slowdowns[device] for device in stage.replica_devices(replica_index))
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
            nodes[stage.stage_index, replica_index] = _Node(stage.stage_index, forward_s + comm.forward_s + action_s,
                                                            backward_s + in_b + action_s, [], [], 0, 0,
                                                            cluster.message_overhead_s * slowdown, weight_s + after_w,
                                                            stretches[stage.stage_index] if stretches else 0.0,
                                                            comm.start_s)
    for stage_index in range(plan.num_stages - 1):
        for i, j, seconds in _pieces(plan, chain, cluster, stage_index):
            nodes[stage_index, i].activation_out.append(((stage_index + 1, j), seconds))
            nodes[stage_index + 1, j].num_activation_in += 1
        # gradients go back the same way; each sender issues them in receiver order
        for i, j, seconds in sorted(_pieces(plan, chain, cluster, stage_index), key=lambda p: (p[1], p[0])):
            nodes[stage_index + 1, j].gradient_out.append(((stage_index, i), seconds))
            nodes[stage_index, i].num_gradient_in += 1
    return nodes


@dataclass
class _Node:
    stage_index: int
    forward_s: float
    backward_s: float
    activation_out: list[tuple[Replica, float]]
    gradient_out: list[tuple[Replica, float]]
    num_activation_in: int
    num_gradient_in: int
    message_s: float = 0.0
    weight_s: float = 0.0
    stretch_s: float = 0.0
    start_s: float = 0.0


def _components(nodes: dict[Replica, _Node]) -> list[list[Replica]]:
    """Groups of replicas linked by transfers (union-find), each sorted, in order of their first member."""
    parent = {key: key for key in nodes}

    def find(key: Replica) -> Replica:
        while parent[key] != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for key, node in nodes.items():
        for other, _ in node.activation_out:
            parent[find(other)] = find(key)
    groups: dict[Replica, list[Replica]] = {}
    for key in sorted(nodes):
        groups.setdefault(find(key), []).append(key)
    return sorted(groups.values())


def _local_specs(nodes: dict[Replica, _Node], members: list[Replica]) -> tuple[ReplicaSpec, ...]:
    local = {key: index for index, key in enumerate(members)}
    return tuple(
        ReplicaSpec(node.stage_index, node.forward_s, node.backward_s,
                    tuple((local[k], s) for k, s in node.activation_out),
                    tuple((local[k], s) for k, s in node.gradient_out),
                    node.num_activation_in, node.num_gradient_in, node.message_s, node.weight_s, node.stretch_s,
                    node.start_s)
        for node in (nodes[key] for key in members)
    )


def _simulate_components(nodes: dict[Replica, _Node], programs: Sequence[Program], num_microbatches: int,
                         record: bool, dedupe: bool = True) -> list[tuple[list[Replica], ComponentRun]]:
    """Run each component once per distinct spec; returns every component's members and run.

    Components share no device, port or link, and the allreduce only reads when each replica got
    there, so they are independent; two components with equal local specs (compute times, piece
    times in issue order, piece counts) are the same deterministic computation, so one run serves
    both exactly (e.g. the R columns of an R:R:R plan, or the R replicas of pure data parallelism).
    """
    cache: dict[tuple[ReplicaSpec, ...], ComponentRun] = {}
    result = []
    for members in _components(nodes):
        specs = _local_specs(nodes, members)
        run = cache.get(specs) if dedupe else None
        if run is None:
            run = cache[specs] = run_component(specs, programs, num_microbatches, record)
        result.append((members, run))
    return result


def _collect(plan: Plan, chain: CostChain, cluster: Cluster, schedule: Prepared,
             runs: list[tuple[list[Replica], ComponentRun]], optimizer: str,
             slowdowns: Sequence[float], overlaps: Sequence[Overlap]) -> SimulationResult:
    """Add the allreduces and turn component runs into per-device figures and events."""
    inflight = schedule.inflight
    ready = {key: run.allreduce_ready_s[local] for members, run in runs for local, key in enumerate(members)}
    # buckets launch during the last B or W, before that pass's gradient send: anchored at its end
    anchor_of = {key: run.gradient_end_s[local] for members, run in runs for local, key in enumerate(members)
                 } if plan.allreduce_bucket_bytes > 0 else ready
    _, ties = allreduce_times(chain, cluster, [(s.first_block, s.stop_block, replica_leads(s.devices, s.tensor_parallel))
                                               for s in plan.stages], [s.tensor_parallel for s in plan.stages])
    readies, starts, ends, peaks = [], [], [], []
    for stage in plan.stages:
        cost = stage_cost(chain, stage.first_block, stage.stop_block, plan.microbatch_size, stage.replicas,
                          tensor_parallel=stage.tensor_parallel, cluster=cluster)
        readies.append(max(ready[stage.stage_index, r] for r in range(stage.replicas)))
        anchor = max(anchor_of[stage.stage_index, r] for r in range(stage.replicas))
        # buckets start during the last backward or W (allreduce_bucket_bytes > 0); offsets from its end run
        # alone, which the anchor is the stretch past
        overlap = overlaps[stage.stage_index]
        starts.append(anchor + overlap.start - overlap.stretch)
        ends.append(max(anchor + overlap.end - overlap.stretch, readies[-1]))  # the rank also finishes its list
        peaks.append(stage_memory_bytes(cost, inflight[stage.stage_index], optimizer, stage.recompute,
                                        sharding=stage.sharding, replicas=stage.replicas,
                                        num_microbatches=plan.num_microbatches,
                                        reshard_after_forward=stage.reshard_after_forward,
                                        selective=selective_figures(chain, stage.first_block, stage.block_recompute,
                                                                    cost.rows, tensor_parallel=stage.tensor_parallel)))
    for stages, seconds in ties:  # starts when every holder is ready; its stages end with it
        tie_end = max(readies[s] for s in stages) + seconds
        for s in stages:
            ends[s] = max(ends[s], tie_end)
    # every rank leaves the step together, after the allreduce that ends it; then its optimizer steps
    iteration_s = (max(ends) + step_close_time(cluster, plan.all_devices(),
                                               max(slowdowns[device] for device in plan.all_devices()))
                   + max(_optimizer_s(chain, cluster, stage, slowdowns) for stage in plan.stages))
    split = cluster.split_backward_overhead if schedule.split_backward else None
    comms = plan_sharding_comms(plan, chain, cluster)
    # one figure per (stage, replica, stretch): a 2,048-replica plan asked it per device, same arguments each time
    replica_busy = functools.lru_cache(maxsize=None)(functools.partial(_busy, plan, chain, cluster))
    busy = {device: replica_busy(stage.stage_index, index // stage.tensor_parallel, slowdowns[device], split)
            + 2 * plan.num_microbatches * action_seconds(cluster, slowdowns[device]) + overlaps[stage.stage_index].stretch
            + plan.num_microbatches * (comms[stage.stage_index].forward_s + comms[stage.stage_index].backward_s)
            for stage in plan.stages for index, device in enumerate(stage.devices)}
    devices = tuple(sorted(busy))
    return SimulationResult(
        schedule_name=schedule.name,
        iteration_time_s=iteration_s,
        throughput_samples_per_s=plan.global_batch_size / iteration_s if iteration_s > 0 else float("inf"),
        bubble_fraction=1.0 - sum(busy.values()) / (iteration_s * len(devices)) if iteration_s > 0 else 0.0,
        devices=devices,
        busy_s=tuple(busy[d] for d in devices),
        idle_s=tuple(iteration_s - busy[d] for d in devices),
        peak_memory_bytes=tuple(peaks),
        inflight_microbatches=inflight,
        allreduce_start_s=tuple(starts),
        allreduce_end_s=tuple(ends),
        events=_events(plan, runs, starts, ends),
        transfers=_transfers(plan, runs),
    )


def _optimizer_s(chain: CostChain, cluster: Cluster, stage: StagePlan, slowdowns: Sequence[float]) -> float:
    """The optimizer step after a stage's last allreduce (:attr:`Cluster.optimizer_s_per_param_byte`); a sharded
    stage's replica steps its shard, 1/replicas of the parameters."""
    if cluster.optimizer_s_per_param_byte <= 0:
        return 0.0
    # its tied copies step too; a group member steps its own part
    param_bytes: float = stage_param_bytes(chain, stage.first_block, stage.stop_block, stage.tensor_parallel)
    if stage.sharding != "none":
        param_bytes /= stage.replicas
    return cluster.optimizer_s_per_param_byte * param_bytes * max(slowdowns[d] for d in stage.devices)


def _busy(plan: Plan, chain: CostChain, cluster: Cluster, stage_index: int, replica_index: int, slowdown: float,
          split_overhead: float | None) -> float:
    """A replica's compute seconds in one iteration; a split backward (``split_overhead`` not None) takes
    what splitting costs on top (:func:`split_backward_times`: B + W, none on stage 0)."""
    stage = plan.stages[stage_index]
    rows = split_rows(plan.microbatch_size, stage.replicas)[replica_index]
    forward_s, backward_s = compute_times(chain, stage.first_block, stage.stop_block, rows, slowdown,
                                          recompute=stage.recompute, tensor_parallel=stage.tensor_parallel,
                                          cluster=cluster, block_recompute=stage.block_recompute)
    if split_overhead is not None:
        backward_s = sum(split_backward_times(backward_s, stage_index, WEIGHT_GRAD_FRACTION, split_overhead,
                                              stage_split_collectives(chain, cluster, stage, rows)))
    return plan.num_microbatches * (forward_s + backward_s)


def _device(plan: Plan, key: Replica) -> int:
    """The device a replica's transfers are costed on: its group's first (:func:`replica_leads`)."""
    return plan.stages[key[0]].replica_devices(key[1])[0]


def _events(plan: Plan, runs: list[tuple[list[Replica], ComponentRun]], starts: Sequence[float],
            ends: Sequence[float]) -> tuple[TimelineEvent, ...]:
    """Per device (in device order), its actions as executed, ending with its stage's allreduce."""
    by_device: list[tuple[int, list[TimelineEvent]]] = []
    for members, run in runs:
        for local, (stage_index, replica_index) in enumerate(members):
            if not run.events[local]:
                continue  # nothing recorded: timeline=False
            for device in plan.stages[stage_index].replica_devices(replica_index):  # a group's members run together
                events = [TimelineEvent(device, stage_index, CODE_OPS[code].value, m, start, end)
                          for code, m, start, end in run.events[local]]
                events.append(TimelineEvent(device, stage_index, "AR", -1, starts[stage_index], ends[stage_index]))
                by_device.append((device, events))
    return tuple(event for _, events in sorted(by_device, key=lambda item: item[0]) for event in events)


def _transfers(plan: Plan, runs: list[tuple[list[Replica], ComponentRun]]) -> tuple[TransferEvent, ...]:
    """Every transfer piece with global devices, sorted by start time, then source and destination."""
    out: list[TransferEvent] = []
    for members, run in runs:
        devices = [_device(plan, key) for key in members]
        out.extend(TransferEvent(devices[src], devices[dst], CODE_OPS[code].value, m, start, end)
                   for src, dst, code, m, start, end in run.transfers)
    return tuple(sorted(out, key=lambda t: (t.start_s, t.src_device, t.dst_device, t.op, t.microbatch_index)))
