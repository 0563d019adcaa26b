"""Small models on local CPU ranks, where fixed per-step costs dominate: the default prediction vs measured iterations.

Run: python benchmarks/small_fidelity.py [--rounds 5] [--steps 10] [--warmup 3] [--ranks 2 4] [--write]

The sibling of benchmarks/prediction_fidelity.py for models whose blocks take microseconds: a tiny MLP
(the zoo's ``mlp``: 4 Linear+GELU layers of width 64, global batch 8) and gpt-mini at global batch 4. On
N forked gloo ranks (1 thread each) every round runs every case of that rank count in turn (interleaved,
so a burst of load on this shared VM spoils one round of every case, not every round of one): what a
user's script does, ``fxpipe.compile(model, ..., plan=LAYOUT, num_microbatches=M)`` with the default
``costs="auto"`` (blocks measured by every rank at once, the calibrated cluster), then warm-up and timed
iterations (``pipe.step``, ``AdamW.step``, ``zero_grad``; a barrier before each). "predicted" is the
plan's ``predicted.iteration_time_s``, which counts the runtime's fixed costs per action and per step
(``Cluster.action_overhead_s``, ``step_overhead_s``: calibrated with the runtime's own driver, times the
job's wall/CPU stretch); "without fixed costs" re-simulates the same plan on the same chain and cluster
with both at 0 (the model before them). Errors are (measured - predicted) / measured of the iteration, per
round; the table gives medians over rounds. "load" is the host's 1-minute load average at each round's start
(2 cores).

The wall/CPU stretch at compile (``block costs measured ...`` note) scales the blocks and the fixed costs alike;
a round compiled in a burst of load predicts its steps high, one compiled in a lull low. Compare the stretch
and load per round before reading an error (docs/clusters.md discusses the committed run).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import Workload, machine_notes, median, run_ranks  # noqa: E402
from benchmarks.prediction_fidelity import compile_stretch  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/small_fidelity.py --write"
TARGET_ERROR = 0.25
MLP, GPT = ("mlp", (), 8), ("gpt-mini", (), 4)
# (model, overrides, global batch), layout, micro-batches: per rank count, the cases one world runs
CASES = {2: ((MLP, "dp", 2), (MLP, "1:1", 4), (GPT, "dp", 1), (GPT, "1:1", 2)),
         4: ((MLP, "dp", 2), (MLP, "1:1:1:1", 4), (GPT, "dp", 1), (GPT, "2:2", 2))}


@dataclass(frozen=True)
class Case:
    workload: Workload
    layout: str

    def __str__(self) -> str:
        return f"{self.workload.model} b={self.workload.global_batch_size} {self.layout} M={self.workload.num_microbatches}"


def cases(num_ranks: int) -> list[Case]:
    return [Case(Workload(model, overrides, batch, num_microbatches), layout)
            for (model, overrides, batch), layout, num_microbatches in CASES[num_ranks]]


def _captured_planning() -> dict[str, Any]:
    """Record the chain and cluster compile plans with (fxpipe.planning.plan_chain), to re-simulate its plan."""
    import fxpipe.planning

    seen: dict[str, Any] = {}
    original = fxpipe.planning.plan_chain

    def recording(chain: Any, cluster: Any, *args: Any, **kwargs: Any) -> Any:
        seen.update(chain=chain, cluster=cluster)
        return original(chain, cluster, *args, **kwargs)

    fxpipe.planning.plan_chain = recording  # type: ignore[assignment]
    return seen


def _one_case(rank: int, case: Case, num_warmup: int, num_steps: int, seen: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import fxpipe
    from fxpipe.sim.simulate import simulate

    load = os.getloadavg()[0]
    workload = case.workload
    model, example_inputs = workload.build()
    # both zoo losses are per-row means; said outright, since a one-row slice (gpt-mini 2:2) cannot show it
    pipe = fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(), plan=case.layout, loss_reduction="mean",
                          global_batch_size=workload.global_batch_size, num_microbatches=workload.num_microbatches)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    inputs, targets = workload.batch()
    iterations = []
    for index in range(num_warmup + num_steps):
        dist.barrier()
        start = time.perf_counter()
        pipe.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if index >= num_warmup:
            iterations.append(time.perf_counter() - start)
    dist.barrier()
    plan = pipe.plan
    if rank != 0:  # rank 0 plans (and broadcasts the plan): its figures are the ones reported
        return {}
    cluster = seen["cluster"]
    assert plan.predicted is not None
    bare = replace(cluster, action_overhead_s=0.0, step_overhead_s=0.0)
    without = simulate(plan, seen["chain"], bare, timeline=False).iteration_time_s
    return {"predicted_s": plan.predicted.iteration_time_s, "without_s": without,
            "iteration_s": statistics.median(iterations), "load": load, "stretch": compile_stretch(plan),
            "action_s": cluster.action_overhead_s, "step_s": cluster.step_overhead_s,
            "message_s": cluster.message_overhead_s, "plan": f"{plan.layout} M={plan.num_microbatches}",
            "lower_bound": any("lower bound" in note for note in plan.notes)}


def small_rank(rank: int, world_size: int, num_rounds: int, num_warmup: int, num_steps: int) -> list[list[dict[str, Any]]]:
    """Rounds of every case of this rank count in turn; per round, per case, rank 0's figures."""
    seen = _captured_planning()
    return [[_one_case(rank, case, num_warmup, num_steps, seen) for case in cases(world_size)]
            for _ in range(num_rounds)]


