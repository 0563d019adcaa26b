"""The virtual planner's per-group choices: each device group's ZeRO level and its chunks' per-block recompute."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from fxpipe.core.plan import Plan
from fxpipe.core.schedule import Op, Schedule
from fxpipe.core.sharding import SHARDING_LEVELS
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.request import PlanRequest
from fxpipe.passes.partition.selective import block_options
from fxpipe.passes.partition.virtual_request import INTERLEAVED
from fxpipe.sim.sharding_cost import ShardingComm, plan_sharding_comms
from fxpipe.sim.stagecost import (
    gradient_allreduce_time,
    own_allreduce_bytes,
    replica_leads,
    stage_memory_bytes,
    tie_groups,
)
from fxpipe.sim.virtual_simulate import virtual_schedule


@dataclass(frozen=True)
class GroupChoice:
    """One device group's setting: its level, per chunk its per-block choices (``()``: keep all) or a whole-chunk
    checkpoint, and the step seconds the planner ranks it by (its collectives and the forwards it reruns)."""

    level: str
    block_recompute: tuple[tuple[str, ...], ...]
    recompute: bool
    seconds: float


def held_vectors(plan: Plan, group: int) -> np.ndarray:
    """:func:`_held_vectors` of the plan's schedule (cached by what builds it)."""
    return _held_vectors(plan.schedule, len(plan.stages), plan.num_microbatches, plan.virtual_stages, group)


@functools.lru_cache(maxsize=1024)
def _held_vectors(name: str, num_chunks: int, num_microbatches: int, virtual_stages: int, group: int) -> np.ndarray:
    """Every distinct count of micro-batches each of the group's chunks holds along its list (rows; columns in
    ``chunks_of_group`` order), the start included: where a group's memory can peak (as ``group_peak_bytes`` walks)."""
    schedule = virtual_schedule(name, num_chunks, num_microbatches, virtual_stages)
    chunks = sorted({action.chunk_index for action in schedule.per_stage[group]})
    column = {chunk: i for i, chunk in enumerate(chunks)}
    release = Op.WEIGHT if schedule.split_backward else Op.BACKWARD
    held = [0] * len(chunks)
    seen = {tuple(held)}
    for action in schedule.per_stage[group]:
        if action.op is Op.FORWARD or action.op is release:
            held[column[action.chunk_index]] += 1 if action.op is Op.FORWARD else -1
            seen.add(tuple(held))
    return np.array(sorted(seen), dtype=float)


def _affine(model: CandidateCosts, plan: Plan, chunk: int, level: str, recompute: bool) -> tuple[float, float]:
    """A chunk's bytes per device as ``a + b x held`` (:func:`stage_memory_bytes` at 0 and 1 held)."""
    stage = plan.stages[chunk]
    cost = model.cost(stage.first_block, stage.stop_block, plan.microbatch_size, stage.replicas, stage.tensor_parallel)
    at = [stage_memory_bytes(cost, held, model.optimizer, recompute, sharding=level, replicas=stage.replicas,
                             num_microbatches=plan.num_microbatches) for held in (0, 1)]
    return float(at[0]), float(at[1] - at[0])


