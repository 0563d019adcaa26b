"""The planner's virtual stages: device groups (the best plan's, and even ones) re-cut into chunks, priced exactly."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.schedule import Schedule
from fxpipe.passes.partition.block_partition import work_weights
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.plan_build import with_prediction
from fxpipe.passes.partition.request import PlanRequest, microbatch_grid
from fxpipe.passes.partition.virtual_choices import fit_groups
from fxpipe.passes.partition.virtual_request import ZBV, VirtualRequest
from fxpipe.sim.recompute_cost import selective_figures
from fxpipe.sim.stagecost import activation_peak_bytes
from fxpipe.sim.tensor_parallel_cost import tied_degree_conflict
from fxpipe.sim.virtual_simulate import group_peak_bytes, simulate_virtual, virtual_schedule

# every device group in pipeline order: (its devices, T), one replica per T devices (a T-way tensor-parallel group)
Groups = tuple[tuple[tuple[int, ...], int], ...]

# v tried under virtual_stages="auto": 2, 4, ... up to this many chunks per group (each chunk keeps a block).
MAX_AUTO_VIRTUAL_STAGES = 8
AUTO_VIRTUAL_STAGES = tuple(v for v in (2, 4, 8) if v <= MAX_AUTO_VIRTUAL_STAGES)  # what virtual_stages="auto" tries
# Micro-batch counts tried per group structure: the plain plan's M and this many grid neighbours each side.
MICROBATCH_NEIGHBOURS = 1
# The best virtual plan's cuts are moved one block at a time under the simulator while it has at most this many
# chunks and devices (each move is one exact simulation; deeper or wider plans keep their balanced cuts).
MAX_POLISH_CHUNKS = 8
MAX_POLISH_DEVICES = 64
MAX_POLISH_ROUNDS = 3


@dataclass(frozen=True)
class Trial:
    """One virtual plan to price: chunks cut at ``stops`` on ``groups``, ``virtual_stages`` per group."""

    groups: Groups
    virtual_stages: int
    schedule: str
    rows: int
    stops: tuple[int, ...]


@dataclass(frozen=True)
class Priced:
    """A trial's plan with its simulated iteration time (None: it does not fit in memory)."""

    trial: Trial
    plan: Plan
    time_s: float
    bubble: float


def scaled_balanced_cuts(weights: Sequence[float], scales: Sequence[float]) -> list[int]:
    """Stops of ``len(scales)`` non-empty contiguous parts minimising the largest ``part sum / scales[part]``.

    The exact dynamic program of :func:`balanced_cuts` with a divisor per part (a chunk on a group of r
    replicas runs a slice of 1/r of the rows); ties prefer earlier cuts."""
    num_items, num_parts = len(weights), len(scales)
    if not 1 <= num_parts <= num_items:
        raise ValueError(f"cannot cut {num_items} blocks into {num_parts} non-empty parts")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(weights, dtype=float))))
    best = np.full((num_parts + 1, num_items + 1), np.inf)
    choice = np.zeros((num_parts + 1, num_items + 1), dtype=int)
    best[0][0] = 0.0
    for part in range(1, num_parts + 1):
        for stop in range(part, num_items - (num_parts - part) + 1):
            values = np.maximum(best[part - 1, part - 1:stop], (prefix[stop] - prefix[part - 1:stop]) / scales[part - 1])
            offset = int(np.argmin(values))
            best[part, stop], choice[part, stop] = values[offset], part - 1 + offset
    stops, stop = [], num_items
    for part in range(num_parts, 0, -1):
        stops.append(stop)
        stop = int(choice[part, stop])
    return stops[::-1]


def chunk_groups_of(schedule: str, num_groups: int, virtual_stages: int) -> tuple[int, ...]:
    """The group of every chunk: a V for ZB-V, else a loop (chunk c on group c mod G)."""
    if schedule == ZBV:
        return (*range(num_groups), *reversed(range(num_groups)))
    return tuple(chunk % num_groups for chunk in range(num_groups * virtual_stages))


