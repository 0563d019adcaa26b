"""Pipeline schedules as data: per-stage action lists (GPipe, early-backward, zero-bubble, forward-only), lowering,
validation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from tabulate import tabulate


class Op(StrEnum):
    """What one action does. FORWARD/BACKWARD/WEIGHT compute; the others move data or gradients.

    In schedules without WEIGHT actions BACKWARD is the whole backward; in split-backward
    (zero-bubble) schedules BACKWARD computes only the input gradients (what the previous stage
    waits for) and WEIGHT the parameter gradients of the same micro-batch, later.
    """

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    RECV_ACTIVATION = "RA"
    SEND_ACTIVATION = "SA"
    RECV_GRADIENT = "RG"
    SEND_GRADIENT = "SG"
    ALLREDUCE = "AR"


@dataclass(frozen=True)
class Action:
    op: Op
    microbatch_index: int = -1  # -1 for ALLREDUCE, which covers the whole iteration

    def __str__(self) -> str:
        return self.op.value if self.microbatch_index < 0 else f"{self.op.value}{self.microbatch_index}"


@dataclass(frozen=True)
class Schedule:
    """Compute order of every stage; all replicas of a stage run the same list.

    ``per_stage[s]`` holds only FORWARD, BACKWARD and WEIGHT actions; :func:`lower` adds the
    transfers and the gradient allreduce that the simulator and the runtime both execute. A schedule
    either has a WEIGHT action for every (stage, micro-batch) or none (:attr:`split_backward`).
    """

    name: str
    num_stages: int
    num_microbatches: int
    per_stage: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        return format_schedule(self)

    @property
    def split_backward(self) -> bool:
        """Whether backward is split into B (input gradients) and W (parameter gradients)."""
        return any(action.op is Op.WEIGHT for actions in self.per_stage for action in actions)

    @property
    def forward_only(self) -> bool:
        """Whether this is the forward-only schedule (evaluation and prediction): by name, so a training
        schedule that lost its backwards still fails validation."""
        return self.name == FORWARD_ONLY


class ScheduleError(ValueError):
    """A schedule is malformed or cannot run to completion; the message shows the schedule."""


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


FORWARD_ONLY = "forward_only"


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


# The one registry of schedules: plans, the planner, the CLI and fxpipe.compile all read it.
SCHEDULES: dict[str, ScheduleKind] = {
    "early_backward": ScheduleKind(early_backward, aliases=("dapple", "1f1b")),
    "gpipe": ScheduleKind(_gpipe_any_policy, all_in_flight=True),
    "zero_bubble": ScheduleKind(zero_bubble, aliases=("zb", "zbh1")),
    FORWARD_ONLY: ScheduleKind(_forward_only_any_policy, aliases=("eval",), trains=False),
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


def make_schedule(name: str, num_stages: int, num_microbatches: int, warmup_policy: str = "A") -> Schedule:
    """Build a schedule by name (a key of :data:`SCHEDULES` or one of its aliases)."""
    return SCHEDULES[schedule_name(name)].build(num_stages, num_microbatches, warmup_policy)


def lower(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Add transfers and the allreduce: per stage, the full list of actions a replica executes.

    A forward is preceded by receiving its activations (except on stage 0) and followed by
    sending them (except on the last stage); a backward mirrors this with gradients. A WEIGHT
    action moves nothing. The allreduce follows the stage's last backward or weight action, so
    it sums only complete gradients; a forward-only schedule has no gradients and no allreduce.
    """
    last = schedule.num_stages - 1
    reduces = not schedule.forward_only
    lowered = []
    for stage_index, actions in enumerate(schedule.per_stage):
        out: list[Action] = []
        for action in actions:
            m = action.microbatch_index
            if action.op is Op.FORWARD:
                if stage_index > 0:
                    out.append(Action(Op.RECV_ACTIVATION, m))
                out.append(action)
                if stage_index < last:
                    out.append(Action(Op.SEND_ACTIVATION, m))
            elif action.op is Op.BACKWARD:
                if stage_index < last:
                    out.append(Action(Op.RECV_GRADIENT, m))
                out.append(action)
                if stage_index > 0:
                    out.append(Action(Op.SEND_GRADIENT, m))
            elif action.op is Op.WEIGHT:
                out.append(action)
            else:
                raise ScheduleError(f"stage {stage_index}: unlowered schedules hold only F, B and W, got {action}")
        if reduces:
            out.append(Action(Op.ALLREDUCE))
        lowered.append(tuple(out))
    return tuple(lowered)


