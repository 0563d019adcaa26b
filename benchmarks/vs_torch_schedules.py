"""fxpipe's schedules vs torch.distributed.pipelining's on the same stages; zero-bubble vs early backward in fxpipe.

Part of ``python benchmarks/vs_torch_pipelining.py --write`` (its page holds these tables); on its own:
``python benchmarks/vs_torch_schedules.py [--steps 8] [--warmup 2]`` prints them.

Every system of one table runs in the same forked ranks, stepped round-robin (A B C ... then the reverse
order), so the slow phases of this shared machine hit all of them alike; figures are medians over steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    ActivationMeter,
    Workload,
    compile_fxpipe,
    interleaved,
    median,
    mib,
    run_ranks,
    stage_names,
)
from benchmarks.torch_pipelining_common import TORCH_SCHEDULES, build_torch_side, fxpipe_step, torch_step  # noqa: E402

WORKLOADS = {
    "gpt-mini": Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 32, 8),
    "residual MLP": Workload("tied-lm", (("vocab_size", 256), ("dim", 256), ("num_blocks", 4), ("seq_len", 32)),
                             32, 8),
}
FX_SCHEDULES = ("early_backward", "zero_bubble", "gpipe")  # all with warm-up policy A
# the schedule family each torch schedule belongs to (for the memory comparison)
FAMILY = {"Schedule1F1B": "early_backward", "ScheduleGPipe": "gpipe", "ScheduleInterleavedZeroBubble": "zero_bubble"}
RANK_COUNTS = (2, 4)
NOTES = """Reading these figures: the machine is 2 cores shared with other engineers' jobs (the load average
above). The same pair compared in the first table of this page and in the 2-rank rows here (fxpipe
early backward vs torch Schedule1F1B, same stages) can differ by tens of percent between the two
tables of one run (compare them), so single ratios are not resolvable to the 1.15x target. With 4 ranks on 2 cores a rank waiting in a
bubble lends its core to another rank, so removing bubbles cannot shorten the step; zero-bubble then
only adds its bookkeeping (two autograd calls and a walk of the autograd graph per micro-batch). The
runtime timeline does show the bubble shrinking (table above). The simulator's gain for equal stages
with B = W is (S - 1) W / ((M + S - 1)(F + B + W)): 3.7% at S=2, M=8 and 9% at S=4, M=8, so the 1.15x
target over torch's best cannot come from the schedule alone on these shapes; where fxpipe is ahead of
torch it is ahead with early backward too (its runtime, not the schedule)."""


def compare_rank(rank: int, world_size: int, workload: Workload, num_warmup: int, num_steps: int) -> dict[str, Any]:
    """Every fxpipe and torch schedule on this rank's stage: step seconds, then one metered step each."""
    stages = stage_names(workload, world_size)
    inputs, targets = workload.batch()
    steps, params = {}, {}
    for schedule in FX_SCHEDULES:
        pipe = compile_fxpipe(workload, world_size, schedule=schedule)
        params[f"fxpipe {schedule}"] = fx_params = list(pipe.parameters())
        steps[f"fxpipe {schedule}"] = lambda pipe=pipe, p=fx_params: fxpipe_step(pipe, p, inputs, targets)
    for name in TORCH_SCHEDULES:
        side = build_torch_side(workload, stages, name)
        params[f"torch {name}"] = side.parameters
        steps[f"torch {name}"] = lambda side=side: torch_step(side, inputs, targets)
    times = interleaved(steps, num_warmup, num_steps)
    memory = {}
    for name, step in steps.items():
        meter = ActivationMeter.for_parameters(params[name])
        with meter.measure():
            step()
        dist.barrier()
        memory[name] = meter.peak_bytes
    return {"times": times, "memory": memory}


def bubble_rank(rank: int, world_size: int, workload: Workload, num_warmup: int, num_steps: int) -> dict[str, Any]:
    """Early backward and zero-bubble with the runtime's timeline on: per step, this rank's busy and step time."""
    inputs, targets = workload.batch()
    steps, stats, pipes = {}, {}, {}
    for schedule in ("early_backward", "zero_bubble"):
        pipes[schedule] = pipe = compile_fxpipe(workload, world_size, schedule=schedule)
        pipe.measure = "timeline"
        stats[schedule] = []
        fx_params = list(pipe.parameters())

        def step(pipe: Any = pipe, p: list[Any] = fx_params, record: list[Any] = stats[schedule]) -> None:
            fxpipe_step(pipe, p, inputs, targets)
            record.append((pipe.driver.last_stats.busy_s, pipe.driver.last_stats.step_time_s))

        steps[schedule] = step
    times = interleaved(steps, num_warmup, num_steps)
    memory = {}
    for schedule, pipe in pipes.items():
        pipe.measure = True  # exact saved-activation peak of one step
        fxpipe_step(pipe, list(pipe.parameters()), inputs, targets)
        memory[schedule] = pipe.driver.last_stats.peak_activation_bytes
    return {"times": times, "stats": {k: v[num_warmup:] for k, v in stats.items()}, "memory": memory}


def run_comparison(num_warmup: int, num_steps: int) -> list[dict[str, Any]]:
    results = []
    for label, workload in WORKLOADS.items():
        for num_ranks in RANK_COUNTS:
            per_rank = run_ranks(compare_rank, num_ranks, workload, num_warmup, num_steps)
            times = per_rank[0]["times"]  # steps end with a barrier: every rank sees the same step time
            results.append({"label": label, "workload": workload, "ranks": num_ranks,
                            "chosen": auto_schedule(workload, num_ranks),
                            "median_s": {name: median(t) for name, t in times.items()},
                            "memory": {name: max(r["memory"][name] for r in per_rank) for name in times}})
    return results


