"""What a run prints, in plain words: help on every flag, "did you mean" for cluster typos, the glossary behind
every table header, notes that read whole, and the plan a script or `fxpipe plan` shows and can reproduce."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe.cli import _build_parser, main
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.cluster_spec import ClusterSpecError
from fxpipe.core.timeline import TimelineEvent
from fxpipe.report import format_plan, print_plan
from fxpipe.sim.chrome_trace import events_to_chrome_trace

GLOSSARY = Path(__file__).resolve().parents[1] / "docs" / "glossary.md"


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every (subcommand path, action) of ``parser`` and its subparsers, help actions left out."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _options(sub, (*path, name))
        elif not isinstance(action, argparse._HelpAction):
            found.append((path, action))
    return found


def test_every_cli_option_and_argument_has_help() -> None:
    options = _options(_build_parser())
    assert len({path for path, _ in options}) >= 6  # plan, simulate, show, train, calibrate, demo
    missing = [(" ".join(path), action.option_strings or action.dest) for path, action in options
               if not (action.help or "").strip()]
    assert missing == []


@pytest.mark.parametrize(("spec", "suggestion"), [
    ("dapple_a", "dapple-a"), ("locl:4", "local:4"), ("dgx-h10:2", "dgx-h100:2"), ("4x8:h10", "h100"),
    ("4x8:h100,intr=10GB/s", "intra"),
])
def test_a_cluster_spec_typo_gets_did_you_mean(spec: str, suggestion: str) -> None:
    with pytest.raises(ClusterSpecError) as caught:
        parse_cluster(spec)
    assert f"did you mean {suggestion!r}?" in str(caught.value).splitlines()[0]


def test_a_cluster_spec_far_from_every_name_gets_no_guess() -> None:
    with pytest.raises(ClusterSpecError) as caught:
        parse_cluster("zzz")
    assert "did you mean" not in str(caught.value)


def test_show_without_plot_on_a_trace_says_it_is_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "measured.json"
    trace.write_text(json.dumps(events_to_chrome_trace([TimelineEvent(0, 0, "F", 0, 0.0, 0.001)], (),
                                                       {"measured": True, "step_time_s": 0.001})))
    assert main(["show", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "is a trace" in err and "--plot" in err and "format_version" not in err, err


def _glossary_terms() -> set[str]:
    """The bold terms of docs/glossary.md (``**fwd ms** / **bwd ms**`` gives both)."""
    return {term.strip() for term in re.findall(r"\*\*([^*]+)\*\*", GLOSSARY.read_text())}


def _headers(table: str) -> list[str]:
    """A tabulate "simple" table's column headers (separated by two or more spaces)."""
    return [cell for cell in re.split(r"\s{2,}", table.splitlines()[0].strip()) if cell]


def test_the_glossary_explains_every_table_header_and_summary_term(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    plan_file = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--cluster", "dapple-b", "--global-batch", "64", "--layout", "2:1",
                 "--schedule", "early_backward", "--compare", "--json", str(plan_file), "--no-run-info"]) == 0
    out = capsys.readouterr().out
    tables = [part for part in out.split("\n\n") if re.search(r"^-+ ", part, re.MULTILINE)]
    headers = {header for table in tables for header in _headers(table)}
    assert {"fwd ms", "act/micro-batch", "memory/device", "vs chosen"} <= headers, headers
    terms = _glossary_terms()
    summary_words = {"planner", "schedule", "warm-up A", "warm-up B", "global batch", "micro-batches", "bubble",
                     "predicted iteration", "samples/s", "not compared with data parallel", "cost source",
                     "planning time", "note", "infeasible", "groups of blocks", "kept for backward", "ring step",
                     "CPU time stretched", "bars end at", "measured step", "iteration_time_s",
                     "throughput_samples_per_s", "bubble_fraction", "peak_memory_bytes", "MFU", "tokens/s/device",
                     "model FLOPs"}
    assert sorted(headers - terms) == [] and sorted(summary_words - terms) == []
    assert "not compared with data parallel" in out and "groups of blocks" not in out  # dapple-b: too many devices
    assert "exhaustive planner: searches at most 12 devices, the cluster has 16" in out
    assert "(docs/glossary.md)" in (GLOSSARY.parents[1] / "README.md").read_text()  # linked from the README


def test_measured_notes_read_whole_and_name_no_flag_a_run_lacks() -> None:
    from fxpipe.job_costs import COLLECTIVE_NOTE, STRETCH_NOTE
    from fxpipe.train_cli import prediction_check

    collective = COLLECTIVE_NOTE.format(ranks=2, latency_ms=0.5, bandwidth_mb=626)
    assert collective.endswith("the planner costed gradient allreduces with these figures"), collective
    assert "wall/CPU" not in STRETCH_NOTE and "x {stretch:.3f}" in STRETCH_NOTE  # benchmarks parse the number
    line = prediction_check(_predicted_plan(), [0.02, 0.01, 0.01], measuring=True)
    assert "--measure" not in line and "recorded their timelines" in line, line


def _predicted_plan() -> Any:
    from fxpipe.core.plan import Plan, Prediction, StagePlan

    return Plan(global_batch_size=4, num_microbatches=1, stages=(StagePlan(0, 0, 2, 1, (0,)),),
                predicted=Prediction(iteration_time_s=0.01, throughput_samples_per_s=400.0, cost_source="measured"))


def test_the_dp_comparison_names_the_devices_it_used() -> None:
    from fxpipe.core.plan import Prediction, StagePlan

    two_stage = _predicted_plan().with_updates(
        num_devices=4, stages=(StagePlan(0, 0, 1, 1, (0,)), StagePlan(1, 1, 2, 1, (1,))),
        predicted=Prediction(iteration_time_s=0.01, throughput_samples_per_s=400.0, dp_iteration_time_s=0.0101))
    text = format_plan(two_stage)
    assert "1.01x the speed of data parallel on all 4 devices" in text and "speedup over DP" not in text, text


def test_print_plan_follows_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _predicted_plan()
    print_plan(plan, True)
    assert capsys.readouterr().out.strip() == format_plan(plan).strip()
    print_plan(plan, False)
    print_plan(plan, None)  # pytest's captured stdout is not a terminal
    assert capsys.readouterr().out == ""


def test_plan_times_blocks_with_one_training_rank_threads(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`fxpipe plan --costs measured` times blocks with the threads of a `fxpipe train` rank (default 1), not
    torch's default of every core, so its cuts are chosen on the times the ranks will see."""
    from fxpipe import passes

    seen: list[int] = []
    original = passes.measure_costs

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(passes, "measure_costs", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["plan", "mlp", "--cluster", "local:2", "--global-batch", "8", "--costs", "measured"]) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert seen == [1], seen
    assert "`fxpipe train --plan LAYOUT` measures again" in out, out  # why another run may cut elsewhere
