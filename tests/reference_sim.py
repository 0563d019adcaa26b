"""A separately written reference of fxpipe's simulator, for oracle tests: iteration time, allreduce start/end,
busy seconds and per-stage peak memory of one training iteration.

It shares no code with ``fxpipe.sim`` (nor the planner): only plain data (Plan, CostChain, Cluster) and the
F/B/W order of the schedule (``make_schedule(...).per_stage``) come from fxpipe. Row slicing, routing,
lowering, message costs, core sharing, split backward (zero-bubble), recomputation, bucketed and tied
gradient allreduces (and what overlapping them with the last gradient pass costs both sides), sharded stages
(ZeRO-1/2/3: reduce-scatters and all-gathers, sharded memory), tensor-parallel stages (a replica is a T-way group:
split blocks' time, collectives, bytes), the step-end allreduce, the optimizer step and the memory rule are re-derived from the
documented model (``fxpipe.sim.simulate.simulate``'s docstring, docs) and written the plain way: one
time-ordered loop over all replicas, lists instead of prefix sums, no caching, no component splitting.

Not covered: ``compute_scale`` (per-device stretch) and schedules other than the training ones.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from reference_mixed_memory import mixed_peak_bytes

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster, LinkSpec
from fxpipe.core.plan import Plan
from fxpipe.core.schedule import make_schedule

Key = tuple[int, int]  # (stage, replica)
STEP_END_NUMBERS = 7  # float64 loss sum, token count, preemption vote, four batch-check folds
BYTES_KEPT_PER_PARAM_BYTE = {"sgd": 2, "momentum": 3, "adam": 4, "adamw": 4}  # weights, grads, optimizer state
WEIGHT_SHARE = 0.5  # default share of backward that computes parameter gradients under split backward


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


def at(affine, rows: float) -> float:  # type: ignore[no-untyped-def]
    return affine.fixed + affine.per_sample * rows


def stretch(net: Cluster) -> float:
    """Ranks sharing too few cores compute (and pack messages) at cores/ranks of their speed."""
    if 0 < net.cores_per_host < net.devices_per_host:
        return net.devices_per_host / net.cores_per_host
    return 1.0


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


def ring_half_seconds(net: Cluster, num_bytes: float, devices: tuple[int, ...], own: LinkSpec | None = None) -> float:
    """A ring reduce-scatter or all-gather: R-1 steps each sending 1/R of the bytes over the slowest link,
    plus one copy through the flat buffer (read + write) at memory bandwidth. ``own``: the collective's
    own measured link (net.reduce_scatter_collective / all_gather_collective), used within one host."""
    count = len(devices)
    if count < 2 or num_bytes <= 0:
        return 0.0
    hosts = {d // net.devices_per_host for d in devices}
    link = (own or net.intra_host_collective or net.intra_host) if len(hosts) == 1 else (
        net.inter_host_collective or net.inter_host)
    steps = count - 1
    return steps * (link.latency_s + num_bytes / count / link.bandwidth_bytes_per_s) + (
        2 * num_bytes / net.device.memory_bandwidth_bytes_per_s)


def fsdp_host_seconds(net: Cluster, kind: str, unit_bytes: float) -> float:
    """FSDP2's host time around one call: a + b * unit bytes of the kind's fit, else the flat figure per call."""
    if net.fsdp_calls is None:
        return net.fsdp_call_overhead_s
    fit = net.fsdp_calls.to_json()
    return fit[f"{kind}_s"] + fit[f"{kind}_s_per_byte"] * unit_bytes


def sharded_collectives(plan: Plan, chain: CostChain, net: Cluster, stage_index: int) -> dict[str, float]:
    """Seconds of a sharded stage's collectives: "start" (before its first forward), "F"/"B" (added to every
    forward/backward), "tail" (after its last backward). Weights gathered: all the stage holds; gradients
    scattered: its own (tied ones keep their tie allreduce)."""
    stage = plan.stages[stage_index]
    out = {"start": 0.0, "F": 0.0, "B": 0.0, "tail": 0.0}
    if stage.sharding == "none" or stage.replicas < 2:
        return out
    weights = held_bytes(chain, stage.first_block, stage.stop_block, stage.tensor_parallel)
    grads = max(0, weights - sum(n for holders, n in tie_sets(plan, chain).items() if stage_index in holders))
    # one FSDP unit per block: each gathers and reduces its share in a collective of its own
    units = max(1, len(unit_sizes(chain, stage.first_block, stage.stop_block)))
    gathered = weights * (chain.param_copy_fraction or 1.0)  # bf16-params gathers bf16 copies
    # each call also costs FSDP2's own host time (its buffers and hooks)
    gather = sum(ring_half_seconds(net, gathered / units, leads(stage), net.all_gather_collective)
                 + (fsdp_host_seconds(net, "all_gather", gathered / units) if weights > 0 else 0.0)
                 for _ in range(units))
    scatter = sum(ring_half_seconds(net, grads / units, leads(stage), net.reduce_scatter_collective)
                  + (fsdp_host_seconds(net, "reduce_scatter", grads / units) if grads > 0 else 0.0)
                  for _ in range(units))
    if stage.sharding == "optimizer":  # ZeRO-1: gather updated weights once, scatter gradients once
        # FSDP2's hooks run every micro-batch's backward without a collective; the reduce-scatter's figure
        # already holds the last micro-batch's
        fit = net.fsdp_calls.to_json() if net.fsdp_calls is not None else {}
        hooks = sum(fit.get("pass_s", 0.0) + fit.get("pass_s_per_byte", 0.0) * grads / units
                    for _ in range(units)) if grads > 0 else 0.0
        out["start"], out["B"], out["tail"] = gather, hooks, max(0.0, scatter - hooks)
    elif stage.sharding == "gradients":  # ZeRO-2: scatter after every micro-batch's backward
        out["start"], out["B"] = gather, scatter
    elif stage.reshard_after_forward is False:  # ZeRO-3 keeping the forward's weights for its backward
        out["F"], out["B"] = gather, scatter
    else:  # ZeRO-3: gather for every forward and every backward, scatter after every backward
        out["F"], out["B"] = gather, gather + scatter
    return out


def splits_over(block, tensor_parallel: int) -> bool:  # type: ignore[no-untyped-def]
    return tensor_parallel > 1 and block.tp is not None and block.tp.divisor % tensor_parallel == 0


def group_link(net: Cluster, own: LinkSpec | None) -> LinkSpec:
    """A tensor-parallel group's collectives run inside one host: their own figure, else the host's."""
    return own or net.intra_host_collective or net.intra_host


def block_member_seconds(net: Cluster, block, rows: int, tensor_parallel: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Forward, backward seconds of one block on one group member: the split share divided by T, plus an
    all-gather and a reduce-scatter each way, each a ring of T-1 steps moving (T-1)/T of the bytes, and in
    backward one more all-gather of the column inputs kept as token shares (``tp.regather_bytes``)."""
    forward, backward = at(block.forward_s, rows) * stretch(net), at(block.backward_s, rows) * stretch(net)
    if not splits_over(block, tensor_parallel):
        return forward, backward
    keep = 1 - block.tp.time_share + block.tp.time_share / tensor_parallel
    comm, again = member_collectives(net, block, rows, tensor_parallel)
    return forward * keep + comm, backward * keep + comm + again


