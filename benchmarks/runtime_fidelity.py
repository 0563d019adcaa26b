"""Measured vs simulated iteration time on local CPU ranks, per plan, from costs measured on this machine.

Run: python benchmarks/runtime_fidelity.py [--steps 5] [--warmup 2] [--write]

The chain's block times come from ``fxpipe.passes.measure_costs`` (one thread, this process) turned into
a cost graph (``to_cost_graph(measured=...)``) and chain (``build_chain``); the cluster is
``parse_cluster("local:N")`` (link figures from fxpipe's cached gloo calibration). Each plan is made by
the DAPPLE planner for a forced layout and micro-batch count, simulated with ``fxpipe.simulate.simulate``
and then run with ``fxpipe.compile(plan=...)`` on N forked gloo ranks (1 thread each); the measured
figure is the median ``step`` time (no optimizer step, as the simulator models it). The chain is measured
again right before each plan runs ("chain F+B": the whole model's forward + backward at 4 rows), because
this shared VM's speed drifts between minutes. "sim. compute" is the busiest device's compute in the
simulation; "meas. compute" the busiest rank's forward + backward time in one more step recorded with
``pipe.measure = "timeline"``.

What the model covers: measured block costs (blocks timed in training order, empty-block overhead timed
in the same rounds), ranks sharing too few cores compute at cores/ranks speed (4 ranks on 2 cores: 2x),
one packed message per peer per micro-batch, calibrated gloo latency and bandwidth. What it does not:
on this VM a receive posted after its message was sent still waits 3-10 ms now and then (seen in
per-action timelines of this session; the cause, likely waking the sender's gloo thread, was not
pinned down), and forward/backward
inside a two-stage pipeline ran 15-35% slower than the same blocks timed alone, while pure data
parallelism ran at the timed speed. Three runs with this code gave 1, 0 and 2 of the 5 plans within
20% (this table is the third); the dp plan is the one that usually is.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    Workload,
    bench_main,
    machine_notes,
    median,
    run_ranks,
    timed,
    zero_grads,
)

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/runtime_fidelity.py --write"
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 16, 4)
TARGET_ERROR = 0.20


@dataclass(frozen=True)
class PlanCase:
    """One plan to check: ranks, forced layout and micro-batch count."""

    num_ranks: int
    layout: str
    num_microbatches: int

    def __str__(self) -> str:
        return f"local:{self.num_ranks} {self.layout} M={self.num_microbatches}"


DEFAULT_CASES = (PlanCase(2, "1:1", 4), PlanCase(2, "1:1", 8), PlanCase(2, "dp", 2),
                 PlanCase(4, "1:1:1:1", 8), PlanCase(4, "2:2", 4))


def measured_chain(workload: Workload) -> Any:
    """The workload's cost chain with block times measured here, on one thread."""
    from fxpipe import passes
    from fxpipe.passes.chain import build_chain

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run one thread each
    try:
        model, example_inputs = workload.build()
        annotated = passes.annotate_costs(passes.trace(model, example_inputs))
        measured = passes.measure_costs(annotated, annotated.meta["fxpipe.example_inputs"])
        return build_chain(passes.to_cost_graph(annotated, measured=measured))
    finally:
        torch.set_num_threads(previous)


def make_plan(chain: Any, case: PlanCase, global_batch_size: int) -> tuple[Any, float, float]:
    """The planner's plan for the case's layout, its simulated iteration seconds and largest device compute."""
    from fxpipe.cluster import parse_cluster
    from fxpipe.passes.partition import partition
    from fxpipe.simulate import simulate

    cluster = parse_cluster(f"local:{case.num_ranks}")
    plan = partition(chain, cluster, global_batch_size, layout=case.layout, num_microbatches=case.num_microbatches)
    result = simulate(plan, chain, cluster, timeline=False)
    return plan, result.iteration_time_s, max(result.busy_s)


