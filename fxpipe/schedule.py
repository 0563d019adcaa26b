"""Pipeline schedules as data: per-stage action lists (GPipe, early-backward), lowering, validation, tables."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from tabulate import tabulate


class Op(str, Enum):
    """What one action does. FORWARD/BACKWARD compute; the others move data or gradients."""

    FORWARD = "F"
    BACKWARD = "B"
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

    ``per_stage[s]`` holds only FORWARD and BACKWARD actions; :func:`lower` adds the transfers
    and the gradient allreduce that the simulator and the runtime both execute.
    """

    name: str
    num_stages: int
    num_microbatches: int
    per_stage: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        return format_schedule(self)


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


def make_schedule(name: str, num_stages: int, num_microbatches: int, warmup_policy: str = "A") -> Schedule:
    """Build a schedule by plan name (``"early_backward"`` or ``"gpipe"``)."""
    if name == "gpipe":
        return gpipe(num_stages, num_microbatches)
    if name in ("early_backward", "dapple", "1f1b"):
        return early_backward(num_stages, num_microbatches, warmup_policy)
    raise ScheduleError(f"schedule {name!r} is unknown; choose 'early_backward' (alias 'dapple') or 'gpipe'")


def lower(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Add transfers and the allreduce: per stage, the full list of actions a replica executes.

    A forward is preceded by receiving its activations (except on stage 0) and followed by
    sending them (except on the last stage); a backward mirrors this with gradients. The
    allreduce follows the stage's last backward.
    """
    last = schedule.num_stages - 1
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
            else:
                raise ScheduleError(f"stage {stage_index}: unlowered schedules hold only F and B, got {action}")
        out.append(Action(Op.ALLREDUCE))
        lowered.append(tuple(out))
    return tuple(lowered)


def format_schedule(schedule: Schedule) -> str:
    """An aligned table: one row per stage, one column per step."""
    width = max((len(a) for a in schedule.per_stage), default=0)
    rows = []
    for stage_index, actions in enumerate(schedule.per_stage):
        cells = [str(a) for a in actions] + [""] * (width - len(actions))
        rows.append([f"stage {stage_index}", *cells])
    header = [schedule.name, *(str(i) for i in range(width))]
    return str(tabulate(rows, headers=header, tablefmt="plain"))