def member_collectives(net: Cluster, block, rows: int, tensor_parallel: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """A split block's collectives on one member: the all-gather and reduce-scatter each way (forward's pair; backward
    runs it in B), and backward's all-gather again of the column inputs (its W runs that); (0, 0) if it runs whole."""
    if not splits_over(block, tensor_parallel):
        return 0.0, 0.0
    moved = at(block.tp.comm_bytes, rows) * (tensor_parallel - 1) / tensor_parallel
    regathered = at(block.tp.regather_bytes, rows) * (tensor_parallel - 1) / tensor_parallel
    link = group_link(net, net.tensor_parallel_collective)  # lock-step figures, else the host's allreduce
    comm = 2 * ((tensor_parallel - 1) * link.latency_s + moved / link.bandwidth_bytes_per_s) if moved > 0 else 0.0
    again = (tensor_parallel - 1) * link.latency_s + regathered / link.bandwidth_bytes_per_s if regathered > 0 else 0.0
    return comm, again


def leads(stage) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    """One device per replica (its group's first)."""
    return tuple(stage.devices[r * stage.tensor_parallel] for r in range(stage.replicas))


def step_end_seconds(net: Cluster, plan: Plan) -> float:
    """The allreduce of seven float64 numbers over every device of the plan."""
    devices = tuple(sorted({d for stage in plan.stages for d in stage.devices}))
    return ring_allreduce_seconds(net, STEP_END_NUMBERS * 8, devices)


def compute_order(plan: Plan) -> list[list[tuple[str, int]]]:
    """Per stage, ``(kind, micro-batch)`` with kind F, B or W: the schedule as data."""
    schedule = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, plan.warmup_policy)
    return [[(action.op.value, action.microbatch_index) for action in actions] for actions in schedule.per_stage]


def is_split(order: list[list[tuple[str, int]]]) -> bool:
    return any(kind == "W" for actions in order for kind, _ in actions)


def my_lowering(order: list[list[tuple[str, int]]]) -> list[list[tuple[str, int]]]:
    """Per stage: receive before each forward/backward that needs one, send after; W moves nothing."""
    last = len(order) - 1
    programs = []
    for stage, actions in enumerate(order):
        program: list[tuple[str, int]] = []
        for kind, m in actions:
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
    rows: int
    seconds: dict[str, float]  # "F", "B", "W" -> compute seconds of one micro-batch
    sends: dict[str, list[tuple[Key, float]]] = field(default_factory=dict)  # "A"/"G" -> pieces in issue order
    expects: dict[str, int] = field(default_factory=dict)  # "A"/"G" -> pieces per receive