class _GroupBlocks:
    """A group's per-block options and memory along its list, for :func:`pick_chunk_choices`: ``state[i][b]`` indexes
    block b of chunk i's options; ``drop`` is what a chunk's choices take off at each point of the list."""

    def __init__(self, model: CandidateCosts, plan: Plan, group: int, level: str, limit_bytes: float) -> None:
        chunks = plan.chunks_of_group(group)
        self.held = held_vectors(plan, group)
        self.base = sum(a + b * self.held[:, i] for i, (a, b) in enumerate(
            _affine(model, plan, c, level, False) for c in chunks))
        self.limit = limit_bytes
        self.options = []
        for c in chunks:
            stage = plan.stages[c]
            rows = model.cost(stage.first_block, stage.stop_block, plan.microbatch_size, stage.replicas,
                              stage.tensor_parallel).rows
            self.options.append(block_options(model.chain, stage.first_block, stage.stop_block, rows,
                                              model.cluster.compute_slowdown, stage.tensor_parallel, model.cluster))

    def drop(self, i: int, picked: Sequence[int]) -> np.ndarray:
        saved = [self.options[i][b][k][1] for b, k in enumerate(picked)]
        return self.held[:, i] * sum(saved) - max(saved, default=0.0)

    def peak(self, drops: Sequence[np.ndarray]) -> float:
        return float(np.max(self.base - sum(drops)))

    def excess(self, drops: Sequence[np.ndarray]) -> float:
        """Bytes over the limit summed over the list's points: an upgrade that lowers one of several equal peaks counts."""
        return float(np.sum(np.maximum(self.base - sum(drops) - self.limit, 0.0)))

    def best_upgrade(self, state: list[list[int]], drops: list[np.ndarray]) -> tuple[int, int, int, np.ndarray] | None:
        """The upgrade taking the most overflow off per added second (None: none takes any off)."""
        best: tuple[float, int, int, int, np.ndarray] | None = None
        now = self.excess(drops)
        for i, chunk_options in enumerate(self.options):
            for b, block in enumerate(chunk_options):
                have = block[state[i][b]]
                for k, (_, num_bytes, seconds) in enumerate(block):
                    if num_bytes <= have[1]:
                        continue
                    drop = self.drop(i, [*state[i][:b], k, *state[i][b + 1:]])
                    gain = now - self.excess([*drops[:i], drop, *drops[i + 1:]])
                    ratio = gain / max(seconds - have[2], 1e-30)
                    if gain > 0 and (best is None or ratio > best[0]):
                        best = (ratio, i, b, k, drop)
        return None if best is None else best[1:]

    def undo(self, state: list[list[int]], drops: list[np.ndarray]) -> None:
        """Each block (costliest choice first) back to the cheapest choice the group still fits with."""
        blocks = [(i, b) for i, chunk_options in enumerate(self.options) for b in range(len(chunk_options))]
        for i, b in sorted(blocks, key=lambda ib: -self.options[ib[0]][ib[1]][state[ib[0]][ib[1]]][2]):
            for k in range(state[i][b]):
                drop = self.drop(i, [*state[i][:b], k, *state[i][b + 1:]])
                if self.peak([*drops[:i], drop, *drops[i + 1:]]) <= self.limit:
                    state[i][b], drops[i] = k, drop
                    break


def pick_chunk_choices(model: CandidateCosts, plan: Plan, group: int, level: str,
                       limit_bytes: float) -> tuple[tuple[tuple[str, ...], ...], float] | None:
    """Per chunk of ``group`` per-block choices that bring the group's peak under ``limit_bytes`` at the least added
    forward time, and that time per micro-batch; None when recomputing every block does not. Greedy as
    :func:`fxpipe.passes.partition.selective.greedy_block_choices` is for a stage, on the group's peak over its list:
    take the upgrade with the most bytes off per added second (bytes over the limit, summed over the points of the list
    where it overflows) until it fits, then undo upgrades it fits without."""
    group_blocks = _GroupBlocks(model, plan, group, level, limit_bytes)
    options = group_blocks.options
    state = [[0] * len(chunk_options) for chunk_options in options]
    drops = [group_blocks.drop(i, s) for i, s in enumerate(state)]
    while group_blocks.peak(drops) > limit_bytes:
        upgrade = group_blocks.best_upgrade(state, drops)
        if upgrade is None:  # stuck (a chunk's first recomputed block adds its rebuilt part even where it holds none):
            # every block its most saving choice, then the undo below
            state = [[max(range(len(block)), key=lambda k: block[k][1]) for block in chunk_options]
                     for chunk_options in options]
            drops = [group_blocks.drop(i, s) for i, s in enumerate(state)]
            if group_blocks.peak(drops) > limit_bytes:
                return None
            break
        i, b, k, drop = upgrade
        state[i][b], drops[i] = k, drop
    group_blocks.undo(state, drops)
    choices = tuple(tuple(options[i][b][k][0] for b, k in enumerate(s)) for i, s in enumerate(state))
    seconds = sum(options[i][b][k][2] for i, s in enumerate(state) for b, k in enumerate(s))
    return tuple(() if set(c) == {"keep"} else c for c in choices), seconds


def group_levels(request: PlanRequest, plan: Plan, group: int, schedule: Schedule) -> tuple[str, ...]:
    """The levels a group may take: "none" alone without replicas; under ``sharding="auto"`` every level (ZeRO-3
    not under a split backward, which the runtime refuses); else the forced one."""
    if plan.stages[plan.chunks_of_group(group)[0]].replicas <= 1 or request.sharding == "none":
        return ("none",)
    levels = SHARDING_LEVELS if request.sharding == "auto" else (str(request.sharding),)
    return tuple(level for level in levels if not (level == "parameters" and schedule.split_backward))