def fidelity_rank(rank: int, world_size: int, plan_json: str, workload: Workload, num_warmup: int,
                  num_steps: int) -> list[float]:
    """Step times of the plan on this rank (between barriers, so every rank reports the iteration)."""
    import fxpipe
    from fxpipe.plan import Plan

    plan = Plan.from_json(plan_json)
    model, example_inputs = workload.build()
    pipe = fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(),
                          global_batch_size=workload.global_batch_size, plan=plan)
    inputs, targets = workload.batch()
    params = list(pipe.parameters())

    def step() -> None:
        zero_grads(params)
        pipe.step(inputs, targets)

    for _ in range(num_warmup):
        timed(step)
    times = [timed(step) for _ in range(num_steps)]
    pipe.measure = "timeline"  # one more step with a timeline (no saved-tensor hooks: they slow CPU steps)
    step()
    stats = pipe.step_stats()
    compute_s = max(sum(e.end_s - e.start_s for e in s.events if e.op in ("F", "B")) for s in stats)
    return [*times, compute_s]


def run(workload: Workload, cases: tuple[PlanCase, ...] = DEFAULT_CASES, *, num_warmup: int = 2,
        num_steps: int = 5) -> dict[str, Any]:
    from fxpipe.stagecost import compute_times

    rows_per_microbatch = workload.global_batch_size // workload.num_microbatches
    rows = []
    for case in cases:
        # Measured right before the plan runs: this shared VM's speed drifts by 10-30% over minutes.
        chain = measured_chain(workload)
        plan, simulated_s, simulated_compute_s = make_plan(chain, case, workload.global_batch_size)
        *times, compute_s = run_ranks(fidelity_rank, case.num_ranks, plan.to_json(), replace(workload), num_warmup,
                                      num_steps)[0]
        measured_s = median(times)
        rows.append({"case": case, "cuts": [(s.first_block, s.stop_block) for s in plan.stages],
                     "simulated_s": simulated_s, "measured_s": measured_s, "best_s": min(times),
                     "compute_s": compute_s, "simulated_compute_s": simulated_compute_s,
                     "chain_s": sum(compute_times(chain, 0, chain.num_blocks, rows_per_microbatch)),
                     "error": (measured_s - simulated_s) / measured_s})
    return {"workload": workload, "num_steps": num_steps, "num_blocks": chain.num_blocks, "rows": rows}


def report(result: dict[str, Any]) -> str:
    table = [[str(r["case"]), " ".join(f"[{a},{b})" for a, b in r["cuts"]), f"{r['chain_s'] * 1e3:.1f}",
              f"{r['simulated_s'] * 1e3:.1f}",
              f"{r['measured_s'] * 1e3:.1f}", f"{r['best_s'] * 1e3:.1f}", f"{r['error'] * 100:+.1f} %",
              "yes" if abs(r["error"]) <= TARGET_ERROR else "NO",
              f"{r['simulated_compute_s'] * 1e3:.1f}", f"{r['compute_s'] * 1e3:.1f}"] for r in result["rows"]]
    num_met = sum(abs(r["error"]) <= TARGET_ERROR for r in result["rows"])
    return "\n".join([
        "# Runtime fidelity: measured vs simulated iteration time", "",
        f"Command: `{COMMAND}`", "", f"Workload: {result['workload'].describe()} (M per plan below); chain of "
        f"{result['num_blocks']} measured blocks.", "", f"Machine: {machine_notes()}.", "",
        tabulate(table, ["plan", "stage blocks", "chain F+B ms", "simulated ms", "measured median ms", "measured best ms",
                         "error (meas - sim) / meas", f"within {TARGET_ERROR:.0%}", "sim. compute ms",
                         "meas. compute ms"], tablefmt="github"), "",
        f"{num_met} of {len(table)} plans within {TARGET_ERROR:.0%} (median of {result['num_steps']} steps each).",
        "", __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__, RESULTS,
               lambda warmup, steps: report(run(DEFAULT_WORKLOAD, num_warmup=warmup, num_steps=steps)),
               steps=5, warmup=2)


if __name__ == "__main__":
    main()