def stage_seconds(plan: Plan, chain: CostChain, net: Cluster, stage_index: int, rows: int, split: bool,
                  weight_share: float) -> dict[str, float]:
    """F, B, W seconds of one slice: recomputation reruns the forward in B; a split backward costs
    ``1 + split_backward_overhead`` of the fused one, W taking ``weight_share`` (stage 0: all in B). The
    driver's own time per action (``action_overhead_s``, stretched) goes into F and B, never W."""
    stage = plan.stages[stage_index]
    blocks = chain.blocks[stage.first_block:stage.stop_block]
    times = [block_member_seconds(net, b, rows, stage.tensor_parallel) for b in blocks]
    forward = sum(f for f, _ in times)
    backward = sum(b for _, b in times)
    if stage.recompute:
        backward += forward
    rerun, _, rerun_comm = rerun_and_dropped(chain, plan.stages[stage_index], rows, net)
    backward += rerun * stretch(net) + rerun_comm
    comm = unit_overlapped(plan, chain, net, stage_index, split)  # never split: ZeRO-2's scatter follows W whole
    action = net.action_overhead_s * stretch(net)
    if not split:
        return {"F": forward + comm["F"] + action, "B": backward + comm["B"] + action, "W": 0.0}
    # split: FSDP2 reduces after W (ZeRO-2's per-micro-batch scatter in W; ZeRO-3 never runs split)
    if stage_index == 0:
        return {"F": forward + comm["F"] + action, "B": backward + action, "W": comm["B"]}
    # the group's collectives stay whole where the runtime runs them (passes/tensor_parallel_ops.py): the pair, and
    # those of every forward rerun, with the input gradients in B; the column inputs' gather again with W's
    pairs = [member_collectives(net, b, rows, stage.tensor_parallel) for b in blocks]
    in_b = sum(pair for pair, _ in pairs) * (2 if stage.recompute else 1) + rerun_comm
    in_w = sum(again for _, again in pairs)
    total = (backward - in_b - in_w) * (1 + net.split_backward_overhead)
    return {"F": forward + comm["F"] + action, "B": total * (1 - weight_share) + in_b + action,
            "W": total * weight_share + in_w + comm["B"]}


def rerun_and_dropped(chain: CostChain, stage, rows: int, net: Cluster | None = None  # type: ignore[no-untyped-def]
                      ) -> tuple[float, list[float], float]:
    """Selective recompute written out: the forward compute seconds a stage's per-block choices rerun in one backward
    (unstretched), per block the bytes it stops keeping, and the collective seconds the rerun forwards run again
    (``net`` given). On a T-way group member a split block's core is 1/T; a recomputed split block saves the
    member's share of its activations less what it reads (whole), for its member forward and its collectives."""
    seconds, dropped, comm = 0.0, [], 0.0
    degree = stage.tensor_parallel
    for offset, choice in enumerate(stage.block_recompute):
        index = stage.first_block + offset
        block = chain.blocks[index]
        split = splits_over(block, degree)
        if choice == "attention":
            seconds += at(block.attention_core_s, rows) / (degree if split else 1)
            dropped.append(at(block.attention_core_bytes, rows) / (degree if split else 1))
        elif choice == "block":  # keeps what it reads and, last block, the loss's saved tensors
            reads = at(chain.input_bytes if index == 0 else chain.cut_bytes[index - 1], rows)
            loss = at(chain.loss_saved_bytes, rows) if index == chain.num_blocks - 1 else 0.0
            share = (1 - block.tp.saved_share + block.tp.saved_share / degree) if split else 1.0
            dropped.append(max(0.0, at(block.saved_bytes, rows) * share - reads - loss))
            keep = (1 - block.tp.time_share + block.tp.time_share / degree) if split else 1.0
            if split and net is not None:  # the member's forward, then its collectives run again
                comm += block_member_seconds(net, block, rows, degree)[0] - at(block.forward_s, rows) * stretch(net) * keep
            seconds += at(block.forward_s, rows) * keep
        else:
            dropped.append(0.0)
    return seconds, dropped, comm


def build_replicas(plan: Plan, chain: CostChain, net: Cluster, split: bool, weight_share: float) -> dict[Key, Replica]:
    rows_of = plan.global_batch_size // plan.num_microbatches
    replicas: dict[Key, Replica] = {}
    for stage in plan.stages:
        for r, (start, stop) in enumerate(slice_bounds(rows_of, stage.replicas)):
            seconds = stage_seconds(plan, chain, net, stage.stage_index, stop - start, split, weight_share)
            replicas[stage.stage_index, r] = Replica(stage.stage_index, leads(stage)[r], stop - start, seconds,
                                                     {"A": [], "G": []}, {"A": 0, "G": 0})
    for left, right in zip(plan.stages, plan.stages[1:], strict=False):
        cut = chain.cut_bytes[left.stop_block - 1]
        pairs = routes(rows_of, left.replicas, right.replicas)
        for i, j, rows in pairs:
            seconds = piece_seconds(net, leads(left)[i], leads(right)[j], at(cut, rows))
            replicas[left.stage_index, i].sends["A"].append(((right.stage_index, j), seconds))
            replicas[right.stage_index, j].expects["A"] += 1
        for i, j, rows in sorted(pairs, key=lambda p: (p[1], p[0])):  # gradients: each sender in receiver order
            seconds = piece_seconds(net, leads(right)[j], leads(left)[i], at(cut, rows))
            replicas[right.stage_index, j].sends["G"].append(((left.stage_index, i), seconds))
            replicas[left.stage_index, i].expects["G"] += 1
    return replicas