def inflight_peak(schedule: Schedule, stage_index: int) -> int:
    """Most micro-batches stage ``stage_index`` holds at once: forwards whose backward has not finished
    (under split backward: whose W has not run, since W still reads the saved activations)."""
    if not 0 <= stage_index < len(schedule.per_stage):
        raise ScheduleError(f"stage {stage_index} is not in schedule {schedule.name!r} "
                            f"(stages 0..{len(schedule.per_stage) - 1})")
    if schedule.forward_only:  # nothing is kept for a backward: one micro-batch at a time
        return 1 if schedule.per_stage[stage_index] else 0
    release = Op.WEIGHT if schedule.split_backward else Op.BACKWARD
    inflight = peak = 0
    for action in schedule.per_stage[stage_index]:
        inflight += 1 if action.op is Op.FORWARD else -1 if action.op is release else 0
        peak = max(peak, inflight)
    return peak


def validate_schedule(schedule: Schedule) -> None:
    """Check that every stage runs F and B (and W, for all or none) of every micro-batch once, B after F,
    W after B, and that it completes.

    Completion is checked by abstract execution under the runtime's semantics (sends are
    buffered, receives block): F(m) on stage s needs F(m) done on stage s-1, B(m) on stage s
    needs B(m) done on stage s+1. Raises ScheduleError naming the problem, then the schedule.
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
    for stage_index, actions in enumerate(schedule.per_stage):
        problems.extend(f"stage {stage_index}: {p}"
                        for p in _stage_problems(actions, schedule.num_microbatches, split, trains))
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


def _waits_for(schedule: Schedule, stage_index: int, action: Action) -> int | None:
    """The stage whose same action must finish first (None when the action needs no other stage)."""
    if action.op is Op.FORWARD and stage_index > 0:
        return stage_index - 1
    if action.op is Op.BACKWARD and stage_index < schedule.num_stages - 1:
        return stage_index + 1
    return None


def _deadlock_problems(schedule: Schedule) -> list[str]:
    """Abstract execution: advance every stage as far as its dependencies allow, report who is stuck."""
    done: set[tuple[int, Action]] = set()
    cursor = [0] * schedule.num_stages
    pending = list(range(schedule.num_stages))
    while pending:
        stage_index = pending.pop()
        actions = schedule.per_stage[stage_index]
        while cursor[stage_index] < len(actions):
            action = actions[cursor[stage_index]]
            other = _waits_for(schedule, stage_index, action)
            if other is not None and (other, action) not in done:
                break
            done.add((stage_index, action))
            cursor[stage_index] += 1
            neighbour = stage_index + (1 if action.op is Op.FORWARD else -1)
            if 0 <= neighbour < schedule.num_stages:
                pending.append(neighbour)
    stuck = []
    for stage_index, actions in enumerate(schedule.per_stage):
        if cursor[stage_index] < len(actions):
            action = actions[cursor[stage_index]]
            stuck.append(f"stage {stage_index} waits at step {cursor[stage_index]} ({action}) for {action} "
                         f"on stage {_waits_for(schedule, stage_index, action)}")
    return ["deadlock: " + ", ".join(stuck)] if stuck else []


def format_schedule(schedule: Schedule) -> str:
    """An aligned table: one row per stage, one column per step."""
    width = max((len(a) for a in schedule.per_stage), default=0)
    rows = []
    for stage_index, actions in enumerate(schedule.per_stage):
        cells = [str(a) for a in actions] + [""] * (width - len(actions))
        rows.append([f"stage {stage_index}", *cells])
    header = [schedule.name, *(str(i) for i in range(width))]
    return str(tabulate(rows, headers=header, tablefmt="plain"))
