"""Predicted vs measured saved-activation peaks per stage, for zoo models (vocabulary-heavy LMs included) and layouts.

Run: python benchmarks/memory_fidelity.py [--write]

Each case is planned here (DAPPLE with the layout forced, analytic costs, the zoo model's own loss_fn
costed on the last stage) and run for one measured step on local gloo ranks (`pipe.measure = True`,
`pipe.step_stats()`: the peak of bytes autograd saves for backward, unique storages, parameters
excluded). The ratio is predicted (`StagePlan.activation_peak_bytes`) / measured; the target is
0.90 <= ratio <= 1.25 on every stage: a prediction at most 10 % under the measurement (under-prediction
makes plans that look feasible run out of memory) and at most 25 % over.

A value crossing a cut that nodes on both sides save (a ReLU's output that the next stage's convolution
saves too) is counted on both sides: the later stage saves its own received copy (`Block.resaved` in
`fxpipe/core/chain.py`, added per stage by `fxpipe.sim.stagecost.resaved_bytes`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import bench_main, machine_notes, mib  # noqa: E402
from tests.mp_utils import join_world, leave_world, run_ranks  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/memory_fidelity.py --write"
LOWEST, HIGHEST = 0.90, 1.25  # predicted / measured: the prediction at most 10 % under, 25 % over
VOCAB_LM = (("vocab_size", 4096), ("n_embd", 64), ("block_size", 32), ("n_layer", 4), ("n_head", 2))
SMALL_VGG = (("base_width", 8), ("fc_width", 64), ("num_classes", 10), ("pool_size", 1), ("image_size", 32))


@dataclass(frozen=True)
class Case:
    """A zoo model at a CPU size, planned for one layout and schedule on local ranks."""

    model: str
    overrides: tuple[tuple[str, Any], ...]
    layout: str
    global_batch_size: int = 32
    num_microbatches: int = 8
    schedule: str = "early_backward"
    sequence_parallel: bool = False  # tensor-parallel stages (RxT): planned and compiled with it

    @property
    def num_ranks(self) -> int:
        """Devices of the layout: R per stage, R x T for a stage of T-way tensor-parallel groups."""
        from fxpipe.passes.partition.layout import parse_stage_layout

        replicas, degrees = parse_stage_layout(self.layout, num_devices=2**31, num_blocks=2**31)
        return sum(r * t for r, t in zip(replicas, degrees, strict=True))

    def describe(self) -> str:
        sizes = ", ".join(f"{key}={value}" for key, value in self.overrides)
        name = f"{self.model} ({sizes})" if sizes else self.model
        return f"{name}, sequence-parallel" if self.sequence_parallel else name


CASES = (
    Case("gpt-mini", VOCAB_LM, "1:1:1:1"),
    Case("gpt-mini", VOCAB_LM, "2:1:1"),
    Case("gpt-mini", VOCAB_LM, "1:1:1:1", schedule="gpipe"),
    Case("gpt-mini", (), "1:1:1:1"),
    Case("tied-lm", (), "1:1:1:1"),
    Case("vgg-19", SMALL_VGG, "1:1:1:1"),
    Case("vgg-19", SMALL_VGG, "2:2"),
    Case("mlp", (), "1:3"),
    # tensor-parallel members: column linears keep their whole inputs, row linears their channels, the loss one
    # shard of the logits; norms and adds split only under sequence parallelism
    Case("gpt-mini", VOCAB_LM, "1x2:1x2"),
    Case("gpt-mini", VOCAB_LM, "1x2:1x2", sequence_parallel=True),
)


def plan_case(case: Case) -> Any:
    """The plan of one case, made here: DAPPLE with the layout forced, the zoo loss costed on the last stage."""
    from fxpipe import models as zoo
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.planning import costed_model, plan_chain

    rows = case.global_batch_size // case.num_microbatches
    model, example_inputs = zoo.build(case.model, batch_size=rows, **dict(case.overrides))
    cluster = parse_cluster(f"1x{case.num_ranks}:cpu")
    entry = zoo.get(case.model)
    _, targets = entry.make_batch(rows, 0, **dict(case.overrides))
    costed = costed_model(model, example_inputs, cluster, costs="analytic", loss_fn=entry.loss_fn,
                          example_targets=targets)
    return plan_chain(costed.chain, cluster, case.global_batch_size, layout=case.layout,
                      num_microbatches=case.num_microbatches, schedule=case.schedule, recompute="never",
                      sequence_parallel=case.sequence_parallel)


def _measure_rank(rank: int, world_size: int, store_dir: str, cases: tuple[Case, ...],
                  plans: list[Any]) -> list[tuple[int, int] | None]:
    """``(stage index, peak saved bytes)`` of one measured step per case on this rank (None: not in it)."""
    import fxpipe
    from fxpipe import models as zoo

    results: list[tuple[int, int] | None] = []
    for index, (case, plan) in enumerate(zip(cases, plans, strict=True)):
        if rank >= case.num_ranks:
            results.append(None)
            continue
        join_world(store_dir, f"case-{index}", rank, case.num_ranks)
        try:
            overrides = dict(case.overrides)
            model, example_inputs = zoo.build(case.model, batch_size=plan.microbatch_size, **overrides)
            entry = zoo.get(case.model)
            pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn,
                                  global_batch_size=case.global_batch_size, plan=plan,
                                  sequence_parallel=case.sequence_parallel)
            inputs, targets = entry.make_batch(case.global_batch_size, 1, **overrides)
            pipe.step(inputs, targets)  # warm-up outside the hooks
            pipe.measure = True
            pipe.step(inputs, targets)
            peak = pipe.step_stats()[rank].peak_activation_bytes
            results.append((pipe.stage_index, int(peak or 0)))
        finally:
            leave_world()
    return results


def run(cases: tuple[Case, ...], store_dir: str) -> list[dict[str, Any]]:
    """Per case and stage: predicted and measured saved-activation peaks (largest replica)."""
    plans = [plan_case(case) for case in cases]
    world_size = max(case.num_ranks for case in cases)
    per_rank = run_ranks(_measure_rank, world_size, store_dir, cases, plans, timeout_s=600.0)
    rows = []
    for index, (case, plan) in enumerate(zip(cases, plans, strict=True)):
        measured: dict[int, int] = {}
        for results in per_rank:
            if results[index] is not None:
                stage_index, peak = results[index]
                measured[stage_index] = max(measured.get(stage_index, 0), peak)
        for stage in plan.stages:
            rows.append({"case": case, "stage": stage.stage_index, "replicas": stage.replicas,
                         "inflight": stage.inflight_microbatches, "predicted": stage.activation_peak_bytes,
                         "measured": measured[stage.stage_index]})
    return rows


def ratio(row: dict[str, Any]) -> float:
    """predicted / measured: below 1 the plan under-predicts (a plan that fits may run out of memory)."""
    return row["predicted"] / max(row["measured"], 1)


def within_bounds(row: dict[str, Any]) -> bool:
    return LOWEST <= ratio(row) <= HIGHEST


def report(rows: list[dict[str, Any]]) -> str:
    table = [[row["case"].describe(), row["case"].layout, row["case"].schedule, row["stage"], row["inflight"],
              mib(row["predicted"]), mib(row["measured"]), f"{ratio(row):.3f}",
              "ok" if within_bounds(row) else "OUT"] for row in rows]
    ratios = [ratio(row) for row in rows]
    met = all(within_bounds(row) for row in rows)
    return "\n".join([
        "# Memory fidelity: predicted vs measured saved-activation peaks per stage", "",
        f"Command: `{COMMAND}`", "", f"Machine: {machine_notes()}.", "",
        tabulate(table, ["model", "layout", "schedule", "stage", "in flight", "predicted MiB", "measured MiB",
                         "predicted / measured", "bounds"], tablefmt="github"), "",
        f"Ratios from {min(ratios):.3f} to {max(ratios):.3f}; target {LOWEST:.2f} to {HIGHEST:.2f} on every stage "
        f"({'met' if met else 'MISSED'}).", "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    import tempfile

    def run_and_report(_warmup: int, _steps: int) -> str:
        with tempfile.TemporaryDirectory() as store_dir:
            return report(run(CASES, store_dir))

    bench_main(argv, __doc__, RESULTS, run_and_report, steps=1, warmup=1)


if __name__ == "__main__":
    main()