@dataclass
class Run:
    """What the event loop found per replica: when it reached its allreduce, when its last B/W ended, busy."""

    ready: dict[Key, float]
    last_gradient_end: dict[Key, float]
    busy: dict[int, float]


def event_loop(plan: Plan, replicas: dict[Key, Replica], programs: list[list[tuple[str, int]]],
               net: Cluster, extra: dict[int, float] | None = None,
               chain_net: tuple[CostChain, Cluster] | None = None) -> Run:
    """A plain time-ordered loop. Each message costs its sender and its receiver ``message_overhead_s``
    (stretched like compute): a send first packs all its pieces, then issues them; a receive takes them
    after the last one arrived. One send and one receive port per device, first come first served.
    ``extra[stage]``: the stage's last B or W takes that much longer (buckets in flight beside it).
    ``chain_net``: a sharded stage's replicas start their list after its step all-gather."""
    extra = extra or {}
    start_at = {key: sharded_collectives(plan, *chain_net, key[0])["start"] for key in replicas} if chain_net else {}
    last_pass = {stage: max(i for i, (kind, _) in enumerate(program) if kind in ("B", "W"))
                 for stage, program in enumerate(programs)}
    per_message = net.message_overhead_s * stretch(net)
    packed: set[tuple[Key, int]] = set()
    clock = {key: start_at.get(key, 0.0) for key in replicas}
    cursor = dict.fromkeys(replicas, 0)
    last_gradient = dict.fromkeys(replicas, 0.0)
    send_free: dict[int, float] = {}
    recv_free: dict[int, float] = {}
    arrivals: dict[tuple[Key, str, int], list[float]] = {}
    blocked: set[Key] = set()
    busy: dict[int, float] = {r.device: 0.0 for r in replicas.values()}
    queue = [(clock[key], key) for key in sorted(replicas)]
    while queue:
        now, key = heapq.heappop(queue)
        replica, program = replicas[key], programs[key[0]]
        if cursor[key] == len(program):
            continue
        kind, m = program[cursor[key]]
        if kind in ("F", "B", "W"):
            seconds = replica.seconds[kind] + (extra.get(key[0], 0.0) if cursor[key] == last_pass[key[0]] else 0.0)
            busy[replica.device] += seconds
            now += seconds
            if kind != "F":
                last_gradient[key] = now
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
    return Run(clock, last_gradient, busy)


def unit_sizes(chain: CostChain, first: int, stop: int) -> list[int]:
    """Bytes per FSDP unit of blocks [first, stop): each block's (module path, bytes) summed per path; a block
    with parameters and no such figures is a unit alone."""
    sizes: dict[str, int] = {}
    for index in range(first, stop):
        block = chain.blocks[index]
        entries = block.units or (((f"#{index}", block.param_bytes),) if block.param_bytes > 0 else ())
        for path, num_bytes in entries:
            sizes[path] = sizes.get(path, 0) + num_bytes
    return [n for n in sizes.values() if n > 0]


def held_bytes(chain: CostChain, first: int, stop: int, tensor_parallel: int = 1) -> int:
    """Parameter bytes a stage over blocks [first, stop) holds: its blocks', plus a copy of every shared
    parameter one of its blocks reads while an earlier block (another stage's) holds it. A member of a T-way
    group holds 1/T of each split block's sharded bytes (rounded up over the stage) and the rest whole."""
    copies = sum(s.num_bytes for s in chain.shared_params
                 if s.blocks[0] < first and any(first <= b < stop for b in s.blocks))
    if tensor_parallel == 1:
        return sum(b.param_bytes for b in chain.blocks[first:stop]) + copies
    member = 0.0
    for b in chain.blocks[first:stop]:
        sharded = b.tp.param_bytes if splits_over(b, tensor_parallel) else 0
        member += b.param_bytes - sharded + sharded / tensor_parallel
    return math.ceil(member) + copies


def tie_sets(plan: Plan, chain: CostChain) -> dict[tuple[int, ...], int]:
    """Stages sharing a parameter -> bytes summed over all of them in one allreduce."""
    stage_of = {}
    for stage in plan.stages:
        for block in range(stage.first_block, stage.stop_block):
            stage_of[block] = stage.stage_index
    ties: dict[tuple[int, ...], int] = {}
    for shared in chain.shared_params:
        holders = tuple(sorted({stage_of[b] for b in shared.blocks}))
        if len(holders) > 1:
            ties[holders] = ties.get(holders, 0) + shared.num_bytes
    return ties


