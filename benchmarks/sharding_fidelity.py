"""What sharding a stage's replicas costs per step on real CPU ranks, against what the model charges for it.

Run: python benchmarks/sharding_fidelity.py [--steps 12] [--warmup 2] [--rounds 3] [--write]

One stage of 2 replicas (pure data parallelism: the sharding traffic is all there is between the ranks),
planned once by DAPPLE and run at every level (``force_sharding``: none, optimizer, gradients, parameters)
with the same batch and micro-batches. Each round forks 2 gloo ranks (1 thread each) that

1. measure the link as calibration does (``measure_pair_link``: send/recv; a two-rank allreduce,
   reduce-scatter and all-gather, each fitted to latency and bandwidth; message overhead; the overlap
   cost), the figures the simulator then runs on;
2. compile the four plans;
3. time, interleaved step by step, each level's step (``pipe.step`` with ``zero_grad``, no optimizer: a
   step's collectives do not depend on it), the same step with FSDP2's collectives clocked (for (b) only: the
   clock's barriers cost time of their own) and the bare collectives of the stage's byte counts on the same
   group: the allreduce of its gradient bytes G (what ``none`` sums), the reduce-scatter of G and the
   all-gather of its weight bytes W, as FSDP2 calls them (``reduce_scatter_single``/``all_gather_single``
   of one flat buffer); medians of the slower rank.

Models, all on the figures the ranks just measured: "own RS/AG", each of the reduce-scatter and the
all-gather on its own calibrated link (docs/clusters.md), "+ FSDP2 flat per call", the same plus one figure of
FSDP2's host time per collective call (``Cluster.fsdp_call_overhead_s``), and "+ FSDP2 per kind and bytes
(now)", that time per kind and by each unit's bytes (``Cluster.fsdp_calls``, both calibrated by
:mod:`fxpipe.runtime.calibration.calibrate_fsdp` in the same ``measure_pair_link``: its copies into and out of
flat buffers, allocations and hooks, which the bare collectives do not make). Two comparisons per level, errors (measured - model) / measured:

- (a) the step's extra time over ``none``: measured step(level) - step(none) against the simulator's
  iteration(level) - iteration(none) on the cluster the ranks just measured (the same chain, measured
  here before the ranks start);
- (b) the level's collectives alone against ``ShardingComm.step_seconds(M)`` (:mod:`fxpipe.sim.sharding_cost`):
  FSDP2's own collectives timed inside the steps (:class:`CollectiveClock`), and the bare collectives'
  medians times the level's counts per step (docs/sharding.md: optimizer 1 AG + 1 RS, gradients 1 AG +
  M RS, parameters 2M AG + M RS; the clock checks the counts).

Medians over rounds of each round's medians.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    Workload,
    interleaved,
    machine_notes,
    median,
    run_ranks,
    zero_grads,
)
from benchmarks.kept_notes import write_keeping_notes  # noqa: E402
from benchmarks.overlap_fidelity import local_cluster_from  # noqa: E402
from benchmarks.runtime_fidelity import measured_chain  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/sharding_fidelity.py --write"
LEVELS = ("none", "optimizer", "gradients", "parameters")
TARGET_ERROR = 0.20
# ~15 MB of weights next to little compute (2 rows of 16 tokens per micro-batch, 1 per replica): the
# collectives are tens of milliseconds each, far above the noise of a shared 2-core machine.
WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 256), ("block_size", 16)), 8, 4)
# Collectives per step of M micro-batches (all-gathers of W, reduce-scatters of G), FSDP2's counts.
COUNTS = {"optimizer": (lambda m: 1, lambda m: 1), "gradients": (lambda m: 1, lambda m: m),
          "parameters": (lambda m: 2 * m, lambda m: m)}


def bare_collectives(weight_bytes: int, gradient_bytes: int) -> dict[str, Any]:
    """The bare collectives of the stage's byte counts on the default group, as calls the step loop times
    beside the levels' steps (so they run under the same load): the allreduce and the reduce-scatter of
    the gradient bytes, the all-gather of the weight bytes, each of one flat buffer."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    gradient_shard = torch.empty(gradient_bytes // 4 // world)
    gradients = torch.zeros(gradient_shard.numel() * world)
    weight_shard = torch.zeros(weight_bytes // 4 // world)
    weights = torch.empty(weight_shard.numel() * world)
    # bound now: the CollectiveClock wraps torch.distributed's functions later, for FSDP2's calls only
    return {"allreduce": partial(dist.all_reduce, gradients),
            "reduce_scatter": partial(dist.reduce_scatter_single, gradient_shard, gradients),
            "all_gather": partial(dist.all_gather_single, weights, weight_shard)}


class CollectiveClock:
    """Seconds and calls of FSDP2's collectives inside the steps: ``torch.distributed.all_gather_single`` and
    ``reduce_scatter_single`` wrapped (FSDP2 calls both synchronously on CPU, one per unit and step), each
    after a barrier on its group (not timed), so the time is the transfer, not a wait for the peer.

    Only while ``enabled``: the barriers cost a step time of their own (up to a millisecond or more each on
    gloo after compute), so the steps (a) compares run with the clock off, and separate clocked steps of the
    same levels, interleaved with them, give (b)'s in-step collectives. Until 2026-12-04 one set of steps did
    both, and (a)'s measured extra included a barrier per FSDP2 collective."""

    NAMES = ("all_gather", "reduce_scatter")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.enabled = False
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.calls = dict.fromkeys(self.NAMES, 0)
        for name in self.NAMES:
            setattr(dist, f"{name}_single", self._timed(name, getattr(dist, f"{name}_single")))

    def _timed(self, name: str, call: Any) -> Any:
        import torch.distributed as dist

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return call(*args, **kwargs)
            dist.barrier(group=kwargs.get("group"))
            start = time.perf_counter()
            work = call(*args, **kwargs)
            if work is not None:
                work.wait()
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return work

        return timed_call

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.calls = dict.fromkeys(self.NAMES, 0)


def sharding_rank(rank: int, world_size: int, plans: dict[str, str], workload: Workload, weight_bytes: int,
                  gradient_bytes: int, num_warmup: int, num_steps: int) -> dict[str, Any]:
    import torch

    import fxpipe
    from fxpipe.core.plan import Plan
    from fxpipe.runtime.calibration.calibrate_measure import measure_pair_link

    figures = measure_pair_link(rank, torch.device("cpu"), None)
    bare = bare_collectives(weight_bytes, gradient_bytes)
    inputs, targets = workload.batch()
    steps, in_step = {}, {}
    for name, plan_json in plans.items():
        model, example_inputs = workload.build()
        pipe = fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(),
                              global_batch_size=workload.global_batch_size, plan=Plan.from_json(plan_json))
        params = list(pipe.parameters())
        in_step[name] = []

        def step(pipe: Any = pipe, params: list[Any] = params) -> None:  # as a user's step runs: no clock
            zero_grads(params)
            pipe.step(inputs, targets)

        def clocked_step(pipe: Any = pipe, params: list[Any] = params, record: list[Any] = in_step[name]) -> None:
            zero_grads(params)
            clock.reset()
            clock.enabled = True
            try:
                pipe.step(inputs, targets)
            finally:
                clock.enabled = False
            record.append((sum(clock.seconds.values()), dict(clock.calls)))

        steps[name] = step
        steps[f"{name} clocked"] = clocked_step
    clock = CollectiveClock()  # after compile (its own collectives) and measuring: the steps' collectives only
    times = interleaved({**steps, **bare}, num_warmup, num_steps)
    return {"figures": figures, "collectives": {name: median(times[name]) for name in bare}, "times": times,
            "in_step": {name: median([seconds for seconds, _ in records[-num_steps:]]) for name, records in in_step.items()},
            "calls": {name: records[-1][1] for name, records in in_step.items()}}


