"""The first step at a new sequence length vs a repeat of that length (issue #32 item 4).

Run: python benchmarks/new_lengths.py [--steps 24] [--warmup 2] [--write]

Three gloo ranks, layout 2:1 (stage 0 on two replicas, cut before the middle block), two micro-batches. Two
pipelines of the same model in the same processes, one per way of deriving a new shape's value shapes:

- ``formulas``: what the runtime does (runtime/transport/shape_templates.py): a symbolic fake-tensor run once, then the
  shape formulas at each new length where its guards hold;
- ``fake run``: ``ShapedSteps.templates = None``, the plain fake-tensor run of every stage at each new length
  (what the runtime did before).

For each length L of 33, 34, ... (``--steps`` of them, shuffled), each pipeline takes two steps in a row at L
(the pipelines' order alternating length by length, so load hits both alike): the first is the first step it
sees at L (the shapes must be derived), the second a repeat (a dictionary lookup). Reported: medians over
the lengths of rank 0's step times (barriers before and after each step), the ratio of those medians, the
median of the per-length ratios, and the median time rank 0 spent deriving a new length's step
(``ShapedSteps.add``: the shapes, the routes and the message plan). The counts say which path answered each
new length on rank 0.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import bench_main, machine_notes, median, run_ranks, timed, zero_grads  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/new_lengths.py --write"
WORLD_SIZE = 3
REPLICAS = (2, 1)
FIRST_LENGTH = 33
TARGET_RATIO = 1.2  # the first step at a new length costs at most this many repeated steps
MODES = ("formulas", "fake run")


@dataclass(frozen=True)
class Case:
    """A model factory name, its sizes, the global batch and the micro-batch count."""

    name: str
    sizes: tuple[tuple[str, int], ...]
    global_batch_size: int = 8
    num_microbatches: int = 2

    def build(self) -> tuple[torch.nn.Module, Any, Callable[..., torch.Tensor], int]:
        """The model, example inputs, loss function and vocabulary size."""
        sizes: dict[str, Any] = dict(self.sizes)
        if self.name == "gpt-mini":
            from fxpipe import models as zoo

            model, example = zoo.build("gpt-mini", batch_size=self.global_batch_size, **sizes)
            return model, example, zoo.get("gpt-mini").loss_fn, sizes["vocab_size"]
        from fxpipe import hf_examples

        model, inputs = hf_examples.llama(batch_size=self.global_batch_size, **sizes)
        return model, inputs, hf_examples.hf_loss, sizes["vocab_size"]

    def describe(self) -> str:
        sizes = ", ".join(f"{key}={value}" for key, value in self.sizes)
        return (f"{self.name} ({sizes}), global batch {self.global_batch_size}, "
                f"{self.num_microbatches} micro-batches")


CASES = (Case("gpt-mini", (("n_layer", 6), ("n_embd", 128), ("block_size", 64), ("vocab_size", 256))),
         Case("hf-llama", (("num_layers", 16), ("hidden", 32), ("seq_len", 64), ("vocab_size", 100))))


def block_cut_plan(gm: Any, case: Case) -> Any:
    """Layout 2:1 cut before the middle transformer block (a cut inside a block can separate a size from its
    readers: a replicated sender would send its own rows)."""
    from fxpipe.core import meta
    from tests.mp_utils import compute_nodes, plan_from_cuts

    names = compute_nodes(gm)
    nodes = {node.name: node for node in gm.graph.nodes}
    layers = next(value for key, value in case.sizes if key in ("n_layer", "num_layers"))
    prefix = ("h." if case.name == "gpt-mini" else "model.layers.") + f"{layers // 2}."
    cut = next(index for index, name in enumerate(names)
               if str(nodes[name].meta.get(meta.MODULE_PATH, "")).startswith(prefix))
    return plan_from_cuts(gm, REPLICAS, case.global_batch_size, case.num_microbatches, fractions=[cut / len(names)])


def lengths_rank(rank: int, world_size: int, case: Case, num_warmup: int, num_lengths: int) -> dict[str, Any]:
    from fxpipe.passes import trace

    example, vocab = case.build()[1], case.build()[3]
    plan = block_cut_plan(trace(case.build()[0], example), case)
    pipes = {mode: _Pipeline(case, plan, vocab, with_formulas=mode == "formulas") for mode in MODES}
    for length in range(FIRST_LENGTH - num_warmup - 1, FIRST_LENGTH - 1):  # warm-up lengths, formulas made here
        for pipe in pipes.values():
            for _ in range(2):
                timed(partial(pipe.step, length))
    lengths = list(range(FIRST_LENGTH, FIRST_LENGTH + num_lengths))
    random.Random(1).shuffle(lengths)
    times: dict[str, dict[str, list[float]]] = {mode: {"new": [], "repeat": []} for mode in MODES}
    before = dict(pipes["formulas"].templates.counts)
    for index, length in enumerate(lengths):
        for mode in MODES if index % 2 == 0 else reversed(MODES):  # each mode first on every other length
            times[mode]["new"].append(timed(partial(pipes[mode].step, length)))
            times[mode]["repeat"].append(timed(partial(pipes[mode].step, length)))
    counts = pipes["formulas"].templates.counts
    return {"times": times, "counts": {key: counts[key] - before[key] for key in before},
            "derive_s": {mode: pipe.derive_s[-num_lengths:] for mode, pipe in pipes.items()}}


class _Pipeline:
    """One pipeline of the case; ``with_formulas=False`` derives every new shape with the plain fake run.
    ``derive_s``: seconds of each new shape's derivation (``ShapedSteps.add``) on this rank."""

    def __init__(self, case: Case, plan: Any, vocab: int, *, with_formulas: bool) -> None:
        import fxpipe

        model, example, loss_fn, _ = case.build()
        self.case, self.vocab = case, vocab
        self.pipe = fxpipe.compile(model, example, loss_fn=loss_fn, global_batch_size=case.global_batch_size,
                                   plan=plan)
        self.params = list(self.pipe.parameters())
        shapes = self.pipe.driver.shapes
        self.templates = shapes.templates
        shapes.templates = self.templates if with_formulas else None
        self.derive_s: list[float] = []
        add = shapes.add

        def timed_add(*args: Any) -> Any:
            start = time.perf_counter()
            try:
                return add(*args)
            finally:
                self.derive_s.append(time.perf_counter() - start)

        shapes.add = timed_add
        self.generator = torch.Generator().manual_seed(0)

    def step(self, length: int) -> None:
        tokens = torch.randint(0, self.vocab, (self.case.global_batch_size, length + 1), generator=self.generator)
        inputs = tokens[:, :-1] if self.case.name == "gpt-mini" else {"input_ids": tokens[:, :-1]}
        zero_grads(self.params)
        self.pipe.step(inputs, tokens[:, 1:])