def auto_schedule(workload: Workload, num_ranks: int) -> str:
    """The schedule ``schedule="auto"`` picks for one stage per rank and the workload's M on this machine's
    ``local`` cluster, from block costs measured here (its calibration, split-backward cost included)."""
    from fxpipe.planning import plan_model

    model, example_inputs = workload.build()
    plan = plan_model(model, example_inputs, cluster=f"local:{num_ranks}", global_batch_size=workload.global_batch_size,
                      layout=":".join(["1"] * num_ranks), num_microbatches=workload.num_microbatches,
                      schedule="auto", costs="measured")
    return plan.schedule


def run_bubbles(num_warmup: int, num_steps: int) -> list[dict[str, Any]]:
    base = WORKLOADS["gpt-mini"]
    results = []
    for num_microbatches in (8, 16):
        workload = Workload(base.model, base.overrides, 4 * num_microbatches, num_microbatches)
        per_rank = run_ranks(bubble_rank, 4, workload, num_warmup, num_steps)
        bubbles = {}
        for schedule in ("early_backward", "zero_bubble"):
            per_step = zip(*(r["stats"][schedule] for r in per_rank), strict=True)
            bubbles[schedule] = median([sum(1 - busy / step for busy, step in ranks) / len(ranks)
                                        for ranks in per_step])
        results.append({"num_microbatches": num_microbatches, "workload": workload, "bubble": bubbles,
                        "median_s": {k: median(v) for k, v in per_rank[0]["times"].items()},
                        "memory": {k: max(r["memory"][k] for r in per_rank) for k in bubbles}})
    return results


def report(comparison: list[dict[str, Any]], bubbles: list[dict[str, Any]], num_steps: int) -> str:
    lines = ["## fxpipe's schedules vs torch.distributed.pipelining's (same stages, same micro-batches)", "",
             f"One stage per rank, cut at block boundaries; median of {num_steps} round-robin steps per system. "
             "fxpipe's chosen schedule is what the planner picks under `schedule='auto'` for one stage per rank "
             "and the same M on this machine's `local` cluster (block costs measured here; the calibrated cost of "
             "splitting backward included; another schedule must be predicted 10% faster to replace early "
             "backward). Throughput ratio = its time / the chosen schedule's (> 1: the chosen one is "
             "faster). Memory: the largest per-rank peak of bytes autograd saved for backward in one step "
             "(`saved_tensors_hooks`); 'same family' compares with fxpipe's schedule of that family. torch's "
             "ScheduleZBVZeroBubble needs two stages per rank (V shape), so it does not run these stages.", ""]
    rows = []
    for result in comparison:
        median_s, memory = result["median_s"], result["memory"]
        chosen = median_s[f"fxpipe {result['chosen']}"]
        for name in median_s:
            family = FAMILY.get(name.removeprefix("torch "))
            own = memory[f"fxpipe {family}"] if family else memory[name]
            rows.append([result["label"], result["ranks"], name, f"{median_s[name] * 1e3:.1f}",
                         f"{median_s[name] / chosen:.3f}", mib(memory[name]),
                         f"{own / max(memory[name], 1):.3f}" if family else ""])
    lines += [tabulate(rows, ["model", "ranks", "system", "median step ms", "its time / fxpipe's chosen",
                              "peak act MiB", "fxpipe same family / it"], tablefmt="github"), ""]
    best = [min(v for k, v in r["median_s"].items() if k.startswith("torch")) / r["median_s"][f"fxpipe {r['chosen']}"]
            for r in comparison]
    lines += ["fxpipe's chosen schedule throughput / torch's best schedule: "
              + ", ".join(f"{r['label']} {r['ranks']} ranks ({r['chosen']}) **{b:.3f}**"
                          for r, b in zip(comparison, best, strict=True))
              + f" (target >= 1.15: met on {sum(b >= 1.15 for b in best)} of {len(best)}).", ""]
    rows = []
    for result in bubbles:
        eb, zb = result["median_s"]["early_backward"], result["median_s"]["zero_bubble"]
        rows.append([result["num_microbatches"], f"{result['bubble']['early_backward']:.3f}",
                     f"{result['bubble']['zero_bubble']:.3f}", f"{eb * 1e3:.1f}", f"{zb * 1e3:.1f}", f"{eb / zb:.3f}",
                     f"{result['memory']['zero_bubble'] / max(result['memory']['early_backward'], 1):.3f}"])
    lines += ["## Zero-bubble vs early backward in fxpipe (gpt-mini, S=4 on 4 ranks, 4-row micro-batches)", "",
              "Bubble fraction from the runtime's timeline (`pipe.measure = 'timeline'`): per rank 1 - "
              "(F + B + W time) / step time, averaged over ranks, median over steps. Memory ratio: exact "
              "saved-activation peak (`measure = True`), largest rank, zero-bubble / early backward.", "",
              tabulate(rows, ["M", "bubble early backward", "bubble zero-bubble", "early backward ms",
                              "zero-bubble ms", "throughput ratio zb/eb", "memory ratio zb/eb"], tablefmt="github"),
              "", NOTES, ""]
    return "\n".join(lines)


def run_and_report(num_warmup: int, num_steps: int) -> str:
    return report(run_comparison(num_warmup, num_steps), run_bubbles(num_warmup, num_steps), num_steps)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(run_and_report(args.warmup, args.steps))