def error(measured: float, model: float) -> float:
    return (measured - model) / measured if measured else float("nan")


def run(num_rounds: int, num_warmup: int, num_steps: int, workload: Workload = WORKLOAD) -> dict[str, Any]:
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.core.fsdp_calls import fsdp_calls_from_figures
    from fxpipe.core.sharding import force_sharding
    from fxpipe.passes.partition.dapple import partition
    from fxpipe.sim.sharding_cost import half_collective_time, plan_sharding_comms
    from fxpipe.sim.simulate import simulate
    from fxpipe.sim.stagecost import gradient_allreduce_time, own_allreduce_bytes, stage_param_bytes

    chain = measured_chain(workload)
    base = partition(chain, parse_cluster("local:2"), workload.global_batch_size, layout="dp",
                     num_microbatches=workload.num_microbatches)
    plans = {level: force_sharding(base, level) for level in LEVELS}
    (stage,) = base.stages
    bounds = [(stage.first_block, stage.stop_block)]
    weight_bytes = stage_param_bytes(chain, *bounds[0])
    (gradient_bytes,) = own_allreduce_bytes(chain, bounds)
    num_micro = base.num_microbatches
    rounds = []
    for _ in range(num_rounds):
        ranks = run_ranks(sharding_rank, 2, {name: plan.to_json() for name, plan in plans.items()}, workload,
                          weight_bytes, gradient_bytes, num_warmup, num_steps)
        # no optimizer runs in these steps: leave any calibrated optimizer time out of the simulation too
        calibrated = replace(local_cluster_from(ranks[0]["figures"]), optimizer_s_per_param_byte=0.0)
        steps = {level: median([max(pair) for pair in zip(*(r["times"][level] for r in ranks), strict=True)])
                 for level in LEVELS}
        bare = {name: max(r["collectives"][name] for r in ranks) for name in ranks[0]["collectives"]}
        in_loop = links_from_bare(calibrated, bare, weight_bytes, gradient_bytes, len(stage.devices))
        # FSDP2's host time per call as calibration measured it: one flat figure, and the fit per kind and bytes
        call_s, fit = ranks[0]["figures"]["fsdp_call_overhead"], fsdp_calls_from_figures(ranks[0]["figures"])
        models = {"calibrated": calibrated, "calls": replace(calibrated, fsdp_call_overhead_s=call_s),
                  "fit": replace(calibrated, fsdp_calls=fit), "fit_loop": replace(in_loop, fsdp_calls=fit)}
        modelled = {}
        for model_name, cluster in models.items():
            modelled[model_name] = {
                "simulated": {level: simulate(plan, chain, cluster).iteration_time_s for level, plan in plans.items()},
                "charged": {level: plan_sharding_comms(plan, chain, cluster)[0].step_seconds(num_micro)
                            for level, plan in plans.items()},
                "bare": {"allreduce": gradient_allreduce_time(cluster, gradient_bytes, stage.devices),
                         "reduce_scatter": half_collective_time(
                             cluster, gradient_bytes, stage.devices,
                             cluster.collective_link(stage.devices, "reduce_scatter")),
                         "all_gather": half_collective_time(cluster, weight_bytes, stage.devices,
                                                            cluster.collective_link(stage.devices, "all_gather"))}}
        in_step = {level: max(r["in_step"][level] for r in ranks) for level in LEVELS}
        rounds.append({"figures": ranks[0]["figures"], "steps": steps, "bare": bare, "models": modelled,
                       "in_step": in_step, "calls": ranks[0]["calls"]})
    return {"workload": workload, "rounds": rounds, "weight_bytes": weight_bytes, "gradient_bytes": gradient_bytes,
            "num_microbatches": num_micro, "num_rounds": num_rounds, "num_steps": num_steps,
            "num_warmup": num_warmup, "plan": f"{base.layout} M={num_micro}", "num_blocks": chain.num_blocks}


