"""Pictures of time: simulated or measured timelines as bars per device (matplotlib, the ``plot`` extra).

:func:`timeline_bars` is the pure part (events -> rows and bars, exact and tested on data);
:func:`render_timelines` draws one or more of them stacked on a shared time axis, so a simulated
iteration and a measured step of the same plan line up. Timelines come from
:func:`fxpipe.simulate.simulate` or from a Chrome trace (``fxpipe simulate --trace``,
``fxpipe train --measure --trace``) read back by :func:`timeline_from_chrome_trace`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from fxpipe.core.timeline import TimelineEvent, TransferEvent

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Bar kind of every action op. A receive lasts from when the device reaches it until the data is
# there: that wait is a bubble, drawn pale so idle time stands out; sends cost the sender's own time.
KIND_OF_OP = {"F": "forward", "B": "backward", "W": "weight", "AR": "allreduce",
              "SA": "send", "SG": "send", "RA": "wait", "RG": "wait"}
COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "weight": "#55A868", "allreduce": "#C44E52",
           "send": "#8C8C8C", "wait": "#E6E6E6", "transfer": "#8172B3", "other": "#CCB974"}
LEGEND = {"forward": "F (forward)", "backward": "B (backward)", "weight": "W (weight gradient)",
          "allreduce": "gradient allreduce", "send": "send (own time)", "wait": "waiting on a receive (bubble)",
          "transfer": "transfer on the link (sender's row)", "other": "other"}


class MissingPlotExtraError(ValueError):
    """matplotlib is not installed; the message says how to install the ``plot`` extra."""


class Bar(NamedTuple):
    """One bar: ``row`` indexes :attr:`Timeline.rows`; transfers are drawn as a thin band on the sender's row."""

    row: int
    kind: str  # a key of COLOURS
    start_s: float
    end_s: float
    label: str  # e.g. "F3", "AR"


class Timeline(NamedTuple):
    """Rows (one per device, in stage then device order) and their bars, ready to draw."""

    title: str
    rows: tuple[str, ...]  # "s0 d0", "s0 d1", "s1 d2", ...
    bars: tuple[Bar, ...]
    end_s: float


def timeline_bars(events: Sequence[TimelineEvent], transfers: Sequence[TransferEvent] = (),
                  title: str = "") -> Timeline:
    """One row per device that ran an action (ordered by stage, then device) and a bar per action and
    per transfer piece; zero-length actions (sends issued at once) are left out; the gaps are the bubbles."""
    if not events:
        raise ValueError("the timeline has no events to draw; simulate with timeline=True or measure with "
                         "`fxpipe train --measure --trace FILE`")
    stage_of_device: dict[int, int] = {}
    for event in events:
        stage_of_device.setdefault(event.device, event.stage_index)
    devices = sorted(stage_of_device, key=lambda device: (stage_of_device[device], device))
    row_of = {device: row for row, device in enumerate(devices)}
    bars = [Bar(row_of[e.device], KIND_OF_OP.get(e.op, "other"), e.start_s, e.end_s,
                e.op if e.microbatch_index < 0 else f"{e.op}{e.microbatch_index}")
            for e in events if e.end_s > e.start_s]
    bars += [Bar(row_of[t.src_device], "transfer", t.start_s, t.end_s, f"{t.op}{t.microbatch_index}")
             for t in transfers if t.end_s > t.start_s and t.src_device in row_of]
    bars.sort(key=lambda bar: (bar.row, bar.start_s, bar.end_s, bar.kind))
    end_s = max([e.end_s for e in events] + [t.end_s for t in transfers])
    rows = tuple(f"s{stage_of_device[device]} d{device}" for device in devices)
    return Timeline(title, rows, tuple(bars), end_s)