def bucket_window(plan: Plan, chain: CostChain, net: Cluster, stage_index: int, split: bool,
                  weight_share: float) -> tuple[list[float], list[float]]:
    """Per block (forward order): seconds of the last gradient pass over it (largest slice) and bytes."""
    stage = plan.stages[stage_index]
    rows = max(stop - start for start, stop in slice_bounds(plan.microbatch_size, stage.replicas))
    blocks = chain.blocks[stage.first_block:stage.stop_block]
    share = 1.0
    if split:  # the buckets are armed at the last W: they fill over W's share of each block (stage 0: none)
        share = 0.0 if stage_index == 0 else (1 + net.split_backward_overhead) * weight_share
    degree = stage.tensor_parallel  # a group member's backward and bytes of each block
    held = [b.param_bytes - (b.tp.param_bytes if splits_over(b, degree) else 0) * (1 - 1 / degree) for b in blocks]
    return [block_member_seconds(net, b, rows, degree)[1] * share for b in blocks], [float(h) for h in held]


def unit_overlapped(plan: Plan, chain: CostChain, net: Cluster, stage_index: int, split: bool) -> dict[str, float]:
    """:func:`sharded_collectives` with ZeRO-2/3's per-micro-batch ones beside compute where the devices run them on
    streams of their own (not CPU ranks: FSDP2 blocks on gloo). One segment per block holding parameters (blocks
    without join the one before), on the largest slice; the collectives in equal shares. Forward: segment u computes
    while unit u+1 gathers. Backward, last unit first: segment k computes while unit k-1's scatter (just finished)
    and then unit k+1's gather (ZeRO-3 resharding) run; the first gather waits, the last scatter ends it."""
    comm = sharded_collectives(plan, chain, net, stage_index)
    stage = plan.stages[stage_index]
    if (net.device.name.upper().startswith("CPU") or stage.replicas < 2 or stage.sharding not in ("gradients", "parameters")
            or (stage.sharding == "gradients" and split)):
        return comm
    rows = max(stop - start for start, stop in slice_bounds(plan.microbatch_size, stage.replicas))
    segments: list[list[float]] = []
    for block in chain.blocks[stage.first_block:stage.stop_block]:
        forward, backward = block_member_seconds(net, block, rows, stage.tensor_parallel)
        if block.param_bytes > 0:
            segments.append([forward, backward])
        elif segments:
            segments[-1][0] += forward
            segments[-1][1] += backward
    count = len(segments)
    if count < 2:
        return comm
    gather = comm["F"] / count if stage.sharding == "parameters" else 0.0
    again = gather if stage.sharding == "parameters" and stage.reshard_after_forward is not False else 0.0
    scatter = (comm["B"] - again * count) / count

    def late(seconds: float, flights: list[float]) -> float:  # wall beyond the compute alone
        pass_end, comm_end = rate_loop([(0.0, x) for x in flights if x > 0], seconds, net)
        return max(pass_end, comm_end) - seconds

    forward_s = (gather + sum(late(f, [gather]) for f, _ in segments[:-1])) if gather else 0.0
    backward_s = again + scatter
    for k, (_, b) in enumerate(reversed(segments)):
        backward_s += late(b, ([scatter] if k else []) + ([again] if k < count - 1 else []))
    return {**comm, "F": forward_s if stage.sharding == "parameters" else comm["F"], "B": backward_s}


def rate_loop(buckets: list[tuple[float, float]], pass_s: float, net: Cluster) -> tuple[float, float]:
    """(when the pass ends, when the last bucket ends) from the pass's start: both advance at their rates
    (1 / (1 + slowdown) while the other runs too, else 1) from event to event; buckets run one at a time,
    each once compute reached its readiness (compute seconds) and the previous one is done."""
    compute_rate = 1 / (1 + net.overlap_compute_slowdown)
    comm_rate = 1 / (1 + net.overlap_comm_slowdown)
    clock, computed, pass_end = 0.0, 0.0, (0.0 if pass_s <= 0 else None)
    waiting, flying = list(buckets), None  # flying: allreduce seconds left of the bucket in flight
    while True:
        if flying is None and waiting and waiting[0][0] <= computed:
            flying = waiting.pop(0)[1]
        computing = pass_end is None
        if not computing and flying is None:
            if not waiting:
                return pass_end, clock
            flying = waiting.pop(0)[1]
            continue
        goal = pass_s if flying is not None or not waiting else min(waiting[0][0], pass_s)
        steps = []
        if computing:
            steps.append((goal - computed) / (compute_rate if flying is not None else 1.0))
        if flying is not None:
            steps.append(flying / (comm_rate if computing else 1.0))
        step = min(steps)
        if computing:
            computed = goal if step == steps[0] else computed + step * (compute_rate if flying is not None else 1.0)
        if flying is not None:
            left = flying - step * (comm_rate if computing else 1.0)
            flying = None if step == steps[-1] else left
        clock += step
        if computing and computed >= pass_s:
            pass_end = clock


