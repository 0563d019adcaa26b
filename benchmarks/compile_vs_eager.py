"""Compiled (torch.compile, inductor) against eager stages on CPU ranks, fxpipe and torch.distributed.pipelining.

Run: python benchmarks/compile_vs_eager.py [--steps 10] [--warmup 2] [--write]

Method: on each world size, every rank builds the same layer-cut stages (one per rank) twice in fxpipe,
eager and with ``torch_compile=True`` (inductor, the batch dim dynamic), and, on 2 ranks, once more
compiled under the zero-bubble schedule and twice in torch.distributed.pipelining (Schedule1F1B, the same stage GraphModule eager and under ``torch.compile``
with its defaults). Each compiled system's compile is timed on its own: fxpipe compiles every stage's
forward and backward during ``fxpipe.compile`` (its setup, then its first step, are timed together),
torch in its first step (wall seconds on the slowest rank; fxpipe's own count of dynamo compile seconds
per stage next to it). Then all systems step round-robin (``--warmup`` rounds, then ``--steps``
measured), each step between two barriers, gradients set to None before each; the table gives the
median. The compiled fxpipe stages' gradients after the last step are compared with the eager ones'
(the same weights and batch: no optimizer step runs). fxpipe's ranks compile side by side at setup;
torch's compiled pipeline's first step takes about the sum of its stages' compile seconds, not their
maximum: a stage compiles when its first micro-batch arrives, after the stages before it compiled
theirs. Inductor's cache starts empty (a
fresh ``TORCHINDUCTOR_CACHE_DIR`` per run), so fxpipe's compiled stages on 2 ranks compile cold; every
later compiled system in the run may find identical graphs in it (the torch side compiles the same
stage graphs, the zero-bubble pipe and the 4-rank stages the same blocks), so their first steps are
not cold compiles.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
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
    stage_names,
    timed,
)
from benchmarks.torch_pipelining_common import build_torch_side, fxpipe_step, torch_step  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/compile_vs_eager.py --write"
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 32, 8)
WORLD_SIZES = (2, 4)
TORCH_WORLD_SIZE = 2  # torch.distributed.pipelining side on this many ranks only (compiles take minutes on 2 cores)
ZERO_BUBBLE = "fxpipe compiled, zero_bubble (split B/W)"
# a stage's first step waits for every earlier stage's cold compile (minutes on 2 busy cores): docs/compile.md
COMPILE_TIMEOUT_S = 1200.0


def _gradient_gap(compiled: Any, eager: Any) -> float:
    """Largest |compiled grad - eager grad| relative to the eager tensor's largest magnitude, over this rank."""
    eager_grads = {name: p.grad for name, p in eager.named_parameters()}
    gap = 0.0
    for name, param in compiled.named_parameters():
        reference = eager_grads[name]
        if param.grad is None or reference is None:
            raise RuntimeError(f"parameter {name} has no gradient after a step (compiled: {param.grad is None}, "
                               f"eager: {reference is None})")
        scale = max(float(reference.abs().max()), 1e-30)
        gap = max(gap, float((param.grad - reference).abs().max()) / scale)
    return gap


def compare_rank(rank: int, world_size: int, workload: Workload, num_warmup: int, num_steps: int) -> dict[str, Any]:
    """This rank's first compiled steps, then every system round-robin; seconds per step by system."""
    stages = stage_names(workload, world_size)
    eager = compile_fxpipe(workload, world_size)
    compiled, setup_s = _timed_setup(lambda: compile_fxpipe(workload, world_size, torch_compile=True,
                                                             timeout_s=COMPILE_TIMEOUT_S))
    inputs, targets = workload.batch()
    params = {id(pipe): list(pipe.parameters()) for pipe in (eager, compiled)}
    steps = {"fxpipe eager": lambda: fxpipe_step(eager, params[id(eager)], inputs, targets),
             "fxpipe compiled": lambda: fxpipe_step(compiled, params[id(compiled)], inputs, targets)}
    first = {"fxpipe compiled": setup_s + timed(steps["fxpipe compiled"])}
    refusal = None
    if world_size == TORCH_WORLD_SIZE:
        torch_eager = build_torch_side(workload, stages)
        torch_compiled = build_torch_side(workload, stages, compiled=True)
        steps["torch eager"] = lambda: torch_step(torch_eager, inputs, targets)
        steps["torch compiled"] = lambda: torch_step(torch_compiled, inputs, targets)
        first["torch compiled"] = timed(steps["torch compiled"])
        split, split_setup_s = _timed_setup(lambda: compile_fxpipe(workload, world_size, schedule="zero_bubble",
                                                                   torch_compile=True, timeout_s=COMPILE_TIMEOUT_S))
        split_params = list(split.parameters())
        steps[ZERO_BUBBLE] = lambda: fxpipe_step(split, split_params, inputs, targets)
        first[ZERO_BUBBLE] = split_setup_s + timed(steps[ZERO_BUBBLE])
        refusal = _torch_zero_bubble_refusal(workload, stages)
    times = interleaved(steps, num_warmup, num_steps)
    gap = _gradient_gap(compiled, eager)
    stats = compiled.compile_stats()  # after every step: later steps compiling again would show as more frames
    return {"times": times, "first": first, "stats": stats, "gap": gap, "refusal": refusal}


