"""The simulator's per-stage programs: schedules lowered and encoded once, cached by (name, stages, M, policy)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fxpipe.core.schedule import Schedule, inflight_peak, lower, make_schedule, validate_schedule
from fxpipe.core.schedule_types import Op
from fxpipe.sim.events import (
    ALLREDUCE,
    BACKWARD,
    FORWARD,
    RECV_ACTIVATION,
    RECV_GRADIENT,
    SEND_ACTIVATION,
    SEND_GRADIENT,
    WEIGHT,
    Program,
    encode_program,
)


@dataclass(frozen=True)
class Prepared:
    """What the simulator needs of a schedule: its name, whether backward is split, every stage's encoded
    lowered program (:func:`fxpipe.core.schedule.lower`) and in-flight peak (:func:`inflight_peak`)."""

    name: str
    split_backward: bool
    programs: tuple[Program, ...]
    inflight: tuple[int, ...]


# The planner simulates hundreds of plans with a few dozen (name, S, M, policy) schedules of up to 128 stages x
# 512 micro-batches; building, lowering and encoding one took longer than simulating it. Only the encoded programs
# are kept (a Schedule of that size holds ~100k Action objects).
@functools.lru_cache(maxsize=64)
def built_programs(name: str, num_stages: int, num_microbatches: int, warmup_policy: str) -> Prepared:
    """A registry schedule (:func:`make_schedule`), prepared. Not validated: the registry's generators are
    checked by tests over every schedule, stage count and policy (tests/test_schedule_programs.py); what
    the code builds itself needs no run-time check, a user's schedule does (:func:`prepared`)."""
    return _prepare(make_schedule(name, num_stages, num_microbatches, warmup_policy))


@functools.lru_cache(maxsize=16)
def prepared(schedule: Schedule) -> Prepared:
    """A caller's own schedule, validated (:func:`validate_schedule`), then prepared."""
    validate_schedule(schedule)
    return _prepare(schedule)


def _prepare(schedule: Schedule) -> Prepared:
    if schedule.virtual:
        programs = tuple(encode_program(actions) for actions in lower(schedule))
        inflight = tuple(inflight_peak(schedule, s) for s in range(schedule.num_chunks))
    else:
        shared: dict[tuple[int, int], tuple[int, int]] = {}  # one tuple per (code, m) for all stages: memory
        programs = tuple(tuple(shared.setdefault(pair, pair) for pair in _lowered_row(schedule, row))
                         for row in range(schedule.num_stages))
        inflight = tuple(_inflight(schedule, row) for row in range(schedule.num_stages))
    return Prepared(schedule.name, schedule.split_backward, programs, inflight)


def _lowered_row(schedule: Schedule, row: int) -> Program:
    """:func:`lower`'s list for one stage of a plain schedule, encoded (equal to ``encode_program(lower(...)[row])``,
    tests/test_schedule_programs.py): a forward between receiving and sending activations, a backward between
    receiving and sending gradients (none at the ends of the pipeline), W alone, then the allreduce."""
    first, last = row == 0, row == schedule.num_stages - 1
    out: list[tuple[int, int]] = []
    for action in schedule.per_stage[row]:
        m = action.microbatch_index
        if action.op is Op.FORWARD:
            out.extend(((FORWARD, m),) if first else ((RECV_ACTIVATION, m), (FORWARD, m)))
            if not last:
                out.append((SEND_ACTIVATION, m))
        elif action.op is Op.BACKWARD:
            out.extend(((BACKWARD, m),) if last else ((RECV_GRADIENT, m), (BACKWARD, m)))
            if not first:
                out.append((SEND_GRADIENT, m))
        elif action.op is Op.WEIGHT:
            out.append((WEIGHT, m))
        else:
            return encode_program(lower(schedule)[row])  # lower() raises for what a plain list may not hold
    if not schedule.forward_only:
        out.append((ALLREDUCE, -1))
    return tuple(out)


def _inflight(schedule: Schedule, row: int) -> int:
    """:func:`inflight_peak` of one stage of a plain schedule, in one pass."""
    actions = schedule.per_stage[row]
    if schedule.forward_only:
        return 1 if actions else 0
    release = Op.WEIGHT if schedule.split_backward else Op.BACKWARD
    inflight = peak = 0
    for action in actions:
        if action.op is Op.FORWARD:
            inflight += 1
            peak = max(peak, inflight)
        elif action.op is release:
            inflight -= 1
    return peak
