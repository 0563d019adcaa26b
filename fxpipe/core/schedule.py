"""Pipeline schedules as data: per-stage action lists (GPipe, early-backward, zero-bubble, forward-only; the virtual-stage
ones from fxpipe.core.interleaved_schedules), one registry, lowering, validation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fxpipe.core.interleaved_schedules import (
    INTERLEAVED,
    INTERLEAVED_ZERO_BUBBLE,
    ZBV,
    interleaved_1f1b,
    interleaved_zero_bubble,
    zbv,
)
from fxpipe.core.schedule_types import FORWARD_ONLY, Action, Op, Schedule, ScheduleError, format_schedule
from fxpipe.core.virtual import LOOP, V_SHAPE


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(f"a schedule needs >= 1 stage and >= 1 micro-batch; got S={num_stages}, "
                            f"M={num_microbatches}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards in reverse micro-batch order (GPipe)."""
    _check_sizes(num_stages, num_microbatches)
    forwards = [Action(Op.FORWARD, m) for m in range(num_microbatches)]
    backwards = [Action(Op.BACKWARD, m) for m in reversed(range(num_microbatches))]
    per_stage = tuple(tuple(forwards + backwards) for _ in range(num_stages))
    return Schedule("gpipe", num_stages, num_microbatches, per_stage)


def warmup_forwards(stage_index: int, num_stages: int, num_microbatches: int, warmup_policy: str) -> int:
    """K_s, the forwards stage s runs before its first backward (DAPPLE section 1.5).

    Policy A (cheap communication): K_s = min(S - s, M).
    Policy B (communication comparable to compute): K_s = min(2 (S - s) - 1, M), which keeps one
    more micro-batch in flight per downstream stage so transfers overlap compute.
    """
    remaining = num_stages - stage_index
    if warmup_policy == "A":
        return min(remaining, num_microbatches)
    if warmup_policy == "B":
        return min(2 * remaining - 1, num_microbatches)
    raise ScheduleError(f"warm-up policy {warmup_policy!r} is unknown; choose 'A' or 'B'")


def early_backward(num_stages: int, num_microbatches: int, warmup_policy: str = "A") -> Schedule:
    """DAPPLE's synchronous 1F1B: K_s warm-up forwards, then one backward / one forward, then drain."""
    _check_sizes(num_stages, num_microbatches)
    per_stage = []
    for stage_index in range(num_stages):
        num_warmup = warmup_forwards(stage_index, num_stages, num_microbatches, warmup_policy)
        actions = [Action(Op.FORWARD, m) for m in range(num_warmup)]
        next_forward = num_warmup
        for m in range(num_microbatches):
            actions.append(Action(Op.BACKWARD, m))
            if next_forward < num_microbatches:
                actions.append(Action(Op.FORWARD, next_forward))
                next_forward += 1
        per_stage.append(tuple(actions))
    return Schedule(f"early_backward_{warmup_policy}", num_stages, num_microbatches, tuple(per_stage))


def zero_bubble(num_stages: int, num_microbatches: int, warmup_policy: str = "A") -> Schedule:
    """ZB-H1-style split backward with early-backward's memory: 1F1B order, W deferred where it is free.

    Stage s runs the K_s warm-up forwards of :func:`early_backward`, then per micro-batch B (input
    gradients, sent upstream at once), W (its parameter gradients) and the next F. W comes before
    that F so a stage never holds more than K_s micro-batches' activations (F done, W not yet):
    the same per-stage peak as early backward (:func:`inflight_peak`). The gain is the critical
    path: a gradient crosses each stage in B instead of B + W, which shrinks the warm-up and
    drain bubbles by about (S - 1) W (Qi et al. 2023, "Zero Bubble Pipeline Parallelism").
    Once no forward is left, the stage runs its remaining B's first and fills the wait for the
    next gradient with the deferred W's (one W after each B, the rest at the end).
    """
    _check_sizes(num_stages, num_microbatches)
    per_stage = []
    for stage_index in range(num_stages):
        num_warmup = warmup_forwards(stage_index, num_stages, num_microbatches, warmup_policy)
        actions = [Action(Op.FORWARD, m) for m in range(num_warmup)]
        pending_weights: list[int] = []
        for m in range(num_microbatches):
            actions.append(Action(Op.BACKWARD, m))
            pending_weights.append(m)
            next_forward = num_warmup + m
            if next_forward < num_microbatches:
                actions.extend(Action(Op.WEIGHT, w) for w in pending_weights)
                pending_weights.clear()
                actions.append(Action(Op.FORWARD, next_forward))
            elif len(pending_weights) > 1:  # drain: keep one W in hand to fill the next wait
                actions.append(Action(Op.WEIGHT, pending_weights.pop(0)))
        actions.extend(Action(Op.WEIGHT, w) for w in pending_weights)
        per_stage.append(tuple(actions))
    return Schedule(f"zero_bubble_{warmup_policy}", num_stages, num_microbatches, tuple(per_stage))



