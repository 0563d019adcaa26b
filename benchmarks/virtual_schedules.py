"""fxpipe's virtual-stage schedules (interleaved 1F1B, ZB-V) vs its 1F1B on the same layer cuts, 4 CPU ranks, M = G.

Run: python benchmarks/virtual_schedules.py [--steps 8] [--warmup 2] [--ranks 4] [--virtual 2] [--write]

``--ranks R --virtual V``: R ranks (M = G = R) and V chunks per rank (R x V dividing gpt-mini's 8 blocks; ZB-V,
whose V holds 2 chunks per rank, only at V = 2); another setup than 4 x 2 writes its own file
(virtual_schedules_rR_vV.md). On a machine with fewer cores than
ranks, a rank idle in a bubble hands its core to another rank, so only R <= cores shows the bubble.

A bubble-bound workload: as many micro-batches as device groups (M = G = 4). 1F1B runs 4 stages of 2 transformer
blocks; the virtual schedules run the same 8 one-block chunks, 2 per rank (a loop for interleaved, a V for ZB-V).
torch.distributed.pipelining's ScheduleInterleaved1F1B and ScheduleZBVZeroBubble run the same chunk code (the
codegen's GraphModules under torch's PipelineStage, benchmarks/torch_pipelining_common.py) on the same chunk-to-rank
map. All run in the same forked ranks, stepped round-robin, figures are medians over steps. Predicted gain: the ideal
model (uniform chunks, free messages): 1F1B takes (M + G - 1) stage-steps, interleaved 1F1B M + (G - 1) / v.
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
from benchmarks.torch_pipelining_common import build_torch_side, fxpipe_step, gradient_gap, torch_step  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/virtual_schedules.py --write"
NUM_RANKS = 4
VIRTUAL_STAGES = 2
NUM_BLOCKS = 8


def workload_for(num_ranks: int) -> Workload:
    """gpt-mini of 8 blocks, global batch 16, as many micro-batches as ranks (M = G)."""
    return Workload("gpt-mini", (("n_layer", NUM_BLOCKS), ("n_embd", 128), ("block_size", 64)), 16, num_ranks)


WORKLOAD = workload_for(NUM_RANKS)


def results_path(num_ranks: int, virtual: int) -> Path:
    """This benchmark's file for a setup: the default 4 x 2 keeps virtual_schedules.md."""
    if (num_ranks, virtual) == (NUM_RANKS, VIRTUAL_STAGES):
        return RESULTS
    return RESULTS.with_name(f"{RESULTS.stem}_r{num_ranks}_v{virtual}.md")


def chunk_cuts(workload: Workload, num_chunks: int = NUM_BLOCKS) -> list[list[str]]:
    """The node names of the one-block chunks (the same on every rank, for fxpipe and torch alike)."""
    from fxpipe.passes import trace

    model, example_inputs = workload.build()
    return layer_cut_stages(trace(model, example_inputs), num_chunks)


def chunk_map(schedule: str, num_ranks: int = NUM_RANKS, virtual: int = VIRTUAL_STAGES) -> tuple[int, ...]:
    """Each chunk's rank: a loop (chunk c on rank c mod G) for interleaved schedules, a V for zbv."""
    from fxpipe.core.virtual import chunk_groups_for

    return tuple(chunk_groups_for("v" if schedule == "zbv" else "loop", num_ranks, virtual))


def compile_virtual(workload: Workload, schedule: str, num_ranks: int = NUM_RANKS,
                    virtual: int = VIRTUAL_STAGES) -> Any:
    """The workload as one-block chunks, ``virtual`` per rank (a loop, or a V for zbv)."""
    import fxpipe
    from fxpipe.core.plan import Plan, StagePlan

    model, example_inputs = workload.build()
    chunks, groups = chunk_cuts(workload, num_ranks * virtual), chunk_map(schedule, num_ranks, virtual)
    stages = tuple(StagePlan(c, c, c + 1, 1, (g,), node_names=tuple(names))
                   for c, (names, g) in enumerate(zip(chunks, groups, strict=True)))
    plan = Plan(workload.global_batch_size, workload.num_microbatches, stages, schedule=schedule,
                planner="bench-layer-cuts", virtual_stages=virtual, chunk_groups=groups)
    return fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(),
                          global_batch_size=workload.global_batch_size, plan=plan)


