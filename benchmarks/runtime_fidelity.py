"""Measured vs simulated iteration time on local CPU ranks, per plan, from costs measured on this machine.

Run: python benchmarks/runtime_fidelity.py [--steps 5] [--warmup 1] [--write]

Each plan is made by the DAPPLE planner for a forced layout and micro-batch count from a chain measured
in this process, then run with ``fxpipe.compile(plan=...)`` on N forked gloo ranks (1 thread each) in
rounds: rank 0 measures the chain (``fxpipe.passes.measure_costs``, one thread, turned into a cost
graph and chain) while the ranks on the other cores keep them busy with the model's forward + backward,
as in a step (``chain_under_load``), then every rank runs warm-up and timed ``step`` calls (no
optimizer step, as the simulator models it), then every rank runs the whole model's forward + backward
side by side (``EAGER_RUNS`` times: the spread of device speeds); after the last round rank 0 measures
the chain once more. Each round is simulated (``parse_cluster("local:N")``, link figures from fxpipe's
cached gloo calibration) with the chains measured just before and just after it, and compared with that
round's median step; the table gives the medians over rounds. This shared VM's speed drifts by 20% or
more within seconds (one chain, measured eight times back to back, summed to 39-53 ms and eager
forward + backward of the same model to 38-64 ms), so a chain measured minutes, or even one run, away
from the steps it predicts is off by as much as the target. "chain F+B" is the whole model's
forward + backward at 4 rows over the plan's chains; "eager F+B" the median of the side-by-side runs.

Two simulations per round: "chain speed" is ``fxpipe.sim.simulate.simulate``, every device at the chain's
speed; "speed spread" is ``fxpipe.sim.stragglers.expected_iteration_time`` (64 seeded draws), every device
drawing its own speed factor per step from the spread the side-by-side runs showed (each rank's runs
summed over windows about one step long, each window over its round's mean; "speed spread max/min" is
the slowest window over the fastest). Two ranks timing the same forward + backward side by side for a
second at a time were up to 1.46x apart here, and which one was slow changed from round to round; a
synchronous step waits for the slower one. The error and the 20% verdict use the speed-spread figure.

What the model covers: measured block costs (blocks timed in training order, empty-block overhead timed
in the same rounds), ranks sharing too few cores compute at cores/ranks speed (4 ranks on 2 cores: 2x),
one packed message per peer per micro-batch and its cost to both ranks, gloo send/recv latency and
bandwidth calibrated as medians
of a two-rank ping and gloo's allreduce calibrated on its own (``Cluster.intra_host_collective``),
each stage's gradient allreduce, the tied embedding's allreduce across its stages once every holder is
ready, and the spread of device speeds. What it does not cover, as measured on this VM: with 4 ranks
on 2 cores, the CPU time a straight pipeline's forward + backward took (thread CPU time per action) was
1.3-1.8x the chain measured just before in two of three rounds (1.04-1.19x in the third), so fair sharing
at cores/ranks speed is optimistic there; the cause is not found (4 ranks on 2 cores passing tokens
round a ring, each computing an MLP forward + backward per token, used the same CPU time per unit of
work as one process alone, and chains measured under the full 4-rank load scattered too widely to
use); the 8-byte loss sum that ends every step (0.3-1 ms). Pinning each rank's threads to a core of its
own changed nothing measurable (two plans, one run each way).

Zero-bubble plans split each stage's backward (B, then W; stage 0 keeps its backward whole); the
simulator charges the split's own cost as calibrated on this machine (``Cluster.split_backward_overhead``,
see docs/zero_bubble.md). Replicated stages all-reduce their gradients in the planner's default
buckets, launched as the last backward produces them (the simulator's overlap model). The second
table sets the two schedules side by side on the same layout: what the simulator predicts, what
the steps measured, and what ``schedule="auto"`` picks.

Each message also costs its two ranks time of their own (``Cluster.message_overhead_s``, calibrated
with the gloo ping: packing and posting right after some compute): in steps of the 1:1 M=4 plan a send
took 0.74-0.88 ms (a 0.17-0.21 ms pack of 256 KB and 0.28-0.36 ms in ``batch_isend_irecv``) and a receive
0.34-0.56 ms, about 2-4x what the same calls took back to back without compute in between.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
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
from fxpipe.core import meta  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/runtime_fidelity.py --write"
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 16, 4)
TARGET_ERROR = 0.20
NEW_SCHEDULE_TARGET = 0.15  # issue 13: zero-bubble and overlapped-allreduce plans within 15%
# Measured zero-bubble / early backward this close to 1 is a tie: the median step moves more between runs.
MEASURED_TIE = 0.02
EAGER_RUNS = 9  # whole-model forward + backward per rank and round, for the speed spread
STRAGGLER_DRAWS = 64


@dataclass(frozen=True)
class PlanCase:
    """One plan to check: ranks, forced layout, micro-batch count and schedule."""

    num_ranks: int
    layout: str
    num_microbatches: int
    schedule: str = "early_backward"

    def __str__(self) -> str:
        suffix = "" if self.schedule == "early_backward" else f" {self.schedule}"
        return f"local:{self.num_ranks} {self.layout} M={self.num_microbatches}{suffix}"


# Replicated stages (dp, 2:2) all-reduce in the planner's default buckets, overlapping the last backward.
DEFAULT_CASES = (PlanCase(2, "1:1", 4), PlanCase(2, "1:1", 8), PlanCase(2, "1:1", 8, "zero_bubble"),
                 PlanCase(2, "dp", 2), PlanCase(4, "1:1:1:1", 8), PlanCase(4, "1:1:1:1", 8, "zero_bubble"),
                 PlanCase(4, "2:2", 4))


def measured_chain(workload: Workload, max_blocks: int | None = 64) -> Any:
    """The workload's cost chain with block times measured here, on one thread (``max_blocks``: as in
    :func:`fxpipe.core.chain.build_chain`; None keeps every block the graph allows)."""
    from fxpipe import passes
    from fxpipe.core.chain import build_chain

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run one thread each
    try:
        model, example_inputs = workload.build()
        annotated = passes.annotate_costs(passes.trace(model, example_inputs))
        measured = passes.measure_costs(annotated, annotated.meta[meta.EXAMPLE_INPUTS])
        return build_chain(passes.to_cost_graph(annotated, measured=measured), max_blocks=max_blocks)
    finally:
        torch.set_num_threads(previous)


def make_plan(chain: Any, case: PlanCase, global_batch_size: int, schedule: str | None = None) -> Any:
    """The DAPPLE planner's plan for the case's forced layout, micro-batch count and schedule (or ``schedule``)."""
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.passes.partition.dapple import partition

    cluster = parse_cluster(f"local:{case.num_ranks}")
    return partition(chain, cluster, global_batch_size, layout=case.layout, num_microbatches=case.num_microbatches,
                     schedule=schedule or case.schedule)


def simulated(plan: Any, chain: Any, num_ranks: int, spread: Any) -> Any:
    """``plan`` simulated on ``chain``'s costs: deterministic and with device speeds drawn from ``spread``."""
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.sim.stragglers import expected_iteration_time

    return expected_iteration_time(plan, chain, parse_cluster(f"local:{num_ranks}"), spread, draws=STRAGGLER_DRAWS)