# How to read the tables (mechanisms, not figures: those are in the tables).
READING = (
    "Reading. gloo's reduce-scatter is not half an allreduce (column 'measured / allreduce'), so each collective "
    "has its own calibrated link. Beyond its collectives FSDP2 spends host time at every call: it copies each "
    "unit's parameters or gradients into and out of flat buffers it allocates per call and runs its hooks in "
    "Python. That time is (a)'s measured extra less (b)'s FSDP2 collectives, divided by the calls the clock "
    "counts; the *now* models charge each call a + b x its unit's bytes, with a and b per kind fitted by "
    "calibration through two unit sizes, 17.4 KB and 2.37 MB, each unit shaped like a transformer block (12 "
    "parameter tensors: FSDP2's hooks and copies work tensor by tensor), less each unit's own bare collectives "
    "(fxpipe/runtime/calibration/calibrate_fsdp.py). The structure of the charge, which collectives run and how "
    "many per step, is what FSDP2 runs: the clock counts 1/1, 1/M and 2M/M per FSDP unit (one per transformer "
    "block and the root: 5 here; the bare collectives move the stage's whole bytes once). On a loaded shared "
    "machine every calibrated figure is a snapshot of its moment's load: compare the start and in-loop columns."
)
MODEL_NAMES = {"calibrated": "own RS/AG, start", "calls": "+ FSDP2 flat per call, start",
               "fit": "now: + FSDP2 per kind and bytes, start", "fit_loop": "now: + FSDP2 per kind and bytes, in loop"}


