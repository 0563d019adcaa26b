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
map. All run in the same forked ranks, stepped round-robin, figures are medians over steps. The gain the model predicts:
fxpipe's own simulator on the same cuts (:func:`predicted_times`); beside it the ideal (uniform chunks, free
messages): 1F1B takes (M + G - 1) stage-steps, interleaved 1F1B M + (G - 1) / v.

``--width W`` runs gpt-mini at W channels (a file of its own, ..._wW.md): wider blocks carry more compute per
message, the regime of real pipelines, where a step's messages are a small part of it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    GPT_MINI_WIDTH,
    Workload,
    bench_main,
    compile_fxpipe,
    gpt_mini_width,
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


DEFAULT_WIDTH = GPT_MINI_WIDTH


def workload_for(num_ranks: int, width: int = DEFAULT_WIDTH) -> Workload:
    """gpt-mini of 8 blocks, global batch 16, as many micro-batches as ranks (M = G), at ``width`` channels
    (:func:`benchmarks.bench_common.gpt_mini_width`)."""
    return Workload("gpt-mini", (("n_layer", NUM_BLOCKS), *gpt_mini_width(width), ("block_size", 64)), 16,
                    num_ranks)


WORKLOAD = workload_for(NUM_RANKS)


def results_path(num_ranks: int, virtual: int, width: int = DEFAULT_WIDTH) -> Path:
    """This benchmark's file for a setup: the default 4 x 2 keeps virtual_schedules.md."""
    if (num_ranks, virtual, width) == (NUM_RANKS, VIRTUAL_STAGES, DEFAULT_WIDTH):
        return RESULTS
    wide = "" if width == DEFAULT_WIDTH else f"_w{width}"
    return RESULTS.with_name(f"{RESULTS.stem}_r{num_ranks}_v{virtual}{wide}.md")


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


def chunk_blocks(chain: Any, chunks: list[list[str]]) -> list[tuple[int, int]]:
    """Each chunk's ``[first, stop)`` blocks of ``chain``: the blocks holding its nodes, which must be consecutive
    and hold no other chunk's nodes (weights and constants, which the chunks do not list, go with their block; a
    chain cut finer than the chunks, e.g. ``build_chain(max_blocks=None)``)."""
    block_of = {name: index for index, block in enumerate(chain.blocks) for name in block.node_names}
    chunk_of = {name: index for index, names in enumerate(chunks) for name in names}
    ranges = []
    for index, names in enumerate(chunks):
        blocks = sorted({block_of[name] for name in names if name in block_of})
        if not blocks or blocks != list(range(blocks[0], blocks[-1] + 1)):
            raise ValueError(f"chunk {index}'s nodes lie in chain blocks {blocks}, not a run of consecutive blocks")
        outside = [name for b in blocks for name in chain.blocks[b].node_names if chunk_of.get(name, index) != index]
        if outside:
            raise ValueError(f"chain blocks {blocks[0]}-{blocks[-1]} of chunk {index} also hold {outside[:3]}: "
                             "the chain is cut coarser than the chunks")
        ranges.append((blocks[0], blocks[-1] + 1))
    if [first for first, _ in ranges[1:]] != [stop for _, stop in ranges[:-1]] or ranges[0][0] != 0 \
            or ranges[-1][1] != chain.num_blocks:
        raise ValueError(f"the chunks' block ranges {ranges} do not tile the chain's {chain.num_blocks} blocks")
    return ranges


def predicted_times(workload: Workload, num_ranks: int, virtual: int) -> dict[str, float]:
    """fxpipe's simulator on the same cuts: seconds per step of 1F1B (each rank's ``virtual`` chunks as one stage),
    interleaved and (v = 2) ZB-V, on a chain measured here (one thread) and the calibrated ``local:R`` cluster the
    ranks' compile wrote (messages, action and step overheads included)."""
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (the 'local' cluster reads its cache)
    from benchmarks.runtime_fidelity import measured_chain
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.core.plan import Plan, StagePlan
    from fxpipe.sim.simulate import simulate
    from fxpipe.sim.virtual_simulate import simulate_virtual

    chain = measured_chain(workload, max_blocks=None)
    cluster = parse_cluster(f"local:{num_ranks}")
    ranges = chunk_blocks(chain, chunk_cuts(workload, num_ranks * virtual))
    batch, micro = workload.global_batch_size, workload.num_microbatches
    one_f_one_b = Plan(batch, micro, tuple(
        StagePlan(g, ranges[g * virtual][0], ranges[(g + 1) * virtual - 1][1], 1, (g,)) for g in range(num_ranks)))
    times = {"1F1B": simulate(one_f_one_b, chain, cluster, timeline=False).iteration_time_s}
    for schedule in ("interleaved", "zbv")[:2 if virtual == 2 else 1]:
        groups = chunk_map(schedule, num_ranks, virtual)
        plan = Plan(batch, micro, tuple(StagePlan(c, first, stop, 1, (g,))
                                        for c, ((first, stop), g) in enumerate(zip(ranges, groups, strict=True))),
                    schedule=schedule, virtual_stages=virtual, chunk_groups=groups)
        times[schedule] = simulate_virtual(plan, chain, cluster, timeline=False).iteration_time_s
    return times


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