def speed_spread(eager_by_rank: list[list[list[float]]], step_s: float) -> Any:
    """The spread of device speeds from every rank's side-by-side whole-model runs, per round.

    Each rank's runs are summed over windows about one step long (a device keeps its speed for a
    step); each window is divided by the mean of its round, so drift between rounds (which the
    chains measured around each round already follow) is not counted as spread.
    """
    from fxpipe.sim.stragglers import SpeedSpread

    num_rounds = len(eager_by_rank[0])
    one_run = median([t for rank in eager_by_rank for times in rank for t in times])
    window = max(1, min(EAGER_RUNS, round(step_s / one_run)))
    factors: list[float] = []
    for round_index in range(num_rounds):
        sums = [sum(times[i:i + window]) for rank in eager_by_rank
                for times in [rank[round_index]] for i in range(0, len(times) - window + 1, window)]
        factors.extend(SpeedSpread.from_times(sums).factors)
    return SpeedSpread.from_times(factors, f"{len(factors)} windows of {window} whole-model F+B runs")


def fidelity_rank(rank: int, world_size: int, plan_json: str, workload: Workload, num_rounds: int,
                  num_warmup: int, num_steps: int) -> dict[str, Any]:
    """Rounds of (rank 0 measures the chain under load; every rank runs steps, then the whole model), chain at the end.

    Returns the chains (rank 0), each round's step times and each round's whole-model forward +
    backward times, run on every rank side by side (the spread of device speeds).
    """
    import torch.distributed as dist

    import fxpipe
    from fxpipe.core.plan import Plan
    from fxpipe.passes.profile import run_once

    plan = Plan.from_json(plan_json)
    model, example_inputs = workload.build()
    pipe = fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(),
                          global_batch_size=workload.global_batch_size, plan=plan)
    inputs, targets = workload.batch()
    params = list(pipe.parameters())

    def step() -> None:
        zero_grads(params)
        pipe.step(inputs, targets)

    reference, _ = workload.build()  # eager forward + backward of the whole model: "eager F+B" and the spread
    reference_rows = [inputs[0][: workload.global_batch_size // workload.num_microbatches]]
    chains, rounds, eager = [], [], []
    for round_index in range(num_rounds + 1):
        dist.barrier()
        chain = chain_under_load(rank, world_size, workload, round_index)
        if chain is not None:
            chains.append(chain)
        if round_index == num_rounds:
            dist.barrier()  # rank 0 holds the store: it must not leave while a busy rank still polls it
            break
        for _ in range(num_warmup):
            from_common_start(step)
        rounds.append([from_common_start(step) for _ in range(num_steps)])
        dist.barrier()  # every rank times the same whole model side by side: the spread of device speeds
        eager.append([sum(run_once(reference, reference_rows)) for _ in range(EAGER_RUNS)])
    return {"chains": chains, "rounds": rounds, "eager_s": eager}


def from_common_start(step: Callable[[], None]) -> float:
    """Seconds of ``step`` on this rank after a barrier; every rank leaves a step together (its loss sum)."""
    import torch.distributed as dist

    dist.barrier()
    return timed(step, barrier=False)


def chain_under_load(rank: int, world_size: int, workload: Workload, round_index: int) -> Any:
    """Rank 0 measures the chain while ranks 1..cores-1 keep their cores busy; the chain on rank 0, else None.

    In a step every core computes at once; a chain measured on one core of an otherwise idle VM ran
    ~25% faster than the same blocks inside the steps (busy neighbour cores, and a host that clocks
    one busy core higher than several). So the measurement runs under the same load: the busy ranks
    loop the model's forward + backward until rank 0 is done. Ranks beyond the core count wait.
    """
    import torch.distributed as dist

    from fxpipe.core.cluster import usable_cores
    from fxpipe.passes.profile import run_once

    store = dist.distributed_c10d._get_default_store()  # the rendezvous store: a flag without any collective
    key = f"fxpipe-bench-chain-{round_index}"
    if rank == 0:
        chain = measured_chain(workload)
        store.set(key, "done")
        return chain
    if rank < min(world_size, usable_cores()):
        model, _ = workload.build()
        inputs, _ = workload.batch()
        rows = workload.global_batch_size // workload.num_microbatches
        while not store.check([key]):
            run_once(model, [inputs[0][:rows]])
    store.wait([key])
    return None


def run(workload: Workload, cases: tuple[PlanCase, ...] = DEFAULT_CASES, *, num_warmup: int = 1,
        num_steps: int = 5, num_rounds: int = 8) -> dict[str, Any]:
    from fxpipe.sim.stagecost import compute_times

    rows_per_microbatch = workload.global_batch_size // workload.num_microbatches
    rows = []
    for case in cases:
        chain = measured_chain(workload)
        plan = make_plan(chain, case, workload.global_batch_size)
        auto = make_plan(chain, case, workload.global_batch_size, "auto").schedule
        ranks = run_ranks(fidelity_rank, case.num_ranks, plan.to_json(), replace(workload), num_rounds, num_warmup,
                          num_steps)
        chains, rounds = ranks[0]["chains"], ranks[0]["rounds"]
        round_meas = [median(times) for times in rounds]
        spread = speed_spread([r["eager_s"] for r in ranks], median(round_meas))
        at_chain = [simulated(plan, chain, case.num_ranks, spread) for chain in chains]
        # Each round against the chains measured just before and just after it (the VM's speed drifts).
        round_sim = [(at_chain[r].deterministic_s + at_chain[r + 1].deterministic_s) / 2 for r in range(num_rounds)]
        round_expected = [(at_chain[r].mean_s + at_chain[r + 1].mean_s) / 2 for r in range(num_rounds)]
        simulated_s, expected_s, measured_s = median(round_sim), median(round_expected), median(round_meas)
        rows.append({"case": case, "cuts": [(s.first_block, s.stop_block) for s in plan.stages], "auto": auto,
                     "allreduce": allreduce_note(plan),
                     "simulated_s": simulated_s, "expected_s": expected_s, "measured_s": measured_s,
                     "spread": spread,
                     "round_errors": [(m - s) / m for s, m in zip(round_expected, round_meas, strict=True)],
                     "chain_s": [sum(compute_times(c, 0, c.num_blocks, rows_per_microbatch)) for c in chains],
                     "eager_s": median([t for r in ranks for times in r["eager_s"] for t in times]),
                     "deterministic_error": (measured_s - simulated_s) / measured_s,
                     "error": (measured_s - expected_s) / measured_s})
    return {"workload": workload, "num_steps": num_steps, "num_rounds": num_rounds,
            "num_blocks": chains[0].num_blocks, "rows": rows, "split_overhead": split_overhead()}


def allreduce_note(plan: Any) -> str:
    """How the plan sums gradients: nothing to sum, after the last backward, or in buckets overlapping it."""
    if all(stage.replicas == 1 for stage in plan.stages):
        return "none"
    if plan.allreduce_bucket_bytes:
        return f"overlapped, {plan.allreduce_bucket_bytes // 2**10} KiB buckets"
    return "after backward"


def split_overhead() -> float:
    """The calibrated ``Cluster.split_backward_overhead`` the plans were simulated with."""
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
    from fxpipe.core.cluster import parse_cluster

    return float(parse_cluster("local:2").split_backward_overhead)


def schedule_pairs(rows: list[dict[str, Any]]) -> list[list[str]]:
    """Zero-bubble against early backward on the same ranks, layout and M: predicted and measured ratios."""
    by_plan = {(r["case"].num_ranks, r["case"].layout, r["case"].num_microbatches, r["case"].schedule): r
               for r in rows}
    table = []
    for (ranks, layout, num_microbatches, schedule), zb in by_plan.items():
        eb = by_plan.get((ranks, layout, num_microbatches, "early_backward"))
        if schedule != "zero_bubble" or eb is None:
            continue
        predicted, measured = zb["expected_s"] / eb["expected_s"], zb["measured_s"] / eb["measured_s"]
        if abs(measured - 1) <= MEASURED_TIE:
            verdict = f"measured a tie (within {MEASURED_TIE:.0%})"
        else:
            verdict = "yes" if (predicted < 1) == (measured < 1) else "NO"
        table.append([f"local:{ranks} {layout} M={num_microbatches}", f"{predicted:.3f}", f"{measured:.3f}",
                      zb["auto"], verdict])
    return table


def report(result: dict[str, Any]) -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f}"

    table = [[str(r["case"]), " ".join(f"[{a},{b})" for a, b in r["cuts"]), r["allreduce"],
              f"{ms(min(r['chain_s']))}-{ms(max(r['chain_s']))}", ms(r["eager_s"]), f"{r['spread'].max_ratio:.2f}",
              ms(r["simulated_s"]), ms(r["expected_s"]), ms(r["measured_s"]),
              f"{r['deterministic_error'] * 100:+.1f} %", f"{r['error'] * 100:+.1f} %",
              " ".join(f"{e * 100:+.0f}" for e in r["round_errors"]),
              "yes" if abs(r["error"]) <= TARGET_ERROR else "NO"] for r in result["rows"]]
    num_met = sum(abs(r["error"]) <= TARGET_ERROR for r in result["rows"])
    new = [r for r in result["rows"] if r["case"].schedule == "zero_bubble" or r["allreduce"].startswith("overlapped")]
    num_new_met = sum(abs(r["error"]) <= NEW_SCHEDULE_TARGET for r in new)
    return "\n".join([
        "# Runtime fidelity: measured vs simulated iteration time", "",
        f"Command: `{COMMAND}`", "", f"Workload: {result['workload'].describe()} (M per plan below); chain of "
        f"{result['num_blocks']} measured blocks.", "", f"Machine: {machine_notes()}.", "",
        tabulate(table, ["plan", "stage blocks", "gradient allreduce", "chain F+B ms (min-max)", "eager F+B ms", "speed spread max/min",
                         "simulated ms (chain speed)", "simulated ms (speed spread)", "measured ms",
                         "error vs chain speed", "error (meas - sim) / meas", "per-round errors %",
                         f"within {TARGET_ERROR:.0%}"], tablefmt="github"), "",
        f"{num_met} of {len(table)} plans within {TARGET_ERROR:.0%}: medians over {result['num_rounds']} rounds "
        f"of {result['num_steps']} steps each; {num_new_met} of {len(new)} plans with the new schedules "
        f"(zero-bubble, overlapped allreduce) within {NEW_SCHEDULE_TARGET:.0%}.", "",
        "Zero-bubble against early backward (simulated with the speed spread; the split backward's overhead "
        f"calibrated on this machine: {result['split_overhead']:.2f} of a fused backward), and the schedule "
        "`schedule=\"auto\"` picks for the same layout and M from the first chain:", "",
        tabulate(schedule_pairs(result["rows"]), ["plan", "simulated zero-bubble / early backward",
                                                  "measured zero-bubble / early backward", "auto picks",
                                                  "prediction on the measured side of 1"], tablefmt="github"),
        "", __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__, RESULTS,
               lambda warmup, steps: report(run(DEFAULT_WORKLOAD, num_warmup=warmup, num_steps=steps)),
               steps=5, warmup=1)


if __name__ == "__main__":
    main()
