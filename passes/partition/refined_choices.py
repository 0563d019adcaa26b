"""Each stage's sharding level and recompute choice refined against the whole pipeline's pivot latency, for the
few candidates the simulator scores (the search keeps each stage's own best: CandidateCosts.stage_choices)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fxpipe.passes.partition.spans import Span, StageChoice
from fxpipe.sim.stagecost import stage_memory_bytes

if TYPE_CHECKING:
    from fxpipe.passes.partition.candidates import CandidateCosts


def stage_options(model: CandidateCosts, spans: Sequence[Span], rows: int, warmup_policy: str,
                  schedule: str | None = None) -> list[tuple[StageChoice, ...]]:
    """Every ``(level, recompute)`` each stage may take under the request and that fits, as StageChoices
    (the chosen one first); a stage whose options all overflow keeps its chosen one alone."""
    chosen = model.stage_choices(spans, rows, warmup_policy, schedule)
    if model.sharding == "none":
        return [(choice,) for choice in chosen]
    request = model.sharding if isinstance(model.sharding, str) or len(model.sharding) == len(spans) else "auto"
    num_microbatches = model.global_batch_size // rows
    found = []
    for index, (span, choice) in enumerate(zip(spans, chosen, strict=True)):
        replicas = span.replicas
        levels = model.stage_levels(request, index, replicas, schedule)
        recomputes = (choice.recompute,) if isinstance(model.recompute, tuple) or model.recompute != "auto" or (
            (schedule or model.schedule) == "zero_bubble") else (False, True)
        inflight = model.inflight(index, len(spans), num_microbatches, warmup_policy, schedule)
        cost = model.cost(span.first, span.stop, rows, replicas, span.tensor_parallel)
        options = [choice]
        for level in levels:
            for recompute in recomputes:
                memory = stage_memory_bytes(cost, inflight, model.optimizer, recompute, sharding=level,
                                            replicas=replicas, num_microbatches=num_microbatches)
                option = StageChoice(recompute, memory, level)
                if memory <= model.memory_limit_bytes and option != choice:
                    options.append(option)
        found.append(tuple(options))
    return found

def refined_choices(model: CandidateCosts, spans: Sequence[Span], rows: int, warmup_policy: str,
                    schedule: str | None = None) -> list[StageChoice]:
    """:meth:`CandidateCosts.stage_choices`, then each stage's option changed where the whole pipeline's pivot latency
    drops, stage by stage until nothing improves (for the few candidates the simulator scores).

    The per-stage rule (:meth:`CandidateCosts._choose_sharded`) sees one stage; stages interact through the fill (a
    stage's step all-gather can hide behind another's) and the drain (a tail behind a later stage's
    backward), so an option slower alone can make the pipeline faster.
    """
    options = stage_options(model, spans, rows, warmup_policy, schedule)
    choices = [stage[0] for stage in options]
    if all(len(stage) == 1 for stage in options):
        return choices
    split = (schedule or model.schedule) == "zero_bubble"
    num_microbatches = model.global_batch_size // rows
    best_s = model.steps(spans, rows, choices).latency(num_microbatches, split)
    improved = True
    while improved:
        improved = False
        for index, stage in enumerate(options):
            for option in stage:
                trial = [*choices[:index], option, *choices[index + 1:]]
                seconds = model.steps(spans, rows, trial).latency(num_microbatches, split)
                if seconds < best_s * (1 - 1e-9):
                    choices, best_s, improved = trial, seconds, True
    return choices
