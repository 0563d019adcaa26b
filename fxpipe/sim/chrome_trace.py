"""Chrome / Perfetto trace-event JSON of a simulated iteration (open in ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fxpipe.core.timeline import TimelineEvent, TransferEvent
    from fxpipe.sim.simulate import SimulationResult

_MICROSECONDS = 1e6


def to_chrome_trace(result: SimulationResult, *, include_transfers: bool = True) -> dict[str, Any]:
    """Trace-event JSON: one process per stage, one thread per device, one "X" event per executed action.

    Sends are asynchronous, so their action events last 0 us at the issue time; with
    ``include_transfers`` every transfer piece also appears, under an extra process "transfers"
    with one thread per sending device (its send port runs one piece at a time, so they never overlap).
    """
    if not result.events:
        raise ValueError("the result has no timeline events; simulate with timeline=True to trace it")
    return events_to_chrome_trace(
        result.events, result.transfers if include_transfers else (),
        {"schedule": result.schedule_name, "iteration_time_s": result.iteration_time_s})


def events_to_chrome_trace(events: Sequence[TimelineEvent], transfers: Sequence[TransferEvent] = (),
                           other_data: dict[str, Any] | None = None) -> dict[str, Any]:
    """Trace-event JSON of timeline events, simulated or measured by the runtime (so the two overlay)."""
    trace: list[dict[str, Any]] = []
    stages = sorted({event.stage_index for event in events})
    device_stage = {event.device: event.stage_index for event in events}
    for stage_index in stages:
        trace.append(_meta("process_name", stage_index, 0, f"stage {stage_index}"))
        trace.append(_meta("process_sort_index", stage_index, 0, stage_index))
    for device, stage_index in sorted(device_stage.items()):
        trace.append(_meta("thread_name", stage_index, device, f"device {device}"))
    for event in events:
        label = event.op if event.microbatch_index < 0 else f"{event.op}{event.microbatch_index}"
        trace.append(_complete(label, event.op, event.stage_index, event.device, event.start_s, event.end_s,
                               {"microbatch": event.microbatch_index}))
    if transfers:
        transfers_pid = max(stages, default=-1) + 1
        trace.append(_meta("process_name", transfers_pid, 0, "transfers"))
        trace.append(_meta("process_sort_index", transfers_pid, 0, transfers_pid))
        for device in sorted({t.src_device for t in transfers}):
            trace.append(_meta("thread_name", transfers_pid, device, f"device {device} sends"))
        for t in transfers:
            trace.append(_complete(f"{t.op}{t.microbatch_index} {t.src_device}->{t.dst_device}", "transfer",
                                   transfers_pid, t.src_device, t.start_s, t.end_s,
                                   {"microbatch": t.microbatch_index, "dst_device": t.dst_device}))
    return {"traceEvents": trace, "displayTimeUnit": "ms", "otherData": dict(other_data or {})}


def write_chrome_trace(result: SimulationResult, path: str | Path, *, include_transfers: bool = True) -> None:
    """Write :func:`to_chrome_trace` to ``path`` (deterministic JSON)."""
    text = json.dumps(to_chrome_trace(result, include_transfers=include_transfers), sort_keys=True)
    Path(path).write_text(text + "\n")


def _meta(name: str, pid: int, tid: int, value: str | int) -> dict[str, Any]:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": {key: value}}


def _complete(name: str, category: str, pid: int, tid: int, start_s: float, end_s: float,
              args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": category, "pid": pid, "tid": tid,
            "ts": start_s * _MICROSECONDS, "dur": (end_s - start_s) * _MICROSECONDS, "args": args}
