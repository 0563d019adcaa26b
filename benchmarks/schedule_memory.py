"""fxpipe early backward (policy A) vs GPipe at S=4, M=16: stage 0 peak activation memory and throughput.

Run: python benchmarks/schedule_memory.py [--steps 6] [--warmup 1] [--write]

Both schedules run the same layer-cut GPT plan in the same 4 rank processes, alternating step by step.
Activation memory is the peak of bytes autograd saves for backward (saved-tensor hooks around whole
steps, unique storages, parameters excluded; see bench_common.ActivationMeter). Early backward keeps
at most S - s micro-batches in flight on stage s, GPipe all M, so stage 0 should hold about S/M of GPipe's.
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
COMMAND = "python benchmarks/schedule_memory.py --write"
NUM_STAGES = 4
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 32, 16)
SCHEDULES = {"early backward (A)": ("early_backward", "A"), "GPipe": ("gpipe", "A")}
MEMORY_SLACK = 1.10  # the target allows S/M of GPipe's bytes plus 10 % of that


def schedule_rank(rank: int, world_size: int, workload: Workload, num_warmup: int, num_steps: int) -> dict[str, Any]:
    """Both schedules on this rank's stage: peak saved bytes (one hooked step each), then timed steps."""
    pipes = {name: compile_fxpipe(workload, world_size, schedule=schedule, warmup_policy=policy)
             for name, (schedule, policy) in SCHEDULES.items()}
    inputs, targets = workload.batch()
    params = {name: list(pipe.parameters()) for name, pipe in pipes.items()}

    def stepper(name: str) -> Any:
        def step() -> None:
            zero_grads(params[name])
            pipes[name].step(inputs, targets)
        return step

    steps = {name: stepper(name) for name in pipes}
    return {"peaks": saved_peaks(steps, params), "times": interleaved(steps, num_warmup, num_steps)}


def run(workload: Workload, *, num_warmup: int = 1, num_steps: int = 6) -> dict[str, Any]:
    ranks = run_ranks(schedule_rank, NUM_STAGES, workload, num_warmup, num_steps)
    times = ranks[0]["times"]
    eb, gp = list(SCHEDULES)
    ratios = [g / e for e, g in zip(times[eb], times[gp], strict=True)]
    return {"workload": workload, "num_steps": num_steps, "peaks": [r["peaks"] for r in ranks], "times": times,
            "median_s": {name: median(values) for name, values in times.items()},
            "paired_ratio": median(ratios)}


def report(result: dict[str, Any]) -> str:
    workload: Workload = result["workload"]
    eb, gp = list(SCHEDULES)
    bound = NUM_STAGES / workload.num_microbatches
    memory_rows = [[s, mib(p[eb]), mib(p[gp]), f"{p[eb] / max(p[gp], 1):.3f}"] for s, p in enumerate(result["peaks"])]
    stage0 = result["peaks"][0]
    memory_ratio = stage0[eb] / max(stage0[gp], 1)
    memory_met = memory_ratio <= bound * MEMORY_SLACK
    med = result["median_s"]
    speed_ratio = med[gp] / med[eb]
    time_rows = [[name, f"{med[name] * 1e3:.1f}", f"{workload.global_batch_size / med[name]:.1f}",
                  f"{min(result['times'][name]) * 1e3:.1f}"] for name in SCHEDULES]
    return "\n".join([
        "# Early backward vs GPipe in the fxpipe runtime", "",
        f"Command: `{COMMAND}`", "", f"Workload: {workload.describe()}; S={NUM_STAGES} stages, 1 rank each.", "",
        f"Machine: {machine_notes()}.", "",
        "## Peak activation memory per stage (bytes autograd saves for backward)", "",
        tabulate(memory_rows, ["stage", "early backward MiB", "GPipe MiB", "EB / GPipe"], tablefmt="github"), "",
        f"Stage 0: early backward / GPipe = **{memory_ratio:.3f}**; target <= (S/M) x 1.10 = "
        f"{bound * MEMORY_SLACK:.3f} ({'met' if memory_met else 'MISSED'}).", "",
        f"## Throughput (median of {result['num_steps']} alternating steps after warm-up)", "",
        tabulate(time_rows, ["schedule", "median step ms", "samples/s", "best step ms"], tablefmt="github"), "",
        f"Early backward throughput / GPipe throughput = **{speed_ratio:.3f}** (median of step-pair ratios "
        f"{result['paired_ratio']:.3f}); target >= 1.0 ({'met' if speed_ratio >= 1.0 else 'MISSED'}).", "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__, RESULTS,
               lambda warmup, steps: report(run(DEFAULT_WORKLOAD, num_warmup=warmup, num_steps=steps)),
               steps=6, warmup=1)


if __name__ == "__main__":
    main()