def _timed_setup(build: Any) -> tuple[Any, float]:
    """``build()`` (an fxpipe.compile, which compiles the stages) and its wall seconds."""
    started = time.perf_counter()
    pipe = build()
    return pipe, time.perf_counter() - started


def _torch_zero_bubble_refusal(workload: Workload, stages: list[list[str]]) -> str:
    """What torch.distributed.pipelining says to a zero-bubble schedule over compiled stages ('' if it runs)."""
    try:
        build_torch_side(workload, stages, "ScheduleInterleavedZeroBubble", compiled=True)
    except RuntimeError as error:  # raised alike on every rank, before any collective
        return str(error).splitlines()[0]
    return ""


def run(workload: Workload, num_warmup: int, num_steps: int) -> dict[int, list[dict[str, Any]]]:
    return {world_size: run_ranks(compare_rank, world_size, workload, num_warmup, num_steps,
                                  timeout_s=3 * COMPILE_TIMEOUT_S, group_timeout_s=COMPILE_TIMEOUT_S)
            for world_size in WORLD_SIZES}


def _rows(world_size: int, per_rank: list[dict[str, Any]]) -> list[list[str]]:
    times = per_rank[0]["times"]  # a synchronous pipeline step ends alike on every rank (barriers around it)
    eager = {system.split()[0]: median(values) for system, values in times.items() if system.endswith("eager")}
    rows = []
    for system, values in times.items():
        step_s = median(values)
        first = max(result["first"].get(system, 0.0) for result in per_rank)
        compile_s = ""
        if system == "fxpipe compiled":
            compile_s = " / ".join(f"{s.compile_s:.1f} ({s.num_frames} frame)" for s in per_rank[0]["stats"])
        rows.append([str(world_size), system, f"{step_s * 1e3:.1f}", f"{min(values) * 1e3:.1f}",
                     f"{eager[system.split()[0]] / step_s:.3f}", f"{first:.1f}" if first else "", compile_s])
    return rows


def _refusal_line(per_rank: list[dict[str, Any]] | None) -> str:
    if per_rank is None:
        return ""
    refusal = per_rank[0]["refusal"]
    said = f"refuses them: \"{refusal}\"" if refusal else "runs them"
    return (f"Zero-bubble over compiled stages: fxpipe runs it with each compiled stage cut into F, B and W graphs "
            f"(row '{ZERO_BUBBLE}'); torch.distributed.pipelining's ScheduleInterleavedZeroBubble {said}.")


def report(results: dict[int, list[dict[str, Any]]], workload: Workload, num_steps: int) -> str:
    rows = [row for world_size, per_rank in results.items() for row in _rows(world_size, per_rank)]
    gaps = ", ".join(f"{world_size} ranks {max(r['gap'] for r in per_rank):.1e}" for world_size, per_rank in results.items())
    headers = ["ranks", "system", "median step ms", "best step ms", "eager / it (speed-up)", "compile + first step s",
               "dynamo+inductor s per stage"]
    return "\n".join([
        "# Compiled vs eager stages (torch.compile, inductor)", "",
        f"Command: `{COMMAND}`", "", f"Workload: {workload.describe()}.", "",
        f"Machine: {machine_notes()}.", "",
        f"## Step times (median of {num_steps} round-robin steps after warm-up)", "",
        tabulate(rows, headers, tablefmt="github"), "",
        "'compile + first step s': fxpipe.compile, which compiles fxpipe's stages at setup, plus the first step "
        "(torch: its first step, which compiles), slowest rank; 'dynamo+inductor s "
        "per stage': the seconds fxpipe booked to each stage's compiles (its compile callbacks: "
        "`pipe.compile_stats()`). Largest gradient difference, compiled against eager fxpipe stages, relative "
        f"to each tensor's largest entry: {gaps} (inductor's float32 rounding, docs/compile.md).", "",
        _refusal_line(results.get(TORCH_WORLD_SIZE)), "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fxpipe-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # cold compiles first (the ranks fork after this)
        bench_main(argv, __doc__, RESULTS,
                   lambda warmup, steps: report(run(DEFAULT_WORKLOAD, warmup, steps), DEFAULT_WORKLOAD, steps),
                   steps=10, warmup=2)


if __name__ == "__main__":
    main()