def stage_buckets(plan: Plan, chain: CostChain, net: Cluster, stage_index: int, own_bytes: float, split: bool,
                  weight_share: float) -> tuple[list[tuple[float, float]], float] | None:
    """The stage's buckets as (compute seconds into the last gradient pass when full, allreduce seconds),
    and the pass's length; None without buckets or anything to reduce. Buckets close once they hold
    ``plan.allreduce_bucket_bytes`` as the pass walks the blocks backwards."""
    devices = leads(plan.stages[stage_index])
    if own_bytes <= 0 or gradient_allreduce_seconds(net, own_bytes, devices) <= 0 or plan.allreduce_bucket_bytes <= 0:
        return None
    seconds, block_bytes = bucket_window(plan, chain, net, stage_index, split, weight_share)
    scale = own_bytes / sum(block_bytes)
    out, elapsed, filled = [], 0.0, 0.0
    for block in reversed(range(len(seconds))):
        elapsed += seconds[block]
        filled += block_bytes[block] * scale
        if filled >= plan.allreduce_bucket_bytes:
            out.append((elapsed, gradient_allreduce_seconds(net, filled, devices)))
            filled = 0.0
    if filled > 0:
        out.append((elapsed, gradient_allreduce_seconds(net, filled, devices)))
    return out, elapsed


def pass_stretch(plan: Plan, chain: CostChain, net: Cluster, stage_index: int, own_bytes: float, split: bool,
                 weight_share: float) -> float:
    """How much longer the stage's last gradient pass takes beside its buckets (0 when overlap is free)."""
    found = stage_buckets(plan, chain, net, stage_index, own_bytes, split, weight_share)
    if found is None or (net.overlap_compute_slowdown == 0 and net.overlap_comm_slowdown == 0):
        return 0.0
    if plan.stages[stage_index].sharding != "none":  # no buckets beside the pass
        return 0.0
    return rate_loop(found[0], found[1], net)[0] - found[1]


def stage_allreduce(plan: Plan, chain: CostChain, net: Cluster, stage_index: int, own_bytes: float,
                    ready: float, split: bool, weight_share: float) -> tuple[float, float]:
    """(start, end) of the stage's replica allreduce of its own bytes; buckets close once they hold
    ``plan.allreduce_bucket_bytes`` as the last gradient pass walks the blocks backwards, and go one after
    another on one channel, each once full and the previous one done. ``ready``: when that pass ended."""
    devices = leads(plan.stages[stage_index])  # one replica allreduce per group index, on its own devices
    if plan.stages[stage_index].sharding != "none" and len(devices) > 1:  # a reduce-scatter tail or nothing
        return ready, ready + sharded_collectives(plan, chain, net, stage_index)["tail"]
    whole = gradient_allreduce_seconds(net, own_bytes, devices)
    if own_bytes <= 0 or whole <= 0:
        return ready, ready
    if plan.allreduce_bucket_bytes <= 0:
        return ready, ready + whole
    if net.overlap_compute_slowdown or net.overlap_comm_slowdown:
        found = stage_buckets(plan, chain, net, stage_index, own_bytes, split, weight_share)
        assert found is not None
        pass_end, last_end = rate_loop(found[0], found[1], net)
        pass_start = ready - pass_end
        return pass_start + found[0][0][0], pass_start + max(last_end, pass_end)
    seconds, block_bytes = bucket_window(plan, chain, net, stage_index, split, weight_share)
    scale = own_bytes / sum(block_bytes)
    window_start = ready - sum(seconds)
    buckets, elapsed, filled = [], 0.0, 0.0
    for block in reversed(range(len(seconds))):
        elapsed += seconds[block]
        filled += block_bytes[block] * scale
        if filled >= plan.allreduce_bucket_bytes:
            buckets.append((window_start + elapsed, filled))
            filled = 0.0
    if filled > 0:
        buckets.append((window_start + elapsed, filled))
    end = -math.inf
    for full_at, num_bytes in buckets:
        end = max(end, full_at) + gradient_allreduce_seconds(net, num_bytes, devices)
    return buckets[0][0], end


def inflight_peak(order: list[tuple[str, int]], split: bool) -> int:
    """Micro-batches whose forward ran and whose activations are still kept (until B, or W when split)."""
    held: set[int] = set()
    worst = 0
    for kind, m in order:
        if kind == "F":
            held.add(m)
        elif kind == ("W" if split else "B"):
            held.discard(m)
        worst = max(worst, len(held))
    return worst


