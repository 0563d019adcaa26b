"""The cut refinement's score of a candidate's cut positions, each stage's figures kept per (stage, blocks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.latency import pipeline_steps
from fxpipe.passes.partition.spans import Span


def cut_scorer(model: CandidateCosts, spans: Sequence[Span], rows: int) -> Callable[[list[int]], float] | None:
    """``stops -> model.latency(...) if model.fits(...) else inf`` for ``spans`` with their last blocks at ``stops``
    (devices and degrees kept), the same floats; None where :meth:`CandidateCosts.steps` takes another path
    than its common one (tied parameters, a time per message or action, sharding).

    Why: refinement moves one cut at a time through a pipeline of up to hundreds of stages, so all but two
    stages and one transfer of each trial were costed before; their figures are kept here by stage index and
    blocks, and only the pivot model's sums run over the whole pipeline again.
    """
    cluster = model.cluster
    if (model.sharding != "none" or model.chain.shared_params or cluster.message_overhead_s > 0
            or cluster.action_overhead_s > 0):
        return None
    num_stages, num_microbatches = len(spans), model.global_batch_size // rows
    inflights = model.inflights(num_stages, num_microbatches, "A", None)  # policy A, as the search's memory check
    modes = model.stage_modes(model.resolved_recompute(num_stages), num_stages)
    leads = [span.leads for span in spans]
    stages: dict[tuple[int, int, int], tuple[int, tuple[float, float, float], tuple[float, float]]] = {}
    tensor_parallel = any(span.tensor_parallel > 1 for span in spans)
    hops: dict[tuple[int, int], float] = {}

    def stage(index: int, first: int, stop: int) -> tuple[int, tuple[float, float, float], tuple[float, float]]:
        """(peak bytes, (F, B, allreduce), tensor-parallel collectives in B and W) of stage ``index`` over blocks
        ``[first, stop)``."""
        key = (index, first, stop)
        if key not in stages:
            span = spans[index]
            choice = model.stage_choice(first, stop, rows, span.replicas, span.tensor_parallel, inflights[index],
                                        modes[index])
            stages[key] = (choice.memory, model.stage_step(first, stop, rows, leads[index], choice.recompute, "none",
                                                           span.tensor_parallel),
                           model.split_collectives(first, stop, rows, span.replicas, span.tensor_parallel,
                                                   choice.recompute))
        return stages[key]

    def hop(index: int, stop: int) -> float:
        """The transfer after stage ``index`` when it ends at block ``stop``."""
        if (index, stop) not in hops:
            hops[(index, stop)] = model.hop(stop - 1, rows, leads[index], leads[index + 1])
        return hops[(index, stop)]

    def score(stops: list[int]) -> float:
        parts = [stage(index, stops[index - 1] if index else 0, stop) for index, stop in enumerate(stops)]
        if max(memory for memory, _, _ in parts) > model.memory_limit_bytes:
            return float("inf")
        steps = pipeline_steps([step for _, step, _ in parts],
                               [hop(index, stop) for index, stop in enumerate(stops[:-1])], [],
                               split_overhead=cluster.split_backward_overhead,
                               tensor_parallel=[split for _, _, split in parts] if tensor_parallel else None)
        return steps.latency(num_microbatches, model.schedule == "zero_bubble")

    return score
