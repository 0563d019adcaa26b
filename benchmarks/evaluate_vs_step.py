"""fxpipe evaluate (forward only) vs a training step on the same batch and plan: time and saved activations.

Run: python benchmarks/evaluate_vs_step.py [--steps 10] [--warmup 2] [--write]

Both run the same layer-cut GPT plan (2 stages, 1 rank each) in the same processes, alternating call by
call: ``pipe.step`` (forward, backward, gradient sync) and ``pipe.evaluate`` (the forward-only schedule
under ``torch.no_grad``). Memory is the peak of bytes autograd saves for backward (saved-tensor hooks
around one call, parameters excluded): a step keeps up to S - s micro-batches of activations on stage
s, evaluate none (each stage holds one micro-batch's activations at a time and saves nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    Workload,
    bench_main,
    compile_fxpipe,
    interleaved,
    machine_notes,
    median,
    mib,
    run_ranks,
    saved_peaks,
    zero_grads,
)

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/evaluate_vs_step.py --write"
NUM_STAGES = 2
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 32, 4)
TARGET_RATIO = 0.45  # evaluate takes at most this share of a training step's time


def evaluate_rank(rank: int, world_size: int, workload: Workload, num_warmup: int, num_steps: int) -> dict[str, Any]:
    """Saved bytes of one hooked call of each, then alternating timed calls."""
    pipe = compile_fxpipe(workload, world_size)
    inputs, targets = workload.batch()
    params = list(pipe.parameters())

    def step() -> None:
        zero_grads(params)
        pipe.step(inputs, targets)

    calls = {"step": step, "evaluate": lambda: pipe.evaluate(inputs, targets)}
    peaks = saved_peaks(calls, dict.fromkeys(calls, params))
    return {"peaks": peaks, "times": interleaved(calls, num_warmup, num_steps)}


def run(workload: Workload, *, num_warmup: int = 2, num_steps: int = 10) -> dict[str, Any]:
    ranks = run_ranks(evaluate_rank, NUM_STAGES, workload, num_warmup, num_steps)
    times = ranks[0]["times"]
    ratios = [e / s for s, e in zip(times["step"], times["evaluate"], strict=True)]
    return {"workload": workload, "num_steps": num_steps, "peaks": [r["peaks"] for r in ranks], "times": times,
            "median_s": {name: median(values) for name, values in times.items()}, "paired_ratio": median(ratios)}


def report(result: dict[str, Any]) -> str:
    workload: Workload = result["workload"]
    med = result["median_s"]
    ratio = med["evaluate"] / med["step"]
    time_rows = [[name, f"{med[name] * 1e3:.1f}", f"{min(result['times'][name]) * 1e3:.1f}"] for name in med]
    memory_rows = [[stage, mib(p["step"]), mib(p["evaluate"])] for stage, p in enumerate(result["peaks"])]
    met = "met" if ratio <= TARGET_RATIO else "MISSED"
    return "\n".join([
        "# Evaluate (forward only) vs a training step", "",
        f"Command: `{COMMAND}`", "", f"Workload: {workload.describe()}; S={NUM_STAGES} stages, 1 rank each.", "",
        f"Machine: {machine_notes()}.", "",
        f"## Time (median of {result['num_steps']} alternating calls after warm-up)", "",
        tabulate(time_rows, ["call", "median ms", "best ms"], tablefmt="github"), "",
        f"evaluate / step = **{ratio:.3f}** (median of call-pair ratios {result['paired_ratio']:.3f}); "
        f"target <= {TARGET_RATIO} ({met}).", "",
        "## Peak bytes saved for backward per stage", "",
        tabulate(memory_rows, ["stage", "step MiB", "evaluate MiB"], tablefmt="github"), "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__, RESULTS,
               lambda warmup, steps: report(run(DEFAULT_WORKLOAD, num_warmup=warmup, num_steps=steps)),
               steps=10, warmup=2)


if __name__ == "__main__":
    main()