def compare_rank(rank: int, world_size: int, workload: Workload, num_warmup: int, num_steps: int,
                 virtual: int = VIRTUAL_STAGES) -> dict[str, Any]:
    inputs, targets = workload.batch()
    interleaved_label = f"fxpipe interleaved (v={virtual})"
    pipes = {"fxpipe 1F1B (early_backward)": compile_fxpipe(workload, world_size),
             interleaved_label: compile_virtual(workload, "interleaved", world_size, virtual)}
    if virtual == 2:  # a V holds exactly 2 chunks per rank
        pipes[f"fxpipe zbv (v={virtual})"] = compile_virtual(workload, "zbv", world_size, virtual)
    params = {name: list(pipe.parameters()) for name, pipe in pipes.items()}
    steps = {name: (lambda pipe=pipe, p=params[name]: fxpipe_step(pipe, p, inputs, targets))
             for name, pipe in pipes.items()}
    chunks, sides = chunk_cuts(workload, world_size * virtual), {}
    torch_sides = [(f"torch ScheduleInterleaved1F1B (v={virtual})", "ScheduleInterleaved1F1B", "interleaved")]
    if virtual == 2:
        torch_sides.append((f"torch ScheduleZBVZeroBubble (v={virtual})", "ScheduleZBVZeroBubble", "zbv"))
    for label, torch_name, layout in torch_sides:
        mine = tuple(c for c, g in enumerate(chunk_map(layout, world_size, virtual)) if g == rank)
        sides[label] = side = build_torch_side(workload, chunks, torch_name, stage_indices=mine)
        steps[label] = lambda side=side: torch_step(side, inputs, targets)
    times = interleaved(steps, num_warmup, num_steps)
    # no optimizer steps: every system's last gradients are of the same weights and batch
    gaps = {label: gradient_gap(pipes[interleaved_label], side) for label, side in sides.items()}
    return {"times": times, "gradient_gaps": gaps}


def run_and_report(num_warmup: int, num_steps: int, num_ranks: int = NUM_RANKS, virtual: int = VIRTUAL_STAGES) -> str:
    workload = workload_for(num_ranks)
    per_rank = run_ranks(compare_rank, num_ranks, workload, num_warmup, num_steps, virtual)
    times = per_rank[0]["times"]  # every step ends with a barrier: rank 0's times are the job's
    base = median(times["fxpipe 1F1B (early_backward)"])
    m, g, v = workload.num_microbatches, num_ranks, virtual
    predicted = (m + g - 1) / (m + (g - 1) / v)
    gap = max(max(rank_result["gradient_gaps"].values()) for rank_result in per_rank)
    torch_best = min(median(values) for name, values in times.items() if name.startswith("torch"))
    rows = [[name, f"{median(values) * 1e3:.1f}", f"{min(values) * 1e3:.1f}", f"{base / median(values):.3f}x",
             f"{torch_best / median(values):.3f}x"] for name, values in times.items()]
    table = tabulate(rows, headers=["schedule", "median step ms", "min ms", "throughput vs fxpipe 1F1B",
                                    "throughput vs torch's best"], tablefmt="github")
    setup = "" if (num_ranks, virtual) == (NUM_RANKS, VIRTUAL_STAGES) else f" --ranks {num_ranks} --virtual {virtual}"
    return (f"# Virtual-stage schedules vs 1F1B (fxpipe, same layer cuts)\n\nCommand: `{COMMAND}{setup}` "
            f"({num_steps} measured steps after {num_warmup} warm-up, round-robin).\n\nWorkload: "
            f"{workload.describe()}; {num_ranks} CPU ranks (gloo), M = G = {g}.\n\n{table}\n\n"
            f"Predicted gain of interleaved 1F1B over 1F1B on ideal uniform chunks: (M + G - 1) / (M + (G - 1) / v) "
            f"= {predicted:.3f}x.\n\nSame work: after the timed steps the largest |gradient difference| between fxpipe's interleaved run and each "
            f"torch schedule, over every rank's parameters, was {gap:.2e}.\n\n{machine_notes()}\n")


def main(argv: list[str]) -> None:
    import argparse
    from functools import partial

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ranks", type=int, default=NUM_RANKS)
    parser.add_argument("--virtual", type=int, default=VIRTUAL_STAGES)
    setup, rest = parser.parse_known_args(argv)
    if setup.ranks < 2 or setup.virtual < 2 or NUM_BLOCKS % (setup.ranks * setup.virtual):
        raise SystemExit(f"--ranks {setup.ranks} --virtual {setup.virtual}: need ranks >= 2, virtual >= 2 and "
                         f"ranks x virtual dividing {NUM_BLOCKS} (whole blocks per chunk)")
    bench_main(rest, __doc__, results_path(setup.ranks, setup.virtual),
               partial(run_and_report, num_ranks=setup.ranks, virtual=setup.virtual), steps=8, warmup=2)


if __name__ == "__main__":
    main(sys.argv[1:])