def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Every micro-batch's forward in order, no backward: evaluation and prediction.

    Nothing is kept for a backward, so a stage holds one micro-batch's activations at a time; the
    pipeline fills as in GPipe's forward phase.
    """
    _check_sizes(num_stages, num_microbatches)
    forwards = tuple(Action(Op.FORWARD, m) for m in range(num_microbatches))
    return Schedule(FORWARD_ONLY, num_stages, num_microbatches, tuple(forwards for _ in range(num_stages)))


def _forward_only_any_policy(num_stages: int, num_microbatches: int, warmup_policy: str) -> Schedule:
    return forward_only(num_stages, num_microbatches)  # no backward: no warm-up to choose


def _gpipe_any_policy(num_stages: int, num_microbatches: int, warmup_policy: str) -> Schedule:
    return gpipe(num_stages, num_microbatches)  # every micro-batch is in flight: no warm-up policy applies


@dataclass(frozen=True)
class ScheduleKind:
    """A schedule a plan can name: its generator, the other names users may write for it, and whether
    every micro-batch is in flight at once (then the warm-up policy does not matter)."""

    build: Callable[[int, int, str], Schedule]  # (num_stages, num_microbatches, warmup_policy)
    aliases: tuple[str, ...] = ()
    all_in_flight: bool = False
    trains: bool = True  # False: no backward (evaluate/predict run it); a training plan cannot name it
    # virtual stages: (num_groups, virtual_stages, num_microbatches) -> the schedule, and the chunk layout it
    # needs (fxpipe.core.virtual: "loop" or "v"); None/"" for one stage per device group
    build_virtual: Callable[[int, int, int], Schedule] | None = None
    chunk_layout: str = ""


def _needs_virtual(name: str) -> Callable[[int, int, str], Schedule]:
    def build(num_stages: int, num_microbatches: int, warmup_policy: str) -> Schedule:
        raise ScheduleError(f"schedule {name!r} runs several model chunks per device group; give virtual_stages "
                            ">= 2 (plan key virtual_stages), or use 'early_backward' or 'zero_bubble'")
    return build


# The one registry of schedules: plans, the planner, the CLI and fxpipe.compile all read it.
SCHEDULES: dict[str, ScheduleKind] = {
    "early_backward": ScheduleKind(early_backward, aliases=("dapple", "1f1b")),
    "gpipe": ScheduleKind(_gpipe_any_policy, all_in_flight=True),
    "zero_bubble": ScheduleKind(zero_bubble, aliases=("zb", "zbh1")),
    FORWARD_ONLY: ScheduleKind(_forward_only_any_policy, aliases=("eval",), trains=False),
    INTERLEAVED: ScheduleKind(_needs_virtual(INTERLEAVED), aliases=("interleaved_1f1b",),
                              build_virtual=interleaved_1f1b, chunk_layout=LOOP),
    INTERLEAVED_ZERO_BUBBLE: ScheduleKind(_needs_virtual(INTERLEAVED_ZERO_BUBBLE), aliases=("izb",),
                                          build_virtual=interleaved_zero_bubble, chunk_layout=LOOP),
    ZBV: ScheduleKind(_needs_virtual(ZBV), aliases=("zb_v",), build_virtual=zbv, chunk_layout=V_SHAPE),
}
# The schedules a plan trains with (plans, the planner and the CLI offer these).
TRAINING_SCHEDULES: dict[str, ScheduleKind] = {name: kind for name, kind in SCHEDULES.items() if kind.trains}
WARMUP_POLICIES = ("A", "B")  # DAPPLE's warm-up policies for early backward (see warmup_forwards)


def schedule_names() -> list[str]:
    """Every name a user may write for a training schedule (plan names and aliases), sorted."""
    return sorted([*TRAINING_SCHEDULES, *(alias for kind in TRAINING_SCHEDULES.values() for alias in kind.aliases)])


def schedule_name(name: str) -> str:
    """The plan name of schedule ``name`` (which may be an alias, e.g. ``"dapple"`` -> ``"early_backward"``)."""
    for plan_name, kind in SCHEDULES.items():
        if name == plan_name or name in kind.aliases:
            return plan_name
    choices = " or ".join(repr(plan_name) + (f" (alias {', '.join(map(repr, kind.aliases))})" if kind.aliases else "")
                          for plan_name, kind in SCHEDULES.items())
    raise ScheduleError(f"schedule {name!r} is unknown; choose {choices}")


def make_schedule(name: str, num_stages: int, num_microbatches: int, warmup_policy: str = "A",
                  virtual_stages: int = 1) -> Schedule:
    """Build a schedule by name (a key of :data:`SCHEDULES` or one of its aliases).

    With ``virtual_stages`` v > 1, ``num_stages`` counts model chunks (a plan's stages): the schedule runs them
    on ``num_stages / v`` device groups, v chunks each (the warm-up policy does not apply).
    """
    kind = SCHEDULES[schedule_name(name)]
    if virtual_stages == 1:
        return kind.build(num_stages, num_microbatches, warmup_policy)
    if kind.build_virtual is None or virtual_stages < 1 or num_stages % virtual_stages:
        virtual = sorted(n for n, k in SCHEDULES.items() if k.build_virtual is not None)
        raise ScheduleError(f"schedule {name!r} cannot run {num_stages} chunks as virtual_stages={virtual_stages} "
                            f"per device group; use one of {virtual} with v dividing the chunks, or virtual_stages=1")
    return kind.build_virtual(num_stages // virtual_stages, virtual_stages, num_microbatches)


def _chunk_of(schedule: Schedule, row: int, action: Action) -> int:
    """The chunk (plan stage) an action in list ``row`` runs: its own under virtual stages, else the row's stage."""
    return action.chunk_index if schedule.virtual else row


def _group_of(schedule: Schedule, chunk: int) -> int:
    """The list (device group) that runs ``chunk``."""
    return schedule.chunk_groups[chunk] if schedule.virtual else chunk


def lower(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Add transfers and the allreduce: per stage, the full list of actions a replica executes.

    A forward is preceded by receiving its activations (except on stage 0) and followed by
    sending them (except on the last stage); a backward mirrors this with gradients. A WEIGHT
    action moves nothing. The allreduce follows the stage's last backward or weight action, so
    it sums only complete gradients; a forward-only schedule has no gradients and no allreduce.
    Under virtual stages the lists are the device groups' and a chunk's neighbour on the same group
    is handed its values locally: no message either way.
    """
    last = schedule.num_chunks - 1
    reduces = not schedule.forward_only
    lowered = []
    for row, actions in enumerate(schedule.per_stage):
        out: list[Action] = []
        for action in actions:
            m, chunk = action.microbatch_index, _chunk_of(schedule, row, action)
            remote_before = chunk > 0 and _group_of(schedule, chunk - 1) != row
            remote_after = chunk < last and _group_of(schedule, chunk + 1) != row
            if action.op is Op.FORWARD:
                if remote_before:
                    out.append(Action(Op.RECV_ACTIVATION, m, action.chunk_index))
                out.append(action)
                if remote_after:
                    out.append(Action(Op.SEND_ACTIVATION, m, action.chunk_index))
            elif action.op is Op.BACKWARD:
                if remote_after:
                    out.append(Action(Op.RECV_GRADIENT, m, action.chunk_index))
                out.append(action)
                if remote_before:
                    out.append(Action(Op.SEND_GRADIENT, m, action.chunk_index))
            elif action.op is Op.WEIGHT:
                out.append(action)
            else:
                raise ScheduleError(f"stage {row}: unlowered schedules hold only F, B and W, got {action}")
        if reduces:
            out.append(Action(Op.ALLREDUCE))
        lowered.append(tuple(out))
    return tuple(lowered)


def inflight_peak(schedule: Schedule, stage_index: int) -> int:
    """Most micro-batches stage ``stage_index`` holds at once: forwards whose backward has not finished
    (under split backward: whose W has not run, since W still reads the saved activations). Under virtual
    stages ``stage_index`` is a chunk (a plan stage), counted in its group's list."""
    if not 0 <= stage_index < schedule.num_chunks:
        raise ScheduleError(f"stage {stage_index} is not in schedule {schedule.name!r} "
                            f"(stages 0..{schedule.num_chunks - 1})")
    row = _group_of(schedule, stage_index)
    actions = [a for a in schedule.per_stage[row] if _chunk_of(schedule, row, a) == stage_index]
    if schedule.forward_only:  # nothing is kept for a backward: one micro-batch at a time
        return 1 if actions else 0
    release = Op.WEIGHT if schedule.split_backward else Op.BACKWARD
    inflight = peak = 0
    for action in actions:
        inflight += 1 if action.op is Op.FORWARD else -1 if action.op is release else 0
        peak = max(peak, inflight)
    return peak


def validate_schedule(schedule: Schedule) -> None:
    """Check that every stage runs F and B (and W, for all or none) of every micro-batch once, B after F,
    W after B, and that it completes.

    Completion is checked by abstract execution under the runtime's semantics (sends are
    buffered, receives block): F(m) on stage s needs F(m) done on stage s-1, B(m) on stage s
    needs B(m) done on stage s+1. Under virtual stages the same holds per chunk, each chunk's actions
    in its own group's list (the hand-off between two chunks of one group included).
    Raises ScheduleError naming the problem, then the schedule.
    """
    problems = _shape_problems(schedule)
    if not problems:
        problems = _deadlock_problems(schedule)
    if problems:
        raise ScheduleError("invalid schedule: " + "; ".join(problems) + "\n" + format_schedule(schedule))


def _shape_problems(schedule: Schedule) -> list[str]:
    if schedule.num_stages < 1 or schedule.num_microbatches < 1:
        return [f"a schedule needs >= 1 stage and >= 1 micro-batch; got S={schedule.num_stages}, "
                f"M={schedule.num_microbatches}"]
    if len(schedule.per_stage) != schedule.num_stages:
        return [f"num_stages is {schedule.num_stages} but per_stage has {len(schedule.per_stage)} lists"]
    problems: list[str] = []
    split, trains = schedule.split_backward, not schedule.forward_only
    if schedule.virtual:
        return _chunk_problems(schedule, split, trains)
    for stage_index, actions in enumerate(schedule.per_stage):
        problems.extend(f"stage {stage_index}: {p}"
                        for p in _stage_problems(actions, schedule.num_microbatches, split, trains))
    return problems


def _chunk_problems(schedule: Schedule, split: bool, trains: bool) -> list[str]:
    """Virtual stages: every list runs only its group's chunks, each chunk's actions as a stage's would be."""
    groups = schedule.chunk_groups
    if sorted(set(groups)) != list(range(schedule.num_stages)):
        return [f"chunk_groups {list(groups)} must name every group 0..{schedule.num_stages - 1} (one list each)"]
    problems: list[str] = []
    for row, actions in enumerate(schedule.per_stage):
        problems.extend(f"group {row}: step {step} is {action}, but chunk {action.chunk_index} runs on another group"
                        for step, action in enumerate(actions)
                        if not (0 <= action.chunk_index < len(groups) and groups[action.chunk_index] == row))
        for chunk in (c for c, group in enumerate(groups) if group == row):
            mine = tuple(a for a in actions if a.chunk_index == chunk)
            problems.extend(f"group {row} chunk {chunk}: {p}"
                            for p in _stage_problems(mine, schedule.num_microbatches, split, trains))
    return problems


def _stage_problems(actions: tuple[Action, ...], num_microbatches: int, split: bool, trains: bool = True) -> list[str]:
    problems = []
    done: dict[Op, set[int]] = {Op.FORWARD: set()}
    if trains:
        done[Op.BACKWARD] = set()
    if split:
        done[Op.WEIGHT] = set()
    for step, action in enumerate(actions):
        m = action.microbatch_index
        if action.op not in done:
            problems.append(f"step {step} is {action}; unlowered schedules hold only F, B and W")
        elif not 0 <= m < num_microbatches:
            problems.append(f"step {step} is {action}; micro-batch {m} is outside 0..{num_microbatches - 1}")
        elif m in done[action.op]:
            problems.append(f"step {step} repeats {action}")
        elif action.op is Op.BACKWARD and m not in done[Op.FORWARD]:
            problems.append(f"step {step} runs B{m} before F{m}")
        elif action.op is Op.WEIGHT and m not in done[Op.BACKWARD]:
            problems.append(f"step {step} runs W{m} before B{m}")
        else:
            done[action.op].add(m)
    for op, seen in done.items():
        missing = sorted(set(range(num_microbatches)) - seen)
        if missing and not problems:
            problems.append(f"{op.value} of micro-batches {missing} never runs")
    return problems


def _waits_for(schedule: Schedule, row: int, action: Action) -> tuple[int, Action] | None:
    """The list and action that must finish first (None when the action needs no other chunk)."""
    chunk = _chunk_of(schedule, row, action)
    if action.op is Op.FORWARD and chunk > 0:
        other = chunk - 1
    elif action.op is Op.BACKWARD and chunk < schedule.num_chunks - 1:
        other = chunk + 1
    else:
        return None
    chunk_index = other if schedule.virtual else -1
    # the action itself when it already names that chunk (every action of a plain schedule): the planner
    # validates schedules of 100+ stages x 256 micro-batches, where replace() took a third of the time
    return _group_of(schedule, other), action if action.chunk_index == chunk_index else replace(
        action, chunk_index=chunk_index)


def _deadlock_problems(schedule: Schedule) -> list[str]:
    """Abstract execution: advance every stage as far as its dependencies allow, report who is stuck."""
    done: set[tuple[int, Action]] = set()
    cursor = [0] * schedule.num_stages
    pending = list(range(schedule.num_stages))
    while pending:
        row = pending.pop()
        actions = schedule.per_stage[row]
        while cursor[row] < len(actions):
            action = actions[cursor[row]]
            needed = _waits_for(schedule, row, action)
            if needed is not None and needed not in done:
                break
            done.add((row, action))
            cursor[row] += 1
            neighbour = _chunk_of(schedule, row, action) + (1 if action.op is Op.FORWARD else -1)
            if 0 <= neighbour < schedule.num_chunks:
                pending.append(_group_of(schedule, neighbour))
    stuck = []
    word = "group" if schedule.virtual else "stage"
    for row, actions in enumerate(schedule.per_stage):
        if cursor[row] < len(actions):
            action = actions[cursor[row]]
            needed = _waits_for(schedule, row, action)
            assert needed is not None, "an action that needs no other chunk never blocks"
            stuck.append(f"{word} {row} waits at step {cursor[row]} ({action}) for {needed[1]} on {word} {needed[0]}")
    return ["deadlock: " + ", ".join(stuck)] if stuck else []
