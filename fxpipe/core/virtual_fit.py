"""Which schedules run a plan's virtual stages: the chunk layout each needs and the micro-batches it takes."""

from __future__ import annotations

from fxpipe.core.schedule import TRAINING_SCHEDULES, ScheduleError, make_schedule
from fxpipe.core.virtual import chunk_layout_of


def schedule_fit_problems(schedule: str, chunk_groups: tuple[int, ...], virtual_stages: int, num_chunks: int,
                          num_microbatches: int) -> list[str]:
    """What keeps training schedule ``schedule`` from running ``num_chunks`` chunks (stages) laid out by
    ``chunk_groups`` (a valid map, or () with ``virtual_stages`` 1) with ``num_microbatches`` micro-batches."""
    kind = TRAINING_SCHEDULES[schedule]
    if virtual_stages == 1:
        plain = sorted(name for name, k in TRAINING_SCHEDULES.items() if not k.chunk_layout)
        return [f"schedule {schedule!r} runs several model chunks per device group but the plan has "
                f"virtual_stages=1; set virtual_stages and chunk_groups (docs/virtual_stages.md) or choose one of "
                f"{plain}"] if kind.chunk_layout else []
    layout = chunk_layout_of(chunk_groups, virtual_stages)
    fitting = sorted(name for name, k in TRAINING_SCHEDULES.items() if k.chunk_layout == layout)
    if not kind.chunk_layout:
        return [f"schedule {schedule!r} runs one stage per device group but the plan has virtual_stages="
                f"{virtual_stages}; choose one of {fitting}"]
    try:
        built = make_schedule(schedule, num_chunks, num_microbatches, "A", virtual_stages)
    except ScheduleError as error:
        return [str(error)]
    if built.chunk_groups != chunk_groups:
        return [f"schedule {schedule!r} runs chunks laid out as a {kind.chunk_layout} {list(built.chunk_groups)}, "
                f"not chunk_groups={list(chunk_groups)}; choose one of {fitting}"]
    return []