def fsdp_step_peak_bytes(level: str, held: float, replicas: int, kept_per_byte: int, num_microbatches: int) -> float:
    """Peak weights + gradients + optimizer state of one replica of a sharded stage over a step, walking what
    FSDP2 (torch/distributed/fsdp/_fully_shard/) allocates and frees when fxpipe wraps the whole stage as one
    unit (fxpipe/runtime/parallel/sharded_stage.py), micro-batch by micro-batch, forward then backward:

    - a gather allocates a flat output (all the weights) and copies it out into the weights, both alive at
      once, beside the shard (kept); the flat one is freed at the forward's end;
    - ZeRO-1/2 gather in the first forward and keep the weights until the last backward; ZeRO-3 gathers in
      every forward and every backward and frees the weights after each;
    - a backward makes the full gradients (ZeRO-1 accumulates them until the last backward);
    - a reduce-scatter (ZeRO-1: the last backward; ZeRO-2/3: every one) first frees the weights when this
      backward reshards (the last one, every one under ZeRO-3) and the input the previous reduce-scatter kept,
      then copies the gradients into a new flat input, frees them, and adds into the gradient shard; that
      input stays alive until the next reduce-scatter or the step's end.
    """
    shard = held / replicas
    resident = shard + (kept_per_byte - 2) * shard  # weight shard + optimizer state, all step long
    weights = grads = kept_input = grad_shard = 0.0
    peak = resident

    def note(*extra: float) -> None:
        nonlocal peak
        peak = max(peak, resident + weights + grads + kept_input + grad_shard + sum(extra))

    def gather() -> None:
        nonlocal weights
        if weights == 0.0:
            note(held, held)  # flat output + the weights copied out of it
            weights = held

    for index in range(num_microbatches):
        last = index == num_microbatches - 1
        gather()  # forward
        if level == "parameters":
            weights = 0.0
        gather()  # backward (a no-op where the forward's weights are kept)
        grads = held
        note()
        if level == "optimizer" and not last:
            continue
        if last or level == "parameters":
            weights = 0.0
        kept_input = 0.0
        note(held)  # the new flat input beside the gradients
        grads, grad_shard = 0.0, shard
        kept_input = 0.0 if last else held
        note()
    return peak


def per_block_peak_bytes(level: str, held: float, unit: float, replicas: int, kept_per_byte: int,
                         num_microbatches: int, reshard: bool) -> float:
    """The peak of a ZeRO-2/3 stage sharded one FSDP unit per block (largest ``unit``), buffer by buffer, as
    measured on gloo ranks (docs/sharding.md): the shards, the optimizer state and every gradient shard
    always; ZeRO-2 (or ZeRO-3 keeping its weights from forward to backward) the gathered weights, and from the
    second micro-batch on one unit's fresh gradients beside the previous unit's kept reduce-scatter input;
    ZeRO-3 one gathered unit, the next unit's flat all-gather output and its copy, and from the second
    micro-batch on the previous flat output (kept until the next copy-out) and the last backward's kept input."""
    shards_and_state = (kept_per_byte - 1) * held / replicas
    all_grad_shards = held / replicas
    later = num_microbatches > 1
    if level == "gradients" or not reshard:
        fresh_gradients = kept_input = unit if later else 0.0
        return shards_and_state + all_grad_shards + held + fresh_gradients + kept_input
    third = 1.0 if held >= 3 * unit else 0.0  # a third unit whose buffer can meet the other two
    if later:  # a forward after a backward: every gradient shard exists
        gathered, next_flat, next_copy, previous_flat, kept_input = unit, unit, unit, third * unit, unit
        return shards_and_state + all_grad_shards + gathered + next_flat + next_copy + previous_flat + kept_input
    # the one backward, at the second unit: the units after it reduced (their gradient shards made)
    gathered, gradients, prefetched, kept_input = unit, unit, unit, third * unit
    made_shards = (held - 2 * unit) / replicas
    return shards_and_state + made_shards + gathered + gradients + prefetched + kept_input