def links_from_bare(cluster: Any, bare: dict[str, float], weight_bytes: int, gradient_bytes: int,
                    num_ranks: int) -> Any:
    """``cluster`` with its allreduce, reduce-scatter and all-gather links re-fitted to the bare collectives
    timed in the step loop (the same moments as the steps), keeping the calibrated latencies: each bandwidth
    makes the ring formula (2 passes for the allreduce, 1 for the others) give the measured seconds."""
    from fxpipe.core.hardware import LinkSpec

    def refit(link: Any, seconds: float, num_bytes: int, passes: int) -> Any:
        steps = passes * (num_ranks - 1)
        wire_s = max(seconds - steps * link.latency_s, 1e-9)
        return LinkSpec(steps / num_ranks * num_bytes / wire_s, link.latency_s)

    devices = tuple(range(num_ranks))
    return replace(cluster,
                   intra_host_collective=refit(cluster.collective_link(devices), bare["allreduce"], gradient_bytes, 2),
                   reduce_scatter_collective=refit(cluster.collective_link(devices, "reduce_scatter"),
                                                   bare["reduce_scatter"], gradient_bytes, 1),
                   all_gather_collective=refit(cluster.collective_link(devices, "all_gather"), bare["all_gather"],
                                               weight_bytes, 1))


def _rounds_median(result: dict[str, Any], pick: Any) -> float:
    return median([pick(r) for r in result["rounds"]])


def measured_collectives(bare: dict[str, float], level: str, num_micro: int) -> float:
    """The level's collectives per step at the bare collectives' measured times."""
    gathers, scatters = COUNTS[level]
    return gathers(num_micro) * bare["all_gather"] + scatters(num_micro) * bare["reduce_scatter"]