def timeline_from_chrome_trace(trace: Mapping[str, Any], title: str = "") -> Timeline:
    """A timeline from trace-event JSON written by :func:`fxpipe.simulate_trace.events_to_chrome_trace`."""
    if not isinstance(trace, Mapping) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected a JSON object with a 'traceEvents' list (written by "
                         "`fxpipe simulate --trace` or `fxpipe train --measure --trace`); to draw a plan file's "
                         "simulated timeline use `fxpipe simulate PLAN.json --plot OUT.png`")
    events: list[TimelineEvent] = []
    transfers: list[TransferEvent] = []
    for item in trace["traceEvents"]:
        if not isinstance(item, Mapping) or item.get("ph") != "X":
            continue
        try:
            start_s, end_s = float(item["ts"]) / 1e6, (float(item["ts"]) + float(item["dur"])) / 1e6
            args = item.get("args") or {}
            microbatch = int(args.get("microbatch", -1))
            if item.get("cat") == "transfer":
                transfers.append(TransferEvent(int(item["tid"]), int(args["dst_device"]),
                                               str(item["name"])[:2], microbatch, start_s, end_s))
            else:
                events.append(TimelineEvent(int(item["tid"]), int(item["pid"]), str(item["cat"]), microbatch,
                                            start_s, end_s))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"trace event {dict(item)!r:.120} is not one fxpipe writes ({error!r}); "
                             "write the trace with `fxpipe simulate --trace` or `fxpipe train --trace`") from None
    return timeline_bars(events, transfers, title)


def trace_title(trace: Mapping[str, Any], fallback: str) -> str:
    """A title from a trace's ``otherData``: measured step time or simulated iteration time."""
    data = trace.get("otherData") or {}
    if data.get("measured") and "step_time_s" in data:
        step_ms, drawn_ms = 1e3 * float(data["step_time_s"]), _last_bar_end_ms(trace)
        if not drawn_ms or step_ms <= drawn_ms * 1.05:
            return f"{fallback}: measured step {step_ms:.1f} ms"
        # the step also waits for gradient sums and the loss after its last action, which has no bar
        return f"{fallback}: bars end at {drawn_ms:.1f} ms; measured step {step_ms:.1f} ms with its closing waits"
    if "iteration_time_s" in data:
        return f"{fallback}: simulated iteration {1e3 * float(data['iteration_time_s']):.1f} ms"
    return fallback


def _last_bar_end_ms(trace: Mapping[str, Any]) -> float:
    """Where the trace's last bar ends, in ms (0 without bars)."""
    ends = [(float(item["ts"]) + float(item["dur"])) / 1e3 for item in trace.get("traceEvents") or ()
            if isinstance(item, Mapping) and item.get("ph") == "X" and "ts" in item and "dur" in item]
    return max(ends, default=0.0)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingPlotExtraError("plotting needs matplotlib, which is not installed; install the plot extra: "
                                    "pip install 'fxpipe[plot]' (or pip install matplotlib)") from None
    return plt


def render_timelines(timelines: Sequence[Timeline]) -> Figure:
    """A figure with one panel per timeline, stacked, sharing the time axis (ms); bars coloured by kind."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    heights = [max(1.0, 0.35 * len(t.rows) + 0.9) for t in timelines]
    figure, axes = plt.subplots(len(timelines), 1, sharex=True, squeeze=False,
                                figsize=(12, sum(heights) + 0.8), gridspec_kw={"height_ratios": heights})
    used: set[str] = set()
    for axis, timeline in zip(axes[:, 0], timelines, strict=True):
        for bar in timeline.bars:
            thin = bar.kind == "transfer"
            bottom, height = (bar.row + 0.22, 0.16) if thin else (bar.row - 0.4, 0.6 if bar.kind != "allreduce" else 0.8)
            axis.broken_barh([(1e3 * bar.start_s, 1e3 * (bar.end_s - bar.start_s))], (bottom, height),
                             facecolors=COLOURS[bar.kind], edgecolors="white", linewidth=0.3)
            used.add(bar.kind)
        axis.set_yticks(range(len(timeline.rows)), labels=list(timeline.rows))
        axis.set_ylim(len(timeline.rows) - 0.5, -0.6)
        axis.set_title(timeline.title, fontsize=10, loc="left")
        axis.grid(axis="x", linewidth=0.3)
    axes[-1, 0].set_xlim(0.0, 1e3 * max(t.end_s for t in timelines) * 1.01)
    axes[-1, 0].set_xlabel("time (ms); gaps are bubbles")
    handles = [Patch(color=COLOURS[kind], label=LEGEND[kind]) for kind in COLOURS if kind in used]
    figure.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    return figure


def save_timelines(timelines: Sequence[Timeline], path: str | Path) -> None:
    """Draw :func:`render_timelines` into an image file (PNG by the suffix) and close the figure."""
    figure = render_timelines(timelines)
    try:
        figure.savefig(str(path), dpi=110)
    finally:
        _pyplot().close(figure)