def stage_peak_bytes(plan: Plan, chain: CostChain, stage_index: int, inflight: int, optimizer: str = "adam") -> int:
    """Weights x (weights, gradients, optimizer state) + kept activations + one buffer each way, largest slice.

    Kept per in-flight micro-batch: its saved activations (received values it saves again included) and its
    input slice; recomputing stages keep only the input slice, plus one micro-batch's activations while
    backward reruns the forward.
    Sharded: :func:`fsdp_step_peak_bytes`, FSDP2's buffers walked through the step."""
    stage = plan.stages[stage_index]
    rows = -(-plan.microbatch_size // stage.replicas)
    blocks = chain.blocks[stage.first_block:stage.stop_block]
    held = held_bytes(chain, stage.first_block, stage.stop_block, stage.tensor_parallel)
    kept_per_byte = BYTES_KEPT_PER_PARAM_BYTE[optimizer]
    sizes = unit_sizes(chain, stage.first_block, stage.stop_block)
    largest = max(sizes, default=0)
    if chain.param_copy_fraction > 0:  # bf16-params: tests/reference_mixed_memory.py
        unit = largest if len(sizes) > 1 and not stage.recompute and largest < held else held
        weights = mixed_peak_bytes(stage.sharding, held, unit, stage.replicas, kept_per_byte, plan.num_microbatches,
                                   stage.reshard_after_forward is not False, chain.param_copy_fraction)
    elif stage.sharding == "none" or stage.replicas == 1:
        weights = float(kept_per_byte * held)
    elif len(sizes) > 1 and not stage.recompute and stage.sharding != "optimizer" and largest < held:
        weights = per_block_peak_bytes(stage.sharding, held, largest, stage.replicas, kept_per_byte,
                                       plan.num_microbatches, stage.reshard_after_forward is not False)
    else:
        weights = fsdp_step_peak_bytes(stage.sharding, held, stage.replicas, kept_per_byte, plan.num_microbatches)
    # a value an earlier stage saved (first, or last before this stage) is received and saved here again
    resaved = sum(at(num_bytes, rows) for b in blocks for saver, num_bytes in b.resaved if saver < stage.first_block)
    degree = stage.tensor_parallel  # a group member saves 1/T of a split block's sharded share
    saved = sum(at(b.saved_bytes, rows) * ((1 - b.tp.saved_share + b.tp.saved_share / degree)
                                           if splits_over(b, degree) else 1.0) for b in blocks) + resaved
    incoming = at(chain.cut_bytes[stage.first_block - 1], rows) if stage.first_block > 0 else 0.0
    outgoing = at(chain.cut_bytes[stage.stop_block - 1], rows) if stage.stop_block < chain.num_blocks else 0.0
    kept = inflight * incoming + saved if stage.recompute else inflight * (saved + incoming)
    dropped = rerun_and_dropped(chain, stage, rows)[1]
    if dropped:  # each in-flight micro-batch keeps less; one recomputed part at a time is rebuilt in backward
        kept += max(dropped) - inflight * sum(dropped)
    return math.ceil(weights + kept + incoming + outgoing)


@dataclass
class Reference:
    iteration_time_s: float
    allreduce_start_s: list[float]
    allreduce_end_s: list[float]
    busy: dict[int, float]  # device -> compute seconds
    peak_memory_bytes: list[int]
    inflight: list[int]


def reference_run(plan: Plan, chain: CostChain, net: Cluster, *, optimizer: str = "adam",
                  weight_share: float = WEIGHT_SHARE) -> Reference:
    """One iteration of ``plan`` under the documented model."""
    order = compute_order(plan)
    split = is_split(order)
    replicas = build_replicas(plan, chain, net, split, weight_share)
    ties = tie_sets(plan, chain)
    owns = [max(0, held_bytes(chain, stage.first_block, stage.stop_block, stage.tensor_parallel) - sum(
        num_bytes for holders, num_bytes in ties.items() if stage.stage_index in holders)) for stage in plan.stages]
    extra = {s: pass_stretch(plan, chain, net, s, owns[s], split, weight_share) for s in range(plan.num_stages)}
    run = event_loop(plan, replicas, my_lowering(order), net, extra, (chain, net))
    starts, ends, readies = [], [], []
    for stage in plan.stages:
        keys = [(stage.stage_index, r) for r in range(stage.replicas)]
        readies.append(max(run.ready[k] for k in keys))
        own = owns[stage.stage_index]
        # buckets fill during the last gradient pass: anchored at its end on the slowest replica
        anchor = max(run.last_gradient_end[k] for k in keys) if plan.allreduce_bucket_bytes > 0 else readies[-1]
        start, end = stage_allreduce(plan, chain, net, stage.stage_index, own, anchor, split, weight_share)
        starts.append(start)
        ends.append(max(end, readies[-1]))
    for holders, num_bytes in ties.items():
        devices = tuple(sorted(d for s in holders for d in leads(plan.stages[s])))
        tie_end = max(readies[s] for s in holders) + gradient_allreduce_seconds(net, num_bytes, devices)
        for s in holders:
            ends[s] = max(ends[s], tie_end)
    optimizer_s = max(net.optimizer_s_per_param_byte * stretch(net)
                      * held_bytes(chain, s.first_block, s.stop_block, s.tensor_parallel)
                      / (s.replicas if s.sharding != "none" else 1) for s in plan.stages)  # sharded: its shard
    busy = dict(run.busy)
    for stage in plan.stages:  # a group's members compute alongside its first
        for index, device in enumerate(stage.devices):
            busy[device] = run.busy[stage.devices[index - index % stage.tensor_parallel]]
    inflight = [inflight_peak(order[s], split) for s in range(plan.num_stages)]
    return Reference(
        iteration_time_s=max(ends) + step_end_seconds(net, plan) + net.step_overhead_s * stretch(net) + optimizer_s,
        allreduce_start_s=starts, allreduce_end_s=ends, busy=busy,
        peak_memory_bytes=[stage_peak_bytes(plan, chain, s, inflight[s], optimizer) for s in range(plan.num_stages)],
        inflight=inflight,
    )
