"""fxpipe vs torch.distributed.pipelining (Schedule1F1B) on the same GPT stages: throughput and activation memory.

Run: python benchmarks/vs_torch_pipelining.py [--steps 10] [--warmup 2] [--write]

Fairness: both systems run the very same stage code. fxpipe's codegen splits the traced GPT at
transformer-block boundaries; torch.distributed.pipelining gets an identical, separately built copy of
each stage GraphModule wrapped in ``PipelineStage`` (manual stages, so both trace the same graph once and
only the runtimes differ). Both run synchronous 1F1B with the same warm-up (torch ``Schedule1F1B``:
min(M, S - s) forwards; fxpipe early-backward policy A: the same), the same micro-batches, and sum the
tied embedding / LM-head gradient across its two owner stages (fxpipe does it itself; for torch an
all-reduce over the two owners follows ``schedule.step``). Gradients are zeroed (set to None) in both
steps; no optimizer step is timed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    ActivationMeter,
    Workload,
    bench_main,
    compile_fxpipe,
    interleaved,
    machine_notes,
    median,
    mib,
    run_ranks,
    stage_names,
)
from benchmarks.torch_pipelining_common import build_torch_side, fxpipe_step, gradient_gap, torch_step  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/vs_torch_pipelining.py --write"
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 32, 8)


def throughput_rank(rank: int, world_size: int, workload: Workload, num_warmup: int,
                    num_steps: int) -> dict[str, Any]:
    """Both systems on this rank's stage, stepped alternately; per-step seconds of each."""
    stages = stage_names(workload, world_size)
    pipe = compile_fxpipe(workload, world_size)
    side = build_torch_side(workload, stages)
    inputs, targets = workload.batch()
    fx_params = list(pipe.parameters())
    steps = {"fxpipe": lambda: fxpipe_step(pipe, fx_params, inputs, targets),
             "torch": lambda: torch_step(side, inputs, targets)}
    times = interleaved(steps, num_warmup, num_steps)
    return {"times": times, "gradient_gap": gradient_gap(pipe, side)}


def memory_rank(rank: int, world_size: int, workload: Workload, num_steps: int) -> dict[str, int]:
    """Peak bytes autograd saves for backward on this rank's stage, per system (hooks around whole steps)."""
    stages = stage_names(workload, world_size)
    pipe = compile_fxpipe(workload, world_size)
    side = build_torch_side(workload, stages)
    inputs, targets = workload.batch()
    fx_params = list(pipe.parameters())
    meters = {"fxpipe": ActivationMeter.for_parameters(fx_params),
              "torch": ActivationMeter.for_parameters(side.parameters)}
    steps = {"fxpipe": lambda: fxpipe_step(pipe, fx_params, inputs, targets),
             "torch": lambda: torch_step(side, inputs, targets)}
    for _ in range(num_steps):
        for name, step in steps.items():
            with meters[name].measure():
                step()
            dist.barrier()
    return {name: meter.peak_bytes for name, meter in meters.items()}


def run(workload: Workload, *, throughput_ranks: int = 2, memory_ranks: int = 4, num_warmup: int = 2,
        num_steps: int = 10) -> dict[str, Any]:
    """Measure both; returns the figures (times by rank, peak saved bytes by rank, gradient gaps)."""
    throughput = run_ranks(throughput_rank, throughput_ranks, workload, num_warmup, num_steps)
    memory = run_ranks(memory_rank, memory_ranks, workload, 2)
    times = throughput[0]["times"]
    fx_s, torch_s = median(times["fxpipe"]), median(times["torch"])
    return {"workload": workload, "throughput_ranks": throughput_ranks, "memory_ranks": memory_ranks,
            "num_steps": num_steps, "fxpipe_s": fx_s, "torch_s": torch_s, "times": times,
            "throughput_ratio": torch_s / fx_s, "memory": memory,
            "paired_ratio": median([t / f for f, t in zip(times["fxpipe"], times["torch"], strict=True)]),
            "gradient_gap": max(r["gradient_gap"] for r in throughput)}


def report(result: dict[str, Any]) -> str:
    """The results page (markdown)."""
    workload: Workload = result["workload"]
    batch = workload.global_batch_size
    rows = [["fxpipe (early backward, policy A)", f"{result['fxpipe_s'] * 1e3:.1f}", f"{batch / result['fxpipe_s']:.1f}",
             f"{min(result['times']['fxpipe']) * 1e3:.1f}"],
            ["torch.distributed.pipelining Schedule1F1B", f"{result['torch_s'] * 1e3:.1f}",
             f"{batch / result['torch_s']:.1f}", f"{min(result['times']['torch']) * 1e3:.1f}"]]
    memory_rows = [[s, mib(m["fxpipe"]), mib(m["torch"]), f"{m['fxpipe'] / max(m['torch'], 1):.3f}"]
                   for s, m in enumerate(result["memory"])]
    ratio = result["throughput_ratio"]
    worst = max(m["fxpipe"] / max(m["torch"], 1) for m in result["memory"])
    return "\n".join([
        "# fxpipe vs torch.distributed.pipelining", "",
        f"Command: `{COMMAND}`", "", f"Workload: {workload.describe()}.", "",
        f"Machine: {machine_notes()}.", "",
        f"## Throughput ({result['throughput_ranks']} ranks x 1 thread, median of {result['num_steps']} "
        "interleaved steps after warm-up)", "",
        tabulate(rows, ["system", "median step ms", "samples/s", "best step ms"], tablefmt="github"), "",
        f"fxpipe throughput / torch throughput = **{ratio:.3f}** (target >= 1.0: "
        f"{'met' if ratio >= 1.0 else 'MISSED'}); median of per-round ratios (each round runs both back to back) "
        f"{result['paired_ratio']:.3f}. Largest gradient difference between the two after a step: "
        f"{result['gradient_gap']:.2e} (same computation).", "",
        f"## Peak activation memory per stage ({result['memory_ranks']} ranks)", "",
        "Bytes autograd holds for backward, counted with `torch.autograd.graph.saved_tensors_hooks` around "
        "each whole step on both systems: unique storages alive at the peak, parameters excluded.", "",
        tabulate(memory_rows, ["stage", "fxpipe MiB", "torch MiB", "fxpipe / torch"], tablefmt="github"), "",
        f"Worst stage ratio fxpipe / torch = **{worst:.3f}** (target <= 1.0: {'met' if worst <= 1.0 else 'MISSED'}).",
        "", __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    def run_and_report(warmup: int, steps: int) -> str:
        first = report(run(DEFAULT_WORKLOAD, num_warmup=warmup, num_steps=steps))
        # the page also holds vs_torch_schedules.py's tables: run that script (the two import only common code)
        schedules = subprocess.run([sys.executable, str(Path(__file__).with_name("vs_torch_schedules.py")),
                                    "--warmup", str(warmup), "--steps", str(steps)],
                                   check=True, capture_output=True, text=True).stdout
        return first + "\n" + schedules.rstrip("\n") + "\n"

    bench_main(argv, __doc__, RESULTS, run_and_report, steps=10, warmup=2)


if __name__ == "__main__":
    main()
