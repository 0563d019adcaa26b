"""The data of a schedule: ops, actions (with the chunk they run under virtual stages), schedules, their table."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from tabulate import tabulate

FORWARD_ONLY = "forward_only"


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
    # the model chunk (plan stage) the action runs under virtual stages, where a device runs several; -1
    # otherwise (the device's one stage). Printed first, as torch.distributed.pipelining does: "2F0".
    chunk_index: int = -1

    def __str__(self) -> str:
        text = self.op.value if self.microbatch_index < 0 else f"{self.op.value}{self.microbatch_index}"
        return text if self.chunk_index < 0 else f"{self.chunk_index}{text}"


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
    # virtual stages: the device group of every model chunk (chunk c runs on group chunk_groups[c]); then
    # ``per_stage[g]`` is group g's list, its actions naming their chunk, and ``num_stages`` counts groups.
    # Empty: one stage per group (chunk = stage = group).
    chunk_groups: tuple[int, ...] = ()

    def __str__(self) -> str:
        return format_schedule(self)

    @property
    def virtual(self) -> bool:
        """Whether devices run several model chunks (virtual stages)."""
        return bool(self.chunk_groups)

    @property
    def num_chunks(self) -> int:
        """Model chunks (plan stages): ``num_stages`` without virtual stages."""
        return len(self.chunk_groups) if self.chunk_groups else self.num_stages

    @cached_property  # read once per stage by inflight_peak: a scan of every action each time was quadratic
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


def format_schedule(schedule: Schedule) -> str:
    """An aligned table: one row per stage (per device group under virtual stages), one column per step."""
    width = max((len(a) for a in schedule.per_stage), default=0)
    rows = []
    for stage_index, actions in enumerate(schedule.per_stage):
        cells = [str(a) for a in actions] + [""] * (width - len(actions))
        rows.append([f"{'group' if schedule.virtual else 'stage'} {stage_index}", *cells])
    header = [schedule.name, *(str(i) for i in range(width))]
    return str(tabulate(rows, headers=header, tablefmt="plain"))