def level_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per sharded level: measured and modelled extra step time (a) and collectives (b), medians over rounds."""
    num_micro, rows = result["num_microbatches"], []
    for level in LEVELS[1:]:
        row: dict[str, Any] = {
            "level": level,
            "step": _rounds_median(result, lambda r, level=level: r["steps"][level]),
            "extra": _rounds_median(result, lambda r, level=level: r["steps"][level] - r["steps"]["none"]),
            "bare": _rounds_median(result, lambda r, level=level: measured_collectives(r["bare"], level, num_micro)),
            "in_step": _rounds_median(result, lambda r, level=level: r["in_step"][level]),
            "calls": "/".join(str(result["rounds"][-1]["calls"][level][name]) for name in CollectiveClock.NAMES)}
        for name in MODEL_NAMES:
            row[f"extra_{name}"] = _rounds_median(result, lambda r, level=level, name=name: (
                r["models"][name]["simulated"][level] - r["models"][name]["simulated"]["none"]))
            row[f"charged_{name}"] = _rounds_median(
                result, lambda r, level=level, name=name: r["models"][name]["charged"][level])
        rows.append(row)
    return rows


def fit_text(figures: dict[str, float]) -> str:
    """Calibration's per-kind fit of FSDP2's host time (all-gather, reduce-scatter, the collective-free pass), in ms
    per call + ms per MB of the unit."""
    return "(" + ", ".join(f"{figures[f'fsdp_{kind}_call'] * 1e3:.2f} + {figures[f'fsdp_{kind}_per_byte'] * 1e9:.2f}"
                           for kind in ("all_gather", "reduce_scatter", "pass")) + ")"


def report(result: dict[str, Any], elapsed_s: float) -> str:
    def ms(seconds: float) -> str:
        return f"{1e3 * seconds:.1f}"

    def judged(measured: float, model: float) -> str:
        err = error(measured, model)
        return f"{err:+.0%} " + ("yes" if abs(err) <= TARGET_ERROR else "NO")

    rounds = result["rounds"]
    rows = level_rows(result)
    step_none = _rounds_median(result, lambda r: r["steps"]["none"])
    table_a = [[row["level"], ms(row["step"]), ms(row["extra"]),
                *[cell for name in MODEL_NAMES for cell in (ms(row[f"extra_{name}"]),
                                                           judged(row["extra"], row[f"extra_{name}"]))]]
               for row in rows]
    table_b = [[row["level"], row["calls"], ms(row["in_step"]), ms(row["bare"]),
                *[cell for name in MODEL_NAMES for cell in (ms(row[f"charged_{name}"]),
                                                           judged(row["in_step"], row[f"charged_{name}"]))]]
               for row in rows]
    bare_rows = []
    for collective in ("allreduce", "reduce_scatter", "all_gather"):
        measured = _rounds_median(result, lambda r, c=collective: r["bare"][c])
        models = [_rounds_median(result, lambda r, c=collective, n=name: r["models"][n]["bare"][c])
                  for name in MODEL_NAMES]
        bare_rows.append([collective, ms(measured),
                          f"{measured / _rounds_median(result, lambda r: r['bare']['allreduce']):.2f}",
                          *[cell for model in models for cell in (ms(model), judged(measured, model))]])
    simulated_none = {name: _rounds_median(result, lambda r, n=name: r["models"][n]["simulated"]["none"])
                      for name in MODEL_NAMES}

    def figures_of(kind: str) -> str:
        return ", ".join(f"{r['figures'][f'{kind}_bandwidth'] / 1e9:.2f} GB/s {1e6 * r['figures'][f'{kind}_latency']:.0f} us"
                         for r in rounds)

    model_headers = [cell for name in MODEL_NAMES for cell in (f"model: {MODEL_NAMES[name]} ms", "error, within 20%")]
    return "\n".join([
        "# Sharding fidelity: what ZeRO-1/2/3 cost per step on CPU ranks vs the model's charge", "",
        f"Command: `{COMMAND} --rounds {result['num_rounds']} --steps {result['num_steps']} --warmup "
        f"{result['num_warmup']}` ({elapsed_s:.0f} s wall; {result['num_rounds']} rounds of fresh ranks, each "
        f"{result['num_steps']} steps per level after {result['num_warmup']} warm-up, levels interleaved step by step; "
        "medians over rounds of the slower rank's median)", "",
        f"Workload: {result['workload'].describe()}; plan {result['plan']}, one stage of 2 replicas (pure data "
        f"parallel); stage weights W = {result['weight_bytes'] / 1e6:.2f} MB, gradients summed G = "
        f"{result['gradient_bytes'] / 1e6:.2f} MB; chain of {result['num_blocks']} measured blocks.", "",
        f"Machine: {machine_notes()}.", "",
        "Calibrated in the ranks, per round (`measure_pair_link`, bandwidth and latency of the ring fit): "
        f"allreduce {figures_of('allreduce')}; reduce-scatter {figures_of('reduce_scatter')}; all-gather "
        f"{figures_of('all_gather')}; FSDP2's host time per call, flat "
        + ", ".join(f"{r['figures']['fsdp_call_overhead'] * 1e3:.2f} ms" for r in result["rounds"])
        + "; per kind and unit bytes (all-gather, reduce-scatter, the pass without a collective: ms per call + ms per MB) "
        + ", ".join(fit_text(r["figures"]) for r in result["rounds"]) + ".", "",
        "Models: *own RS/AG* gives each collective its own calibrated link; *flat per call* adds FSDP2's host time "
        "per call as one figure (`Cluster.fsdp_call_overhead_s`); *now* adds it per kind and by each unit's bytes "
        "(`Cluster.fsdp_calls`), which (b)'s timed collectives and the bare ones leave out. *start*: the figures "
        "calibration measured at the round's start, as a planner gets them; *in loop*: the same latencies with "
        "each bandwidth re-fitted to the bare collectives timed between the steps (the same moments as the "
        "steps), which separates the calibration's drift from the model's structure.", "",
        "## (a) The step's extra time over `none`: measured vs simulated", "",
        f"Step at `none`: measured {ms(step_none)} ms, simulated "
        + ", ".join(f"{ms(value)} ms ({MODEL_NAMES[name]})" for name, value in simulated_none.items())
        + " (the simulator's compute is not under test here: the chain is measured in one process before the "
        "ranks start; the extra times below compare like with like).", "",
        str(tabulate(table_a, headers=["level", "measured step ms", "measured extra ms", *model_headers],
                     tablefmt="github")), "",
        "## (b) The level's collectives alone vs `ShardingComm.step_seconds(M)`", "",
        str(tabulate(table_b, headers=["level", "calls per step AG/RS", "FSDP2's collectives in the step ms",
                                       "bare collectives x calls ms", *model_headers],
                     tablefmt="github")), "",
        "FSDP2's collectives in the step: `all_gather_single`/`reduce_scatter_single` timed inside `pipe.step` "
        "(wrapped in the ranks, each after an untimed barrier; per step the sum over its collectives, median "
        "over steps, of the slower rank); errors against them. The *flat* and *now* charges include FSDP2's host "
        "time per call, which these timed collectives leave out, so they exceed them by construction: that time is "
        "judged in (a).", "",
        "## Bare collectives (the stage's byte counts)", "",
        str(tabulate(bare_rows, headers=["collective", "measured ms", "measured / allreduce", *model_headers],
                     tablefmt="github")), "",
        f"allreduce and reduce-scatter of G = {result['gradient_bytes'] / 1e6:.2f} MB, all-gather of W = "
        f"{result['weight_bytes'] / 1e6:.2f} MB, each of one flat buffer, timed between the steps; the model: "
        "`gradient_allreduce_time` and `half_collective_time` (each with its copies through the flat buffer, which "
        "the bare calls do not make: the in-loop models differ from them by those copies alone). Error = "
        "(measured - model) / measured.", "",
        READING, "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    text = report(run(args.rounds, args.warmup, args.steps), time.perf_counter() - start)
    print(text)
    if args.write:
        write_keeping_notes(RESULTS, text)


if __name__ == "__main__":
    main()