def group_structures(plain: Plan, num_devices: int, forced: bool, depths: Sequence[int] = ()) -> list[Groups]:
    """Device groups to lay chunks on: the plain plan's stages (two or more; their devices and T), and unless the
    layout is forced, G even groups of contiguous devices for G = 2, 4, ... dividing the devices, at T = 1 and at
    the plain plan's T where all its stages share one (a T-way group stays inside a host: T divides the width).
    Unless forced, also G groups of N // G contiguous devices at T = 1 for each G of ``depths`` (the deepest loop of
    each v tried: blocks // v groups, a block a chunk), which need not divide N nor be a power of two (56 blocks at
    v = 2 on 32 devices: 28 groups of one, 4 devices idle): what blocks that each need a device of their own fit as."""
    found: list[Groups] = [tuple((stage.devices, stage.tensor_parallel) for stage in plain.stages)
                           ] if len(plain.stages) > 1 else []
    degrees = sorted({1, plain.stages[0].tensor_parallel} if len({s.tensor_parallel for s in plain.stages}) == 1
                     else {1})
    num_groups = 2
    while not forced and num_groups <= num_devices:
        width = num_devices // num_groups
        for degree in degrees if num_devices % num_groups == 0 else ():
            if width % degree == 0:
                found.append(_even_groups(num_groups, width, degree))
        num_groups *= 2
    for depth in depths if not forced else ():
        num_groups = min(num_devices, depth)
        if num_groups >= 2:
            found.append(_even_groups(num_groups, num_devices // num_groups, 1))
    return list(dict.fromkeys(found))


def _even_groups(num_groups: int, width: int, degree: int) -> Groups:
    """``num_groups`` groups of ``width`` contiguous devices from device 0, each of T = ``degree``."""
    return tuple((tuple(range(g * width, (g + 1) * width)), degree) for g in range(num_groups))


def _microbatch_rows(request: PlanRequest, plain: Plan, groups: Groups) -> list[int]:
    """Micro-batch sizes for ``groups``: M >= G, every group's replicas get a row, near the plain plan's M."""
    widest = max(len(devices) // degree for devices, degree in groups)
    grid = [rows for rows in microbatch_grid(request)
            if rows >= widest and request.global_batch_size // rows >= len(groups)]
    if not grid:
        return []
    nearest = min(range(len(grid)), key=lambda i: (abs(grid[i] - plain.microbatch_size), i))
    return grid[max(0, nearest - MICROBATCH_NEIGHBOURS):nearest + MICROBATCH_NEIGHBOURS + 1]


def trials(request: PlanRequest, virtual: VirtualRequest, plain: Plan, forced: bool) -> Iterator[Trial]:
    """Every trial: group structure x v x schedule x micro-batch size, chunks cut balanced for the structure."""
    weights = work_weights(request.chain)
    num_blocks = request.chain.num_blocks
    counts = [virtual.virtual_stages] if virtual.virtual_stages else list(AUTO_VIRTUAL_STAGES)
    depths = [num_blocks // v for v in counts]
    for groups in group_structures(plain, request.cluster.num_devices, forced, depths):
        if request.all_devices and sum(len(g) for g in groups) != request.cluster.num_devices:
            continue
        for v in counts:
            if len(groups) * v > num_blocks:
                continue
            for schedule in virtual.schedules:
                if schedule == ZBV and v != 2:
                    continue
                layout = chunk_groups_of(schedule, len(groups), v)
                stops = tuple(scaled_balanced_cuts(weights, [len(groups[g][0]) for g in layout]))
                for rows in _microbatch_rows(request, plain, groups):
                    yield Trial(groups, v, schedule, rows, stops)


def chunk_plan(model: CandidateCosts, trial: Trial, planner: str) -> Plan:
    """The trial as a Plan (no predictions): chunk c over its blocks on its group's devices."""
    chain, rows = model.chain, trial.rows
    layout = chunk_groups_of(trial.schedule, len(trial.groups), trial.virtual_stages)
    stages = []
    for index, stop in enumerate(trial.stops):
        first = trial.stops[index - 1] if index else 0
        devices, degree = trial.groups[layout[index]]
        cost = model.cost(first, stop, rows, len(devices) // degree, degree)
        stages.append(StagePlan(
            stage_index=index, first_block=first, stop_block=stop, replicas=len(devices) // degree, devices=devices,
            tensor_parallel=degree,
            node_names=tuple(name for block in chain.blocks[first:stop] for name in block.node_names),
            forward_s=cost.forward_s, backward_s=cost.backward_s, allreduce_s=model.allreduce(first, stop, devices[::degree], degree),
            param_bytes=cost.param_bytes, activation_bytes=int(cost.activation_bytes)))
    return Plan(global_batch_size=model.global_batch_size, num_microbatches=model.global_batch_size // rows,
                stages=tuple(stages), schedule=trial.schedule, warmup_policy="A", planner=planner,
                cluster=model.cluster.name, num_devices=model.cluster.num_devices, num_blocks=chain.num_blocks,
                block_names=tuple(block.name for block in chain.blocks), virtual_stages=trial.virtual_stages,
                chunk_groups=layout)


def _schedule_of(plan: Plan) -> Schedule:
    return virtual_schedule(plan.schedule, len(plan.stages), plan.num_microbatches, plan.virtual_stages)


def peak_bytes(model: CandidateCosts, plan: Plan) -> int:
    """The most any device of ``plan`` holds (the virtual simulator's memory model, without simulating)."""
    schedule = _schedule_of(plan)
    return max(group_peak_bytes(plan, model.chain, schedule, g, model.optimizer, model.cluster)
               for g in range(plan.num_groups))


def lower_bound(plan: Plan) -> float:
    """No simulation of ``plan`` is faster: its busiest group's M (F + B) over its chunks on the largest slice."""
    return plan.num_microbatches * max(sum(plan.stages[c].forward_s + plan.stages[c].backward_s
                                           for c in plan.chunks_of_group(g)) for g in range(plan.num_groups))


def price(request: PlanRequest, model: CandidateCosts, trial: Trial, bound_s: float = float("inf")) -> Priced | None:
    """The trial simulated exactly, or None when it does not fit in memory or cannot beat ``bound_s``. Each group
    takes its fastest setting that fits (:func:`fxpipe.passes.partition.virtual_choices.fit_groups`): its ZeRO level
    under ``sharding="auto"`` (or the forced one), and under ``recompute="auto"`` per-block recompute on its chunks
    or every chunk checkpointed whole (interleaved 1F1B only: a split backward cannot rerun a checkpointed forward);
    ``"always"`` checkpoints every chunk whole."""
    plan = chunk_plan(model, trial, "dapple")
    schedule = _schedule_of(plan)
    if request.sharding == "parameters" and schedule.split_backward:
        return None  # the runtime refuses ZeRO-3 under a split backward (fxpipe.compile_plan.check_sharded_schedule)
    if lower_bound(plan) >= bound_s or _tie_conflict(model, plan):
        return None
    fitted = fit_groups(request, model, plan, schedule)
    if fitted is None or peak_bytes(model, fitted) > request.memory_limit_bytes:
        return None
    plan = fitted
    result = simulate_virtual(plan, request.chain, request.cluster, optimizer=request.optimizer,
                              schedule=schedule, timeline=False)
    stages = tuple(_with_memory(stage, peak, inflight, plan.num_microbatches, model)
                   for stage, peak, inflight in zip(plan.stages, result.peak_memory_bytes,
                                                    result.inflight_microbatches, strict=True))
    plan = with_prediction(plan.with_updates(stages=stages), result.iteration_time_s, result.bubble_fraction,
                           result.iteration_time_s, 0.0)
    return Priced(trial, plan, result.iteration_time_s, result.bubble_fraction)


def _with_memory(stage: StagePlan, peak: int, inflight: int, num_microbatches: int, model: CandidateCosts) -> StagePlan:
    cost = model.cost(stage.first_block, stage.stop_block, model.global_batch_size // num_microbatches, stage.replicas,
                      stage.tensor_parallel)
    return replace(stage, peak_memory_bytes=peak, inflight_microbatches=inflight,
                   activation_peak_bytes=activation_peak_bytes(cost, inflight, num_microbatches, stage.recompute, selective_figures(
                       model.chain, stage.first_block, stage.block_recompute, cost.rows,
                       tensor_parallel=stage.tensor_parallel)))


def _tie_conflict(model: CandidateCosts, plan: Plan) -> bool:
    """Whether a tied weight's holders differ in T (the runtime sums it shard by shard: one T over its holders)."""
    return bool(model.chain.shared_params) and bool(tied_degree_conflict(
        model.chain, [(stage.first_block, stage.stop_block, stage.tensor_parallel) for stage in plan.stages]))


def cut_moves(trial: Trial) -> Iterator[Trial]:
    """The trial with one cut moved one block either way (every chunk keeps a block)."""
    stops = trial.stops
    for index in range(len(stops) - 1):
        first = stops[index - 1] if index else 0
        for delta in (-1, 1):
            stop = stops[index] + delta
            if first < stop < stops[index + 1]:
                    yield replace(trial, stops=(*stops[:index], stop, *stops[index + 1:]))


def polish(request: PlanRequest, model: CandidateCosts, best: Priced) -> Priced:
    """Hill-climb the best plan's cuts under the simulator (small plans only: each move is a simulation)."""
    if len(best.trial.stops) > MAX_POLISH_CHUNKS or len(best.plan.all_devices()) > MAX_POLISH_DEVICES:
        return best
    for _ in range(MAX_POLISH_ROUNDS):
        better = best
        for moved in cut_moves(best.trial):
            priced = price(request, model, moved, better.time_s)
            if priced is not None and priced.time_s < better.time_s * (1 - 1e-9):
                better = priced
        if better is best:
            break
        best = better
    return best


def best_virtual(request: PlanRequest, virtual: VirtualRequest, plain: Plan, forced: bool) -> Priced | None:
    """The fastest trial that fits (cheapest lower bounds first, so later ones are cut by the best so far)."""
    model = CandidateCosts(request.chain, request.cluster, request.global_batch_size, request.optimizer,
                           request.memory_limit_bytes)
    ordered = sorted(((lower_bound(chunk_plan(model, t, "dapple")), i, t)
                      for i, t in enumerate(trials(request, virtual, plain, forced))), key=lambda x: (x[0], x[1]))
    best: Priced | None = None
    for _, _, trial in ordered:
        priced = price(request, model, trial, best.time_s if best else float("inf"))
        if priced is not None and (best is None or priced.time_s < best.time_s * (1 - 1e-12)):
            best = priced
    return polish(request, model, best) if best is not None else None