def run(cases: tuple[Case, ...] = CASES, *, num_warmup: int = 2, num_lengths: int = 24) -> dict[str, Any]:
    rows = []
    for case in cases:
        result = run_ranks(lengths_rank, WORLD_SIZE, case, num_warmup, num_lengths)[0]
        for mode in MODES:
            new, repeat = result["times"][mode]["new"], result["times"][mode]["repeat"]
            rows.append({"case": case, "mode": mode, "lengths": len(new), "new_s": median(new),
                         "repeat_s": median(repeat),
                         "paired": median([a / b for a, b in zip(new, repeat, strict=True)]),
                         "derive_s": median(result["derive_s"][mode])})
        rows[-2]["counts"] = result["counts"]
    return {"rows": rows, "num_lengths": num_lengths}


def report(result: dict[str, Any]) -> str:
    table, verdicts = [], []
    for row in result["rows"]:
        ratio = row["new_s"] / row["repeat_s"]
        table.append([row["case"].name, row["mode"], row["lengths"], f"{row['derive_s'] * 1e3:.2f}",
                      f"{row['new_s'] * 1e3:.1f}", f"{row['repeat_s'] * 1e3:.1f}", f"{ratio:.3f}",
                      f"{row['paired']:.3f}"])
        if row["mode"] == "formulas":
            met = "met" if ratio <= TARGET_RATIO else "MISSED"
            counts = ", ".join(f"{key} {value}" for key, value in row["counts"].items())
            verdicts.append(f"- {row['case'].name}: new / repeat = **{ratio:.3f}** (ratio of the medians; median of "
                            f"paired ratios {row['paired']:.3f}); target <= {TARGET_RATIO} ({met}). New lengths "
                            f"answered by (rank 0): {counts}.")
    cases = dict.fromkeys(row["case"] for row in result["rows"])
    return "\n".join([
        "# First step at a new sequence length vs a repeat", "",
        f"Command: `{COMMAND}`", "",
        "Workloads: " + "; ".join(case.describe() for case in cases) +
        f"; {WORLD_SIZE} gloo ranks, layout 2:1, lengths {FIRST_LENGTH}..{FIRST_LENGTH + result['num_lengths'] - 1}"
        " shuffled, modes alternating length by length.", "",
        f"Machine: {machine_notes()}.", "",
        tabulate(table, ["model", "shapes from", "lengths", "derive ms (median)", "new ms (median)", "repeat ms (median)",
                         "new / repeat", "median of paired ratios"], tablefmt="github"), "",
        *verdicts, "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    bench_main(argv, __doc__, RESULTS,
               lambda warmup, steps: report(run(num_warmup=warmup, num_lengths=steps)), steps=24, warmup=2)


if __name__ == "__main__":
    main()
