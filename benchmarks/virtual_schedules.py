"""fxpipe's virtual-stage schedules (interleaved 1F1B, ZB-V) vs its 1F1B on the same layer cuts, 4 CPU ranks, M = G.

Run: python benchmarks/virtual_schedules.py [--steps 8] [--warmup 2] [--write]

A bubble-bound workload: as many micro-batches as device groups (M = G = 4). 1F1B runs 4 stages of 2 transformer
blocks; the virtual schedules run the same 8 one-block chunks, 2 per rank (a loop for interleaved, a V for ZB-V).
All run in the same forked ranks, stepped round-robin, figures are medians over steps. Predicted gain: the ideal
model (uniform chunks, free messages): 1F1B takes (M + G - 1) stage-steps, interleaved 1F1B M + (G - 1) / v.
torch.distributed.pipelining's ScheduleInterleaved1F1B / ScheduleZBVZeroBubble are not compared yet.
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
    layer_cut_stages,
    machine_notes,
    median,
    run_ranks,
)
from benchmarks.torch_pipelining_common import fxpipe_step  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/virtual_schedules.py --write"
NUM_RANKS = 4
VIRTUAL_STAGES = 2
WORKLOAD = Workload("gpt-mini", (("n_layer", 8), ("n_embd", 128), ("block_size", 64)), 16, NUM_RANKS)


def compile_virtual(workload: Workload, schedule: str) -> Any:
    """The workload as 8 one-block chunks on 4 ranks (a loop, or a V for zbv)."""
    import fxpipe
    from fxpipe.core.plan import Plan, StagePlan
    from fxpipe.core.virtual import chunk_groups_for
    from fxpipe.passes import trace

    model, example_inputs = workload.build()
    chunks = layer_cut_stages(trace(workload.build()[0], example_inputs), NUM_RANKS * VIRTUAL_STAGES)
    groups = chunk_groups_for("v" if schedule == "zbv" else "loop", NUM_RANKS, VIRTUAL_STAGES)
    stages = tuple(StagePlan(c, c, c + 1, 1, (g,), node_names=tuple(names))
                   for c, (names, g) in enumerate(zip(chunks, groups, strict=True)))
    plan = Plan(workload.global_batch_size, workload.num_microbatches, stages, schedule=schedule,
                planner="bench-layer-cuts", virtual_stages=VIRTUAL_STAGES, chunk_groups=groups)
    return fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(),
                          global_batch_size=workload.global_batch_size, plan=plan)


def compare_rank(rank: int, world_size: int, workload: Workload, num_warmup: int, num_steps: int) -> dict[str, Any]:
    inputs, targets = workload.batch()
    pipes = {"fxpipe 1F1B (early_backward)": compile_fxpipe(workload, world_size),
             "fxpipe interleaved (v=2)": compile_virtual(workload, "interleaved"),
             "fxpipe zbv (v=2)": compile_virtual(workload, "zbv")}
    params = {name: list(pipe.parameters()) for name, pipe in pipes.items()}
    steps = {name: (lambda pipe=pipe, p=params[name]: fxpipe_step(pipe, p, inputs, targets))
             for name, pipe in pipes.items()}
    return {"times": interleaved(steps, num_warmup, num_steps)}


def run_and_report(num_warmup: int, num_steps: int) -> str:
    per_rank = run_ranks(compare_rank, NUM_RANKS, WORKLOAD, num_warmup, num_steps)
    times = per_rank[0]["times"]  # every step ends with a barrier: rank 0's times are the job's
    base = median(times["fxpipe 1F1B (early_backward)"])
    m, g, v = WORKLOAD.num_microbatches, NUM_RANKS, VIRTUAL_STAGES
    predicted = (m + g - 1) / (m + (g - 1) / v)
    rows = [[name, f"{median(values) * 1e3:.1f}", f"{min(values) * 1e3:.1f}", f"{base / median(values):.3f}x"]
            for name, values in times.items()]
    table = tabulate(rows, headers=["schedule", "median step ms", "min ms", "throughput vs 1F1B"],
                     tablefmt="github")
    return (f"# Virtual-stage schedules vs 1F1B (fxpipe, same layer cuts)\n\nCommand: `{COMMAND}` "
            f"({num_steps} measured steps after {num_warmup} warm-up, round-robin).\n\nWorkload: "
            f"{WORKLOAD.describe()}; {NUM_RANKS} CPU ranks (gloo), M = G = {g}.\n\n{table}\n\n"
            f"Predicted gain of interleaved 1F1B over 1F1B on ideal uniform chunks: (M + G - 1) / (M + (G - 1) / v) "
            f"= {predicted:.3f}x.\n\n{machine_notes()}\n")


if __name__ == "__main__":
    bench_main(sys.argv[1:], __doc__, RESULTS, run_and_report, steps=8, warmup=2)
