"""Local search under the exact simulator around the planner's best plan (cuts, devices, micro-batch size)."""

from __future__ import annotations

from collections.abc import Iterator

from fxpipe.passes.partition.block_partition import balanced_cuts, param_weights, uniform_cuts, work_weights
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.request import PlanRequest
from fxpipe.passes.partition.scoring import Scored, score_candidates
from fxpipe.passes.partition.spans import Candidate, Span, spans_from_stops

# The pivot model misjudges some transfer-heavy plans by tens of percent (it serialises transfers the
# simulator overlaps), so the best simulated plan is polished by hill climbing on the simulator itself.
MAX_POLISH_ROUNDS = 3
MAX_CUT_MOVE_STAGES = 8
MAX_DEVICE_MOVE_STAGES = 4


def _cut_moves(spans: tuple[Span, ...]) -> Iterator[tuple[Span, ...]]:
    for index in range(len(spans) - 1):
        left, right = spans[index], spans[index + 1]
        for delta in (-1, 1):
            stop = left.stop + delta
            if left.first < stop < right.stop:
                yield (*spans[:index], Span(left.first, stop, left.devices, left.tensor_parallel),
                       Span(stop, right.stop, right.devices, right.tensor_parallel), *spans[index + 2:])


def _device_moves(spans: tuple[Span, ...]) -> Iterator[tuple[Span, ...]]:
    """Hand one device from a stage to its neighbour (the giver keeps at least one); stages of tensor-parallel
    groups keep their groups whole."""
    for index in range(len(spans) - 1):
        left, right = spans[index], spans[index + 1]
        if left.tensor_parallel > 1 or right.tensor_parallel > 1:
            continue
        if len(left.devices) > 1:
            moved = left.devices[-1]
            yield (*spans[:index], Span(left.first, left.stop, left.devices[:-1]),
                   Span(right.first, right.stop, tuple(sorted((moved, *right.devices)))), *spans[index + 2:])
        if len(right.devices) > 1:
            moved = right.devices[0]
            yield (*spans[:index], Span(left.first, left.stop, tuple(sorted((*left.devices, moved)))),
                   Span(right.first, right.stop, right.devices[1:]), *spans[index + 2:])


def _neighbours(model: CandidateCosts, candidate: Candidate, grid: list[int], fixed_layout: bool) -> list[Candidate]:
    spans, rows = candidate.spans, candidate.microbatch_rows
    layouts: list[tuple[Span, ...]] = []
    if len(spans) <= MAX_CUT_MOVE_STAGES:  # deeper pipelines: too many neighbours to simulate
        layouts.extend(_cut_moves(spans))
    if len(spans) <= MAX_DEVICE_MOVE_STAGES and not fixed_layout:
        layouts.extend(_device_moves(spans))
    found = [model.candidate(s, rows) for s in layouts if max(x.replicas for x in s) <= rows]
    position = grid.index(rows) if rows in grid else -1
    for other in (grid[position - 1] if position > 0 else None,
                  grid[position + 1] if 0 <= position < len(grid) - 1 else None):
        if other and max(s.replicas for s in spans) <= other and model.global_batch_size // other >= len(spans):
            found.append(model.candidate(spans, other))
    return found


def as_candidate(model: CandidateCosts, scored: Scored) -> Candidate:
    stages = scored.plan.stages
    return model.candidate(tuple(Span(s.first_block, s.stop_block, s.devices, s.tensor_parallel) for s in stages),
                           scored.plan.microbatch_size)


def _alternative_cuts(model: CandidateCosts, candidate: Candidate) -> list[Candidate]:
    """The same stages and devices with the baselines' cut rules: equal block counts, balanced
    parameters, balanced per-sample compute (starting points the pivot model may have misranked)."""
    chain, num_stages = model.chain, len(candidate.spans)
    rules = [uniform_cuts(chain.num_blocks, num_stages), balanced_cuts(param_weights(chain), num_stages),
             balanced_cuts(work_weights(chain), num_stages)]
    devices = [span.devices for span in candidate.spans]
    return [model.candidate(spans_from_stops(stops, devices, candidate.degrees), candidate.microbatch_rows)
            for stops in rules]


def polish(request: PlanRequest, model: CandidateCosts, best: Scored, grid: list[int], planner: str) -> Scored:
    """Try the baselines' cut rules on the best plan's stages, then hill-climb over neighbouring plans
    while the simulator says they are faster."""
    candidate = as_candidate(model, best)
    if len(candidate.spans) > 1:
        other = score_candidates(request, model, _alternative_cuts(model, candidate), planner, best.time_s)
        if other is not None and other.time_s < best.time_s * (1 - 1e-9):
            best, candidate = other, as_candidate(model, other)
    for _ in range(MAX_POLISH_ROUNDS):
        neighbours = _neighbours(model, candidate, grid, request.layout is not None)
        better = score_candidates(request, model, neighbours, planner, best.time_s)  # only faster ones matter
        if better is None or better.time_s >= best.time_s * (1 - 1e-9):
            break
        best = better
        candidate = as_candidate(model, better)
    return best
