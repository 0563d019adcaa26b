"""fxpipe runtime overhead: a 1-stage, 1-rank fxpipe step vs plain eager forward + loss + backward.

Run: python benchmarks/overhead.py [--steps 30] [--warmup 3] [--write]

Both run in one rank process (gloo world of 1, 1 thread) on separately built copies of the same model
with the same weights and batch, one micro-batch, gradients set to None before each step, alternating
step by step (A B B A ...). The fxpipe step is everything ``PipelinedModule.step`` does: batch check,
schedule interpretation, the generated stage GraphModule, the weighted loss, and the loss all-reduce.
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
    run_ranks,
    zero_grads,
)

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/overhead.py --write"
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 16, 1)
TARGET_RATIO = 1.05


def overhead_rank(rank: int, world_size: int, workload: Workload, num_warmup: int,
                  num_steps: int) -> dict[str, list[float]]:
    pipe = compile_fxpipe(workload, 1)
    model, _ = workload.build()
    loss_fn = workload.loss_fn()
    inputs, targets = workload.batch()
    fx_params, eager_params = list(pipe.parameters()), list(model.parameters())

    def fxpipe_step() -> None:
        zero_grads(fx_params)
        pipe.step(inputs, targets)

    def eager_step() -> None:
        zero_grads(eager_params)
        loss_fn(model(*inputs), targets).backward()

    return interleaved({"fxpipe": fxpipe_step, "eager": eager_step}, num_warmup, num_steps)


def run(workload: Workload, *, num_warmup: int = 3, num_steps: int = 30) -> dict[str, Any]:
    times = run_ranks(overhead_rank, 1, workload, num_warmup, num_steps)[0]
    return {"workload": workload, "num_steps": num_steps, "times": times,
            "median_s": {name: median(values) for name, values in times.items()},
            "paired_ratio": median([f / e for f, e in zip(times["fxpipe"], times["eager"], strict=True)])}


def report(result: dict[str, Any]) -> str:
    workload: Workload = result["workload"]
    med = result["median_s"]
    ratio = med["fxpipe"] / med["eager"]
    rows = [[name, f"{med[name] * 1e3:.2f}", f"{min(result['times'][name]) * 1e3:.2f}"] for name in ("fxpipe", "eager")]
    return "\n".join([
        "# fxpipe runtime overhead (1 stage, 1 rank)", "",
        f"Command: `{COMMAND}`", "", f"Workload: {workload.describe()}.", "",
        f"Machine: {machine_notes()}.", "",
        tabulate(rows, ["system", "median step ms", "best step ms"], tablefmt="github"), "",
        f"fxpipe / eager step time = **{ratio:.3f}** (median of {result['num_steps']} interleaved steps each); "
        f"median of per-pair ratios {result['paired_ratio']:.3f}; target <= {TARGET_RATIO} "
        f"({'met' if ratio <= TARGET_RATIO else 'MISSED'}).", "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__, RESULTS,
               lambda warmup, steps: report(run(DEFAULT_WORKLOAD, num_warmup=warmup, num_steps=steps)),
               steps=30, warmup=3)


if __name__ == "__main__":
    main()