def run(ranks: tuple[int, ...] = (2, 4), *, num_rounds: int = 5, num_warmup: int = 3, num_steps: int = 10) -> dict[str, Any]:
    rows = []
    for num_ranks in ranks:
        rounds = run_ranks(small_rank, num_ranks, num_rounds, num_warmup, num_steps)[0]
        for index, case in enumerate(cases(num_ranks)):
            per_round = [rounds[r][index] for r in range(num_rounds)]
            errors = [(x["iteration_s"] - x["predicted_s"]) / x["iteration_s"] for x in per_round]
            before = [(x["iteration_s"] - x["without_s"]) / x["iteration_s"] for x in per_round]
            rows.append({"case": f"{case} local:{num_ranks}", "rounds": per_round, "errors": errors,
                         "error": median(errors), "error_before": median(before),
                         **{key: median([x[key] for x in per_round]) for key in
                            ("predicted_s", "without_s", "iteration_s", "action_s", "step_s", "message_s")}})
    return {"rows": rows, "num_rounds": num_rounds, "num_steps": num_steps, "num_warmup": num_warmup}


def report(result: dict[str, Any]) -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    table = [[r["case"], ms(r["without_s"]), ms(r["predicted_s"]), ms(r["iteration_s"]),
              f"{r['error_before'] * 100:+.0f} %", f"{r['error'] * 100:+.0f} %",
              " ".join(f"{e * 100:+.0f}" for e in r["errors"]), "yes" if abs(r["error"]) <= TARGET_ERROR else "NO",
              f"{r['action_s'] * 1e6:.0f} / {r['step_s'] * 1e6:.0f} / {r['message_s'] * 1e6:.0f}",
              " ".join(f"{x['load']:.1f}" for x in r["rounds"]), " ".join(f"{x['stretch']:.2f}" for x in r["rounds"])]
             for r in result["rows"]]
    met = sum(abs(r["error"]) <= TARGET_ERROR for r in result["rows"])
    return "\n".join([
        "# Small-model fidelity: fixed per-step costs in the default prediction", "",
        f"Command: `{COMMAND} --rounds {result['num_rounds']} --steps {result['num_steps']} "
        f"--warmup {result['num_warmup']}`", "",
        f"Machine: {machine_notes()}.", "",
        tabulate(table, ["case", "predicted ms without fixed costs", "predicted ms (default)", "measured iteration ms",
                         "error without", "error (meas - pred) / meas", "per-round errors %",
                         f"within {TARGET_ERROR:.0%}", "us per action / per step / per message (compile)",
                         "load per round", "wall/CPU at compile per round"], tablefmt="github"), "",
        f"{met} of {len(table)} cases within {TARGET_ERROR:.0%} (medians over {result['num_rounds']} rounds of "
        f"{result['num_steps']} iterations).", "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per rank count")
    parser.add_argument("--steps", type=int, default=10, help="timed iterations per case and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before them")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], choices=sorted(CASES))
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    text = report(run(tuple(args.ranks), num_rounds=args.rounds, num_warmup=args.warmup, num_steps=args.steps))
    print(text)
    if args.write:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