class LevelSeconds:
    """A plan's groups' gradient collectives in one step per level: the chunks' ZeRO collectives, or unsharded the
    allreduce of the group's own gradients over its replicas (ties summed apart are the same at every level); each
    level's collectives computed once for the whole plan (a chunk's depend on its own blocks and devices alone)."""

    def __init__(self, model: CandidateCosts, plan: Plan) -> None:
        self.model, self.plan = model, plan
        self._comms: dict[str, list[ShardingComm]] = {}
        bounds = [(s.first_block, s.stop_block) for s in plan.stages]
        self._own = own_allreduce_bytes(model.chain, bounds, tie_groups(model.chain, bounds),
                                        [s.tensor_parallel for s in plan.stages])

    def __call__(self, group: int, level: str) -> float:
        plan = self.plan
        chunks = plan.chunks_of_group(group)
        if level != "none":
            if level not in self._comms:
                leveled = plan.with_updates(stages=tuple(replace(s, sharding=level) if s.replicas > 1 else s
                                                          for s in plan.stages))
                self._comms[level] = plan_sharding_comms(leveled, self.model.chain, self.model.cluster)
            return sum(self._comms[level][c].step_seconds(plan.num_microbatches) for c in chunks)
        first = plan.stages[chunks[0]]
        return gradient_allreduce_time(self.model.cluster, sum(self._own[c] for c in chunks),
                                       replica_leads(first.devices, first.tensor_parallel))


def _group_options(request: PlanRequest, model: CandidateCosts, plan: Plan, schedule: Schedule, group: int,
                   level_seconds: LevelSeconds) -> list[GroupChoice]:
    """Every setting of a group that fits: per level, all kept; else (``recompute="auto"``, interleaved 1F1B: a
    split backward cannot rerun a checkpoint) per-block choices, or every chunk checkpointed whole."""
    chunks = plan.chunks_of_group(group)
    held = held_vectors(plan, group)
    limit = request.memory_limit_bytes
    found = []
    recomputes = plan.schedule == INTERLEAVED and request.recompute in ("auto", "always")
    for level in group_levels(request, plan, group, schedule):
        comm_s = level_seconds(group, level)
        kept = sum(a + b * held[:, i] for i, (a, b) in enumerate(_affine(model, plan, c, level, False) for c in chunks))
        if float(np.max(kept)) <= limit and not (recomputes and request.recompute == "always"):
            found.append(GroupChoice(level, ((),) * len(chunks), False, comm_s))
            continue
        if not recomputes:
            continue
        if request.recompute == "auto":
            picked = pick_chunk_choices(model, plan, group, level, limit)
            if picked is not None:
                found.append(GroupChoice(level, picked[0], False, comm_s + plan.num_microbatches * picked[1]))
                continue
        whole = sum(a + b * held[:, i] for i, (a, b) in enumerate(_affine(model, plan, c, level, True) for c in chunks))
        if float(np.max(whole)) <= limit:
            rerun = sum(plan.stages[c].forward_s for c in chunks)
            found.append(GroupChoice(level, ((),) * len(chunks), True, comm_s + plan.num_microbatches * rerun))
    return found


def fit_groups(request: PlanRequest, model: CandidateCosts, plan: Plan, schedule: Schedule) -> Plan | None:
    """``plan`` with every group's fastest setting that fits (:func:`_group_options`, least seconds, then the lower
    level); None when some group has none. A group's
    memory is its own chunks' alone, so groups are decided one by one."""
    stages = list(plan.stages)
    level_seconds = LevelSeconds(model, plan)
    for group in range(plan.num_groups):
        options = _group_options(request, model, plan, schedule, group, level_seconds)
        if not options:
            return None
        best = min(options, key=lambda o: (o.seconds, SHARDING_LEVELS.index(o.level)))
        for chunk, choices in zip(plan.chunks_of_group(group), best.block_recompute, strict=True):
            stages[chunk] = replace(stages[chunk], sharding=best.level, recompute=best.recompute,
                                    block_recompute=choices)
    return plan.with_updates(stages=tuple(stages))  # node counts per block: dapple.partition, on the fine chain

