"""The iteration time fxpipe.compile predicts by default against the training steps it then runs, on local CPU ranks.

Run: python benchmarks/prediction_fidelity.py [--steps 8] [--warmup 2] [--rounds 3] [--precision bf16] [--write]
On one GPU: python benchmarks/prediction_fidelity.py --device cuda [--model gpt2-small --batch 8]

For each workload and rank count, every round is what a user's script does: ``fxpipe.compile(model, ...,
plan="auto")`` with the default ``costs="auto"`` on N forked gloo ranks (1 thread each; every rank
measures the blocks at once and they agree on the median, then the DAPPLE planner picks the plan),
then warm-up and timed training iterations (``pipe.step``, ``AdamW.step``, ``zero_grad``; a barrier
before each). "predicted" is the plan's ``predicted.iteration_time_s``; "analytic" is what the analytic
device model (``costs="analytic"``, the old default) predicts for the same layout and micro-batch count
on the same cluster figures (no optimizer step). "step" is the median ``pipe.step``, "iteration" the
median of the whole loop body (what a user's loop takes, and what the default prediction covers:
compile measures an AdamW step with the blocks); errors are
(measured - predicted) / measured of the iteration, per round, and the table gives medians over rounds.
"wall/CPU" is the load each round ran under: at compile, the stretch the measured figures include (the
median over ranks of wall seconds per CPU second while all ranks measured; the plan's note), in
training the ranks' median wall seconds per CPU second of the timed iterations (waits for other ranks
count as wall time there). A round whose two differ ran under another load than the one it was
predicted for.

``--device cuda``: this process, in which ``fxpipe.compile`` makes its own world of one (NCCL on the
visible GPU, a ``local:1`` cluster that takes the GPU's datasheet preset); the batch is moved to the GPU
before the timed loop, and each iteration is timed between two device synchronisations. "analytic" there
is the preset's prediction (its achievable matmul rate, ``DeviceSpec.matmul_flops``).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import Workload, machine_notes, median, run_ranks  # noqa: E402


def gpu_notes() -> str:
    """One line on the GPU the numbers come from."""
    return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            "world of one (NCCL)")

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/prediction_fidelity.py --write"
PRECISIONS = ("fp32", "bf16")  # --precision bf16: compile(autocast_dtype=torch.bfloat16), costed and measured alike
TARGET_ERROR = 0.15
VGG_CPU = (("base_width", 8), ("fc_width", 64), ("num_classes", 10), ("pool_size", 1), ("image_size", 32))
DEFAULT_WORKLOADS = (Workload("gpt-mini", (), 32, 8), Workload("vgg-19", VGG_CPU, 32, 8))
DEFAULT_RANKS = (2, 4)
GPU_WORKLOAD = Workload("gpt2-small", (), 8, 1)


@dataclass(frozen=True)
class Case:
    workload: Workload
    num_ranks: int

    def __str__(self) -> str:
        return f"{self.workload.model} local:{self.num_ranks}"


def results_path(precision: str) -> Path:
    return RESULTS if precision == "fp32" else RESULTS.with_name(f"{RESULTS.stem}_{precision}.md")


def analytic_prediction(workload: Workload, plan: Any, num_ranks: int, precision: str = "fp32") -> float:
    """The analytic device model's iteration time for ``plan``'s layout and micro-batch count (this process only)."""
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.planning import costed_model, plan_chain

    cluster = parse_cluster(f"local:{num_ranks}")  # the calibration cache compile's collective run wrote
    model, example_inputs = workload.build()
    chain = costed_model(model, example_inputs, cluster, costs="analytic", precision=precision).chain
    forced = plan_chain(chain, cluster, workload.global_batch_size, layout=plan.layout,
                        num_microbatches=plan.num_microbatches, all_devices=True)
    assert forced.predicted is not None
    return float(forced.predicted.iteration_time_s)


def compile_stretch(plan: Any) -> float:
    """The wall/CPU stretch compile's measured figures include (from the plan's note), NaN when not recorded."""
    from fxpipe.job_costs import STRETCH_NOTE

    prefix = STRETCH_NOTE.split("{")[0]
    for note in plan.notes:
        if note.startswith(prefix):
            return float(note[len(prefix):].split()[0])
    return float("nan")


def fidelity_rank(rank: int, world_size: int, workload: Workload, num_rounds: int, num_warmup: int,
                  num_steps: int, precision: str = "fp32", device: str = "cpu") -> list[dict[str, Any]]:
    """Rounds of (compile with the defaults, train); rank 0 also prices each plan with the analytic model."""
    import torch.distributed as dist

    import fxpipe

    rounds = []
    inputs, targets = workload.batch()
    on_gpu = device == "cuda"
    if on_gpu:
        inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
        targets = targets.to(device) if isinstance(targets, torch.Tensor) else targets

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    for _ in range(num_rounds):
        model, example_inputs = workload.build()
        pipe = fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(),
                              global_batch_size=workload.global_batch_size, plan="auto",
                              autocast_dtype=None if precision == "fp32" else torch.bfloat16)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        steps, iterations, cpu_s = [], [], 0.0
        for index in range(num_warmup + num_steps):
            dist.barrier()
            sync()
            start, cpu_start = time.perf_counter(), time.process_time()
            pipe.step(inputs, targets)
            sync()
            stepped = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            if index >= num_warmup:
                steps.append(stepped - start)
                iterations.append(time.perf_counter() - start)
                cpu_s += time.process_time() - cpu_start
        plan = pipe.plan
        assert plan.predicted is not None
        rounds.append({"plan": f"{plan.layout} M={plan.num_microbatches}",
                       "predicted_s": plan.predicted.iteration_time_s, "cost_source": plan.predicted.cost_source,
                       "analytic_s": analytic_prediction(workload, plan, world_size, precision) if rank == 0 else None,
                       "step_s": statistics.median(steps), "iteration_s": statistics.median(iterations),
                       "compile_stretch": compile_stretch(plan), "train_stretch": sum(iterations) / cpu_s})
        dist.barrier()
    return rounds


def run(workloads: tuple[Workload, ...] = DEFAULT_WORKLOADS, ranks: tuple[int, ...] = DEFAULT_RANKS, *,
        num_rounds: int = 3, num_warmup: int = 2, num_steps: int = 8, precision: str = "fp32",
        device: str = "cpu") -> dict[str, Any]:
    rows = []
    if device == "cuda" and tuple(ranks) != (1,):
        raise ValueError(f"--device cuda runs a world of one on the visible GPU; got --ranks {list(ranks)}, use --ranks 1")
    for workload in workloads:
        for num_ranks in ranks:
            if device == "cuda":  # in this process (see benchmarks/overhead.py: no forked child after CUDA)
                by_rank = [fidelity_rank(0, 1, workload, num_rounds, num_warmup, num_steps, precision, device="cuda")]
            else:
                by_rank = run_ranks(fidelity_rank, num_ranks, workload, num_rounds, num_warmup, num_steps, precision)
            rounds = by_rank[0]
            for index, round_result in enumerate(rounds):  # the ranks' median wall/CPU while training
                round_result["train_stretch"] = median([r[index]["train_stretch"] for r in by_rank])
            errors = [(r["iteration_s"] - r["predicted_s"]) / r["iteration_s"] for r in rounds]
            rows.append({"case": Case(workload, num_ranks), "rounds": rounds,
                         "plans": sorted({r["plan"] for r in rounds}),
                         "sources": sorted({r["cost_source"] for r in rounds}),
                         **{key: median([r[key] for r in rounds])
                            for key in ("predicted_s", "analytic_s", "step_s", "iteration_s", "compile_stretch",
                                        "train_stretch")},
                         "errors": errors, "error": median(errors),
                         "analytic_ratio": median([r["iteration_s"] / r["analytic_s"] for r in rounds])})
    return {"workloads": workloads, "rows": rows, "num_rounds": num_rounds, "num_steps": num_steps,
            "precision": precision, "device": device}


def report(result: dict[str, Any]) -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f}"

    table = [[str(r["case"]), ", ".join(r["plans"]), "/".join(r["sources"]), ms(r["predicted_s"]), ms(r["step_s"]),
              ms(r["iteration_s"]), f"{r['error'] * 100:+.1f} %", " ".join(f"{e * 100:+.0f}" for e in r["errors"]),
              "yes" if abs(r["error"]) <= TARGET_ERROR else "NO", ms(r["analytic_s"]), f"{r['analytic_ratio']:.2f}",
              " ".join(f"{x['compile_stretch']:.2f}/{x['train_stretch']:.2f}" for x in r["rounds"])]
             for r in result["rows"]]
    num_met = sum(abs(r["error"]) <= TARGET_ERROR for r in result["rows"])
    ratios = [r["analytic_ratio"] for r in result["rows"]]
    return "\n".join([
        "# Prediction fidelity: the default prediction vs measured training iterations"
        + ("" if result.get("precision", "fp32") == "fp32" else f" ({result['precision']} autocast)"), "",
        f"Command: `{COMMAND}" + ("" if result.get("precision", "fp32") == "fp32"
                                  else f" --precision {result['precision']}") + f" --rounds {result['num_rounds']}`", "",
        "Workloads: " + "; ".join(w.describe() for w in result["workloads"]) + ".", "",
        f"Machine: {gpu_notes() if result.get('device') == 'cuda' else machine_notes()}.", "",
        tabulate(table, ["case", "plan (auto)", "cost source", "predicted ms (default)", "measured step ms",
                         "measured iteration ms", "error (meas - pred) / meas", "per-round errors %",
                         f"within {TARGET_ERROR:.0%}", "analytic ms (same plan)", "measured / analytic",
                         "wall/CPU at compile / in training, per round"],
                 tablefmt="github"), "",
        f"{num_met} of {len(table)} cases within {TARGET_ERROR:.0%} (medians over {result['num_rounds']} rounds of "
        f"{result['num_steps']} iterations). Measured iterations took {min(ratios):.2f}-{max(ratios):.2f}x the "
        "analytic model's prediction for the same plan.", "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(DEFAULT_RANKS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: a world of one on the visible GPU (--ranks 1 implied)")
    parser.add_argument("--model", default=None, help=f"with --device cuda (default {GPU_WORKLOAD.model})")
    parser.add_argument("--batch", type=int, default=None, help=f"with --device cuda (default {GPU_WORKLOAD.global_batch_size})")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name} (or _bf16.md)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        workload = Workload(args.model or GPU_WORKLOAD.model, (), args.batch or GPU_WORKLOAD.global_batch_size, 1)
        result = run((workload,), (1,), num_rounds=args.rounds, num_warmup=args.warmup, num_steps=args.steps,
                     precision=args.precision, device="cuda")
        text = report(result)
        print(text)
        if args.write:
            raise SystemExit("--write records the CPU-rank tables; GPU figures go to benchmarks/gpu_check.md")
        return
    text = report(run(ranks=tuple(args.ranks), num_rounds=args.rounds, num_warmup=args.warmup, num_steps=args.steps,
                      precision=args.precision))
    print(text)
    if args.write:
        results_path(args.precision).write_text(text)


if __name__ == "__main__":
    main()
