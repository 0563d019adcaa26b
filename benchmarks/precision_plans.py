"""fp32 against bf16 (fp16 where a device has no bf16) plans of paper-scale models on the GPU presets.

Run: python benchmarks/precision_plans.py --write   (writes benchmarks/precision_plans.md; about 10 minutes)

Each model is built on the meta device, costed once per precision with the analytic device model
(``fxpipe.planning.costed_model(precision=...)``: autocast's dtypes per op, tensor-core rates for
matmuls, fp32 master weights, gradients and Adam state) and planned by DAPPLE for each preset. "datasheet
bound" is the iteration's matmul FLOPs (forward + backward, every micro-batch) over the cluster's peak
tensor-core (or fp32) rate: no plan can beat it; "of bound" is how close the prediction comes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from fxpipe import models
from fxpipe.core.cluster import Cluster, parse_cluster
from fxpipe.core.plan import Plan
from fxpipe.hf_examples import llama3_8b
from fxpipe.planning import costed_model, labelled, plan_chain

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/precision_plans.py --write"
PRESETS = ("2x8:h100", "dapple-a")


@dataclass(frozen=True)
class Case:
    """One model at one global batch: its name in the table and how to build it on the meta device."""

    name: str
    build: Callable[[], tuple[Any, Any]]
    global_batch_size: int


def zoo(name: str, **overrides: Any) -> Callable[[], tuple[Any, Any]]:
    return lambda: models.build(name, device="meta", **overrides)


CASES = (
    Case("gpt3-xl (seq 2048)", zoo("gpt3-xl"), 512),
    Case("bert-large (seq 512)", zoo("bert-large"), 256),
    Case("llama-3-8b shape (HF, seq 4096)", llama3_8b, 256),
)


@dataclass(frozen=True)
class Row:
    """One model on one preset in one precision: the plan, or why there is none."""

    case: str
    cluster: str
    precision: str
    plan: Plan | None
    flops: float  # FLOPs of one iteration (forward + backward over the global batch)
    note: str = ""


def low_precision(cluster: Cluster) -> str:
    """bf16 where the device has a bfloat16 rate, else fp16 (a V100)."""
    return "bf16" if "bfloat16" in dict(cluster.device.peak_flops) else "fp16"


def plan_rows(case: Case, presets: Sequence[str], progress: Callable[[str], None] = lambda _: None) -> list[Row]:
    """Cost ``case`` once per precision its presets need and plan it on each preset."""
    clusters = [parse_cluster(spec) for spec in presets]
    rows = []
    for precision in ["fp32", *sorted({low_precision(cluster) for cluster in clusters})]:
        model, example_inputs = case.build()
        graph_module = None
        for spec, cluster in zip(presets, clusters, strict=True):
            if precision != "fp32" and precision != low_precision(cluster):
                continue
            start = time.perf_counter()
            costed = costed_model(model, example_inputs, cluster, costs="analytic", precision=precision,
                                  graph_module=graph_module)
            graph_module = costed.graph_module
            flops = case.global_batch_size * sum(node.forward_flops.per_sample + node.backward_flops.per_sample
                                                 for node in costed.cost_graph.nodes)
            try:
                plan = labelled(plan_chain(costed.chain, cluster, case.global_batch_size, precision=precision),
                                "analytic")
                rows.append(Row(case.name, spec, precision, plan, flops))
            except ValueError as error:  # no plan fits the devices' memory
                rows.append(Row(case.name, spec, precision, None, flops, note=str(error).splitlines()[0][:80]))
            progress(f"{case.name} {spec} {precision}: {time.perf_counter() - start:.0f} s")
    return rows


def _bound_s(row: Row, cluster: Cluster) -> float:
    """Iteration FLOPs over the whole cluster's peak rate for the precision's matmuls."""
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[row.precision]
    return row.flops / (cluster.num_devices * cluster.device.flops_per_s(dtype))


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f}"


def table(rows: Sequence[Row]) -> str:
    """One line per model and preset: fp32 against the low precision, side by side."""
    lines = []
    for fp32 in (row for row in rows if row.precision == "fp32"):
        low = next(row for row in rows if row.case == fp32.case and row.cluster == fp32.cluster
                   and row.precision != "fp32")
        cluster = parse_cluster(fp32.cluster)
        cells: list[Any] = [fp32.case, fp32.cluster, low.precision]
        for row in (fp32, low):
            if row.plan is None or row.plan.predicted is None:
                cells += ["infeasible", "-", "-", "-"]
                continue
            time_s = row.plan.predicted.iteration_time_s
            cells += [f"{time_s:.2f}", f"{_bound_s(row, cluster) / time_s:.0%}",
                      f"{row.plan.layout} M={row.plan.num_microbatches}",
                      " / ".join(_gib(stage.peak_memory_bytes) for stage in row.plan.stages)]
        ratio = (fp32.plan.predicted.iteration_time_s / low.plan.predicted.iteration_time_s
                 if fp32.plan and low.plan and fp32.plan.predicted and low.plan.predicted else float("nan"))
        cells.insert(3, f"{ratio:.1f}x" if ratio == ratio else "-")  # NaN: a side has no plan
        lines.append(cells)
    headers = ["model", "cluster", "low", "fp32/low", "fp32 s", "fp32 of bound", "fp32 layout",
               "fp32 peak GiB per stage", "low s", "low of bound", "low layout", "low peak GiB per stage"]
    return str(tabulate(lines, headers=headers, tablefmt="github", disable_numparse=True))


def report(rows: Sequence[Row], seconds: float) -> str:
    return "\n".join([
        "# fp32 against bf16 plans of paper-scale models", "",
        f"Command: `{COMMAND}` ({seconds:.0f} s on this machine). {__doc__.splitlines()[0]}", "",
        "Each model is built on the meta device and costed with the analytic device model under the autocast "
        "the precision trains in: matmuls, convolutions and attention at the device's tensor-core rate "
        "(H100: 989.5 TFLOP/s bf16 dense; V100: 125 TFLOP/s fp16, no bf16), everything else at the fp32 rate, "
        "activations and messages in the dtypes autocast gives them (CUDA's op lists: softmax, layer norm and "
        "sums stay fp32), weights, gradients and Adam state in fp32 (16 bytes per parameter, as under autocast). "
        "'of bound' is the iteration's FLOPs over the whole cluster's peak rate for the precision divided by the "
        "predicted time (a model-FLOP utilisation). Peak memory is per stage, the largest replica, of the plan "
        "chosen (recompute=auto: activations are recomputed only where keeping them does not fit, so a bf16 plan "
        "can keep, at a higher peak, what the fp32 plan recomputes). Infeasible: no plan fits the devices' memory.",
        "",
        table(rows), "",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    parser.add_argument("--presets", default=",".join(PRESETS))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = [row for case in CASES for row in plan_rows(case, args.presets.split(","),
                                                       lambda line: print(line, file=sys.stderr, flush=True))]
    text = report(rows, time.perf_counter() - start)
    print(text)
    if args.write:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
