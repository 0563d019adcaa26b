"""What a planning request asks of virtual stages: ``virtual_stages`` and the schedule checked, and the schedules to try."""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.core.interleaved_schedules import INTERLEAVED, INTERLEAVED_ZERO_BUBBLE, ZBV
from fxpipe.core.schedule import ScheduleError, schedule_name
from fxpipe.core.sharding import ShardingRequest
from fxpipe.passes.partition.request import AUTO_SCHEDULE, PlanningError

AUTO_VIRTUAL = "auto"
VIRTUAL_SCHEDULES = (INTERLEAVED, INTERLEAVED_ZERO_BUBBLE, ZBV)
# A one-stage-per-group schedule asked together with virtual stages: its counterpart on chunks.
VIRTUAL_COUNTERPART = {"early_backward": (INTERLEAVED,), "zero_bubble": (INTERLEAVED_ZERO_BUBBLE,),
                       AUTO_SCHEDULE: VIRTUAL_SCHEDULES}
# What the plan without virtual stages (the groups the chunks go on) is searched under, per virtual schedule.
PLAIN_COUNTERPART = {INTERLEAVED: "early_backward", INTERLEAVED_ZERO_BUBBLE: "zero_bubble", ZBV: "zero_bubble"}


class VirtualStagesError(PlanningError):
    """A ``virtual_stages`` request that cannot be served (the message names the value and the fix)."""


@dataclass(frozen=True)
class VirtualRequest:
    """Virtual stages asked: ``virtual_stages`` fixed, or None to choose (v = 1 included); the schedules to
    try; and the schedule the groups are first planned under without virtual stages."""

    virtual_stages: int | None
    schedules: tuple[str, ...]
    plain_schedule: str


def _canonical(schedule: str) -> str:
    try:
        return schedule if schedule == AUTO_SCHEDULE else schedule_name(schedule)
    except ScheduleError as error:
        raise PlanningError(str(error)) from None


def virtual_request(virtual_stages: object, schedule: str, *, planner: str, num_stages: int | None,
                    sharding: ShardingRequest) -> VirtualRequest | None:
    """The virtual-stage part of a request, or None when none is asked (``virtual_stages=1`` and a schedule
    with one stage per group: the planner then runs exactly as without this feature)."""
    name = _canonical(schedule)
    chunked = name in VIRTUAL_SCHEDULES
    if virtual_stages == 1 and not chunked:
        return None
    if virtual_stages != AUTO_VIRTUAL and (not isinstance(virtual_stages, int) or isinstance(virtual_stages, bool)
                                           or virtual_stages < 1):
        raise VirtualStagesError(f"virtual_stages={virtual_stages!r} is not 'auto' or a positive integer; give the "
                                 "model chunks per device group (1: none, 2, 4, ...) or 'auto' (the planner chooses)")
    if virtual_stages == 1:
        raise VirtualStagesError(f"schedule {schedule!r} runs several model chunks per device group but "
                                 "virtual_stages=1; pass virtual_stages=2 (or 'auto') or a schedule such as 'dapple'")
    if planner != "dapple":
        raise VirtualStagesError(f"virtual_stages={virtual_stages!r} with planner {planner!r}: only 'dapple' plans "
                                 "virtual stages; use planner='dapple' or virtual_stages=1")
    if num_stages is not None:
        raise VirtualStagesError(f"virtual_stages={virtual_stages!r} with fixed cuts (pipe_split markers): the "
                                 "markers fix one stage per group; drop the markers (plan='auto' or a layout) or "
                                 "use virtual_stages=1")
    if name in ("gpipe",) or (not chunked and name not in VIRTUAL_COUNTERPART):
        raise VirtualStagesError(f"schedule {schedule!r} has no virtual-stage form; with virtual_stages="
                                 f"{virtual_stages!r} choose one of {list(VIRTUAL_SCHEDULES)}, 'dapple' (-> "
                                 "'interleaved'), 'zero_bubble' (-> 'interleaved_zero_bubble') or 'auto'")
    if name == ZBV and virtual_stages not in (2, AUTO_VIRTUAL):
        raise VirtualStagesError(f"schedule 'zbv' runs a V of exactly 2 chunks per device group, not "
                                 f"virtual_stages={virtual_stages}; use virtual_stages=2, or 'interleaved' for "
                                 f"{virtual_stages} chunks per group")
    if not isinstance(sharding, str):  # one level per stage: chunks are not the plain plan's stages
        raise VirtualStagesError(f"sharding={sharding!r} with virtual_stages={virtual_stages!r}: levels per stage do "
                                 "not name chunks; give one level ('optimizer', 'gradients', 'parameters': every "
                                 "chunk of a group with replicas), 'none' or 'auto' (virtual candidates then stay "
                                 "unsharded), or virtual_stages=1")
    schedules = (name,) if chunked else VIRTUAL_COUNTERPART[name]
    plain = name if not chunked else PLAIN_COUNTERPART[name]
    fixed = None if virtual_stages == AUTO_VIRTUAL else int(str(virtual_stages))
    if fixed is not None and fixed != 2:
        schedules = tuple(s for s in schedules if s != ZBV)
    return VirtualRequest(fixed, schedules, plain)


def check_virtual_layout(request: VirtualRequest, layout: tuple[int, ...] | None, text: str | None,
                         num_blocks: int, num_microbatches: int | None) -> None:
    """A forced layout's groups against the virtual request: enough blocks for every chunk, M >= G, two groups."""
    if layout is None:
        if request.virtual_stages is not None and 2 * request.virtual_stages > num_blocks:
            raise VirtualStagesError(f"virtual_stages={request.virtual_stages} needs at least "
                                     f"{2 * request.virtual_stages} cuttable blocks (two device groups of "
                                     f"{request.virtual_stages} chunks, each chunk at least one block) but the model has "
                                     f"{num_blocks}; use virtual_stages <= {max(1, num_blocks // 2)}")
        return
    groups = len(layout)
    fixed = request.virtual_stages
    if fixed is not None and groups * fixed > num_blocks:
        raise VirtualStagesError(f"layout {text!r} with virtual_stages={fixed} makes {groups * fixed} chunks but "
                                 f"the model has {num_blocks} cuttable blocks (each chunk needs one); use "
                                 f"virtual_stages <= {max(1, num_blocks // groups)} or fewer groups")
    if num_microbatches is not None and num_microbatches < groups:
        raise VirtualStagesError(f"num_microbatches={num_microbatches} is fewer than the {groups} device groups of "
                                 f"layout {text!r}; interleaved schedules need M >= G (use num_microbatches >= "
                                 f"{groups})")
    if groups == 1:
        raise VirtualStagesError(f"layout {text!r} has one device group: chunks on one group form no pipeline; "
                                 "use a layout of two or more groups (e.g. '1:1') or virtual_stages=1")