def simulated_label(name: str) -> str | None:
    """The :func:`predicted_times` key of a fxpipe row of the table (None for torch's rows)."""
    for key, prefix in (("1F1B", "fxpipe 1F1B"), ("interleaved", "fxpipe interleaved"), ("zbv", "fxpipe zbv")):
        if name.startswith(prefix):
            return key
    return None


def run_and_report(num_warmup: int, num_steps: int, num_ranks: int = NUM_RANKS, virtual: int = VIRTUAL_STAGES,
                   width: int = DEFAULT_WIDTH) -> str:
    workload = workload_for(num_ranks, width)
    per_rank = run_ranks(compare_rank, num_ranks, workload, num_warmup, num_steps, virtual)
    simulated = predicted_times(workload, num_ranks, virtual)  # after the ranks: the chain measured on a quiet host
    times = per_rank[0]["times"]  # every step ends with a barrier: rank 0's times are the job's
    base = median(times["fxpipe 1F1B (early_backward)"])
    m, g, v = workload.num_microbatches, num_ranks, virtual
    ideal = (m + g - 1) / (m + (g - 1) / v)
    gap = max(max(rank_result["gradient_gaps"].values()) for rank_result in per_rank)
    torch_best = min(median(values) for name, values in times.items() if name.startswith("torch"))
    rows = []
    for name, values in times.items():
        key, speedup = simulated_label(name), base / median(values)
        model = simulated["1F1B"] / simulated[key] if key is not None else None
        share = "" if key in (None, "1F1B") or model is None or model <= 1 else f"{(speedup - 1) / (model - 1):.0%}"
        rows.append([name, f"{median(values) * 1e3:.1f}", f"{min(values) * 1e3:.1f}", f"{speedup:.3f}x",
                     f"{torch_best / median(values):.3f}x", "" if key is None else f"{simulated[key] * 1e3:.1f}",
                     "" if model is None else f"{model:.3f}x", share])
    table = tabulate(rows, headers=["schedule", "median step ms", "min ms", "throughput vs fxpipe 1F1B",
                                    "throughput vs torch's best", "simulated step ms", "simulated vs 1F1B",
                                    "measured gain / simulated gain"], tablefmt="github")
    setup = "" if (num_ranks, virtual) == (NUM_RANKS, VIRTUAL_STAGES) else f" --ranks {num_ranks} --virtual {virtual}"
    setup += "" if width == DEFAULT_WIDTH else f" --width {width}"
    return (f"# Virtual-stage schedules vs 1F1B (fxpipe, same layer cuts)\n\nCommand: `{COMMAND}{setup}` "
            f"({num_steps} measured steps after {num_warmup} warm-up, round-robin).\n\nWorkload: "
            f"{workload.describe()}; {num_ranks} CPU ranks (gloo), M = G = {g}.\n\n{table}\n\n"
            f"Simulated: fxpipe's simulator (`simulate`, `simulate_virtual`) on the same cuts, over a chain of the "
            f"workload measured after the ranks (one thread) and the calibrated `local:{g}` cluster; its gains are "
            f"what the model predicts, messages and overheads included. Gain of interleaved 1F1B over 1F1B on ideal "
            f"uniform chunks with free messages: (M + G - 1) / (M + (G - 1) / v) = {ideal:.3f}x.\n\n"
            f"Same work: after the timed steps the largest |gradient difference| between fxpipe's interleaved run and "
            f"each torch schedule, over every rank's parameters, was {gap:.2e}.\n\n{machine_notes()}\n")


def main(argv: list[str]) -> None:
    import argparse
    from functools import partial

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ranks", type=int, default=NUM_RANKS)
    parser.add_argument("--virtual", type=int, default=VIRTUAL_STAGES)
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="gpt-mini's channels (n_embd)")
    setup, rest = parser.parse_known_args(argv)
    if setup.ranks < 2 or setup.virtual < 2 or NUM_BLOCKS % (setup.ranks * setup.virtual):
        raise SystemExit(f"--ranks {setup.ranks} --virtual {setup.virtual}: need ranks >= 2, virtual >= 2 and "
                         f"ranks x virtual dividing {NUM_BLOCKS} (whole blocks per chunk)")
    if setup.width < 32 or setup.width % 32:
        raise SystemExit(f"--width {setup.width}: need a multiple of 32 (one head per 32 channels)")
    bench_main(rest, __doc__, results_path(setup.ranks, setup.virtual, setup.width),
               partial(run_and_report, num_ranks=setup.ranks, virtual=setup.virtual, width=setup.width),
               steps=8, warmup=2)


if __name__ == "__main__":
    main(sys.argv[1:])
