"""Timeline pictures: the bars as exact data, the Chrome-trace round trip, the PNG and the CLI options."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from planner_cases import chain, cluster

from fxpipe.cli import main
from fxpipe.core.planfile import save_plan_file
from fxpipe.core.timeline import TimelineEvent, TransferEvent
from fxpipe.passes.partition.dapple import partition
from fxpipe.sim.chrome_trace import events_to_chrome_trace, to_chrome_trace
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import step_end_sync_time
from fxpipe.sim.timeline_plot import (
    Bar,
    MissingPlotExtraError,
    render_timelines,
    timeline_bars,
    timeline_from_chrome_trace,
    trace_title,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_bars_are_rows_per_device_in_stage_order_and_skip_instant_sends() -> None:
    events = [
        TimelineEvent(device=3, stage_index=1, op="RA", microbatch_index=0, start_s=0.0, end_s=1.0),
        TimelineEvent(3, 1, "F", 0, 1.0, 2.0),
        TimelineEvent(0, 0, "F", 0, 0.0, 1.0),
        TimelineEvent(0, 0, "SA", 0, 1.0, 1.0),  # issued at once: no bar
        TimelineEvent(1, 0, "F", 0, 0.0, 1.0),
        TimelineEvent(0, 0, "W", 0, 3.0, 3.5),
        TimelineEvent(0, 0, "AR", -1, 4.0, 5.0),
    ]
    transfers = [TransferEvent(0, 3, "SA", 0, 1.0, 1.25)]
    timeline = timeline_bars(events, transfers, "t")
    assert timeline.rows == ("s0 d0", "s0 d1", "s1 d3")
    assert timeline.bars == (
        Bar(0, "forward", 0.0, 1.0, "F0"),
        Bar(0, "transfer", 1.0, 1.25, "SA0"),
        Bar(0, "weight", 3.0, 3.5, "W0"),
        Bar(0, "allreduce", 4.0, 5.0, "AR"),
        Bar(1, "forward", 0.0, 1.0, "F0"),
        Bar(2, "wait", 0.0, 1.0, "RA0"),
        Bar(2, "forward", 1.0, 2.0, "F0"),
    )
    assert timeline.end_s == 5.0
    with pytest.raises(ValueError, match="no events"):
        timeline_bars([])


def _hybrid():  # type: ignore[no-untyped-def]
    """A 2-stage 2:1 plan on 3 devices over two hosts (transfers cost time) and its simulation."""
    costs = chain([1.0, 2.0, 1.0, 1.0], [10**6] * 4)
    devices = cluster(3, 1)
    plan = partition(costs, devices, 8, layout="2:1", num_microbatches=4)
    return plan, costs, devices, simulate(plan, costs, devices)


def test_simulated_timeline_has_a_row_per_device_and_survives_the_chrome_trace() -> None:
    plan, _, devices, result = _hybrid()
    timeline = timeline_bars(result.events, result.transfers)
    assert len(timeline.rows) == plan.world_size == 3
    num_bars = sum(e.end_s > e.start_s for e in result.events) + sum(t.end_s > t.start_s for t in result.transfers)
    assert len(timeline.bars) == num_bars
    assert sum(bar.kind == "forward" for bar in timeline.bars) == plan.num_microbatches * 3
    assert sum(bar.kind == "transfer" for bar in timeline.bars) > 0
    # the bars end with the last allreduce; the step's closing loss allreduce has no bar
    assert timeline.end_s == pytest.approx(result.iteration_time_s - step_end_sync_time(devices, range(3)))
    back = timeline_from_chrome_trace(to_chrome_trace(result))
    assert back.rows == timeline.rows
    assert [(b.row, b.kind, b.label) for b in back.bars] == [(b.row, b.kind, b.label) for b in timeline.bars]
    for ours, theirs in zip(back.bars, timeline.bars, strict=True):
        assert ours.start_s == pytest.approx(theirs.start_s, abs=1e-12)
        assert ours.end_s == pytest.approx(theirs.end_s, abs=1e-12)
    with pytest.raises(ValueError, match="not a Chrome trace"):
        timeline_from_chrome_trace({"stages": []})
    measured = {"traceEvents": [], "otherData": {"measured": True, "step_time_s": 0.0125}}  # as train_cli writes
    assert trace_title(measured, "m.json") == "m.json: measured step 12.5 ms"
    # a tiny model's step ends well after its last action (gradient sums, the loss): the title says both
    short = events_to_chrome_trace([TimelineEvent(0, 0, "F", 0, 0.0, 0.009)], (), measured["otherData"])
    assert trace_title(short, "m.json") == "m.json: bars end at 9.0 ms; measured step 12.5 ms with its closing waits"
    assert trace_title(to_chrome_trace(result), "s.json") == (
        f"s.json: simulated iteration {1e3 * result.iteration_time_s:.1f} ms")


def test_png_has_one_panel_per_timeline_and_a_row_per_device(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plan, costs, devices, result = _hybrid()
    simulated = timeline_bars(result.events, result.transfers, "simulated")
    figure = render_timelines([simulated, simulated._replace(title="again")])
    assert [len(axis.get_yticklabels()) for axis in figure.axes] == [3, 3]
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == ["s0 d0", "s0 d1", "s1 d2"]
    plan_file, trace_file, png = tmp_path / "plan.json", tmp_path / "trace.json", tmp_path / "t.png"
    save_plan_file(plan_file, plan, costs, devices)
    assert main(["simulate", str(plan_file), "--trace", str(trace_file), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    side_by_side = tmp_path / "both.png"
    assert main(["simulate", str(plan_file), "--plot", str(side_by_side), "--compare-trace", str(trace_file)]) == 0
    assert side_by_side.read_bytes()[:8] == PNG_SIGNATURE
    from PIL import Image

    with Image.open(png) as one, Image.open(side_by_side) as two:
        assert two.height > one.height  # the second panel
    shown = tmp_path / "shown.png"
    assert main(["show", str(trace_file), "--plot", str(shown)]) == 0
    assert shown.read_bytes()[:8] == PNG_SIGNATURE
    assert main(["show", str(plan_file), "--plot", str(tmp_path / "no.png")]) == 2  # a plan is not a trace
    assert main(["simulate", str(plan_file), "--compare-trace", str(trace_file)]) == 2  # needs --plot
    assert json.loads(trace_file.read_text())["traceEvents"]  # the Chrome trace stays


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _, _, _, result = _hybrid()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(MissingPlotExtraError, match=r"fxpipe\[plot\]"):
        render_timelines([timeline_bars(result.events, result.transfers)])
