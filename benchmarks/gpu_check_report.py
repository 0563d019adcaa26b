"""The tables of benchmarks/gpu_check.md from one unpacked device session (benchmarks/device_session.sh).

Run: python benchmarks/gpu_check_report.py DIR   (DIR: where session.tar.gz was unpacked; Markdown on stdout)

Reads what the session's steps wrote, never re-measures: ``gpu.txt`` (the machine and each step's exit),
``suite.txt`` (pytest -v lines), ``overhead-*.txt`` / ``compiled-*.txt`` (benchmarks/overhead.py reports),
``gemm_efficiency.json`` (benchmarks/gemm_efficiency.py) and ``prediction-*.txt``
(benchmarks/prediction_fidelity.py --device cuda). A step that did not finish is reported as such.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from tabulate import tabulate

OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
RATIO = re.compile(r"fxpipe / eager step time = \*\*([0-9.]+)\*\*")
STEP_ROW = re.compile(r"^\|\s*([^|]+?)\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|$")
SUMMARY_LINE = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")


def suite_section(text: str) -> list[str]:
    outcomes: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("[gw") or "::" in line.split(" ")[0]:
            match = OUTCOME.search(line)
            if match:
                outcomes[match.group(1)] += 1
    failures = [m.groups() for m in map(SUMMARY_LINE.match, text.splitlines()) if m]
    last = text.strip().splitlines()[-2:] if text.strip() else ["(no output)"]
    lines = [", ".join(f"{count} {name.lower()}" for name, count in sorted(outcomes.items())) or "no test reported",
             "", "Last lines: " + " / ".join(f"`{line.strip()}`" for line in last), ""]
    if failures:
        lines += [tabulate([[kind, f"`{test}`", (message or "")[:160]] for kind, test, message in failures],
                           ["", "test", "first line"], tablefmt="github"), ""]
    return lines


def overhead_rows(folder: Path) -> list[list[Any]]:
    rows = []
    for path in sorted(folder.glob("overhead-*.txt")) + sorted(folder.glob("compiled-*.txt")):
        text = path.read_text()
        kind, _, rest = path.stem.partition("-")
        model, _, autocast = rest.rpartition("-")
        ratio = RATIO.search(text)
        steps = {m.group(1): (float(m.group(2)), float(m.group(4))) for m in map(STEP_ROW.match, text.splitlines()) if m}
        fx = next((v for k, v in steps.items() if k.startswith("fxpipe")), None)
        eager = next((v for k, v in steps.items() if not k.startswith("fxpipe")), None)
        rows.append([model, "fp32" if autocast == "none" else autocast, "compiled" if kind == "compiled" else "eager",
                     f"{fx[0]:.2f}" if fx else "-", f"{eager[0]:.2f}" if eager else "-",
                     f"**{float(ratio.group(1)):.3f}**" if ratio else "did not finish: " + _last_error(text),
                     f"{fx[1]:.1f} / {eager[1]:.1f}" if fx and eager and kind == "compiled" else ""])
    return rows


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    return f"`{(errors or lines or ['(no output)'])[-1][:160]}`"


def gemm_section(report: dict[str, Any]) -> list[str]:
    by_shape: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
    for row in report["rows"]:
        by_shape[(row["dtype"], row["hidden"], row["tokens"], row["tp"])].append(row["tflops"])
    peak = {entry["dtype"]: entry["peak_tflops"] for entry in report["summary"]}
    shape_rows = [[dtype, hidden, tokens, tp, f"{statistics.median(v):.1f}", f"{min(v):.1f}-{max(v):.1f}",
                   f"{statistics.median(v) / peak[dtype]:.1%}"] for (dtype, hidden, tokens, tp), v in by_shape.items()]
    summary_rows = [[e["dtype"], e["rows"], e["count"], f"{e['median_tflops']:.1f}",
                     f"{e['min_tflops']:.1f}-{e['max_tflops']:.1f}", f"{e['peak_tflops']:.1f}",
                     f"{e['median_fraction_of_peak']:.1%}",
                     "-" if e["preset_matmul_tflops"] is None else f"{e['preset_matmul_tflops']:.1f}"]
                    for e in report["summary"]]
    return [tabulate(shape_rows, ["dtype", "hidden", "tokens", "tp", "median TFLOP/s (12 GEMMs)", "range",
                                  "median / peak"], tablefmt="github"), "",
            tabulate(summary_rows, ["dtype", "rows", "GEMMs", "median TFLOP/s", "range", "datasheet peak",
                                    "median / peak", "preset before"], tablefmt="github"), ""]


def prediction_rows(folder: Path) -> list[str]:
    lines = []
    for path in sorted(folder.glob("prediction-*.txt")):
        text = path.read_text()
        table = [line for line in text.splitlines() if line.startswith("|")]
        lines += [f"{path.stem.partition('-')[2]}:", ""] + (table or [f"did not finish: {_last_error(text)}"]) + [""]
    return lines


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python benchmarks/gpu_check_report.py DIR (an unpacked session.tar.gz)")
    folder = Path(argv[0])
    out = ["## Machine and steps", "", "```", (folder / "gpu.txt").read_text().strip(), "```", ""]
    suite = folder / "suite.txt"
    out += ["## Suite with CUDA visible", ""] + (suite_section(suite.read_text()) if suite.exists() else ["not run", ""])
    out += ["## Overhead: a 1-stage fxpipe step against eager", "",
            tabulate(overhead_rows(folder), ["model", "precision", "stages", "fxpipe ms", "eager ms",
                                             "fxpipe / eager", "first step s (fxpipe / torch.compile)"],
                     tablefmt="github"), ""]
    gemm = folder / "gemm_efficiency.json"
    out += ["## GEMM efficiency", ""] + (gemm_section(json.loads(gemm.read_text())) if gemm.exists() else ["not run", ""])
    out += ["## Prediction fidelity, local:1", ""] + prediction_rows(folder)
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
