"""Candidate pipelines built directly on the fine chain, besides the DAPPLE state search: the search's bounds
(even pipelines), what it cannot reach on a coarsened chain (deep pipelines, uniform layouts), whole replicated
pipelines, and the least-memory layout an infeasible-plan error shows."""

from __future__ import annotations

from collections.abc import Sequence

from fxpipe.passes.partition.block_partition import balanced_cuts, param_weights, work_weights
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.request import PlanRequest
from fxpipe.passes.partition.spans import Candidate, Span, spans_from_stops

MAX_REPLICATED_STAGES = 8


def contiguous(stops: list[int], widths: Sequence[int], degrees: Sequence[int] = ()) -> list[Span]:
    """Stages ending at ``stops`` on consecutive device ranges of ``widths`` devices each, from device 0."""
    starts = [sum(widths[:s]) for s in range(len(widths))]
    return spans_from_stops(stops, [tuple(range(a, a + n)) for a, n in zip(starts, widths, strict=True)], degrees)


def replicated_pipelines(model: CandidateCosts, grid: list[int]) -> list[Candidate]:
    """Straight pipelines of S balanced stages, replicated whole: stage s on devices s, s+S, s+2S, ..."""
    chain, num_devices = model.chain, model.cluster.num_devices
    work = work_weights(chain)
    found = []
    for num_stages in range(2, min(chain.num_blocks, num_devices) + 1):
        if num_stages > MAX_REPLICATED_STAGES and num_devices % num_stages:
            continue  # on large clusters only stage counts that use every device
        num_copies = num_devices // num_stages
        spans = spans_from_stops(balanced_cuts(work, num_stages),
                                 [tuple(c * num_stages + s for c in range(num_copies)) for s in range(num_stages)])
        for rows in grid:
            if rows >= num_copies and model.global_batch_size // rows >= num_stages and model.fits(spans, rows):
                found.append(model.candidate(spans, rows))
    return found


def even_pipelines(model: CandidateCosts, rows: int) -> list[Candidate]:
    """Seeds for the search bound: S = 1, 2, 4, ... balanced stages of N/S contiguous devices each."""
    chain, num_devices = model.chain, model.cluster.num_devices
    found = []
    num_stages = 1
    while num_stages <= min(chain.num_blocks, num_devices, model.global_batch_size // rows):
        found += _balanced(model, rows, num_stages, min(num_devices // num_stages, rows))
        num_stages *= 2
    return found


def _balanced(model: CandidateCosts, rows: int, num_stages: int, width: int) -> list[Candidate]:
    """``num_stages`` stages of ``width`` contiguous devices each, cuts balanced by work, if it fits."""
    spans = contiguous(balanced_cuts(work_weights(model.chain), num_stages), [width] * num_stages)
    return [model.candidate(spans, rows)] if model.fits(spans, rows) else []


def deep_pipelines(model: CandidateCosts, rows: int, shallowest: int) -> list[Candidate]:
    """Pipelines deeper than ``shallowest`` stages at ``rows`` rows a micro-batch: for every replica count
    w = 1, 2, 4, ... up to ``rows``, the deepest pipeline of w-replica stages (S = the fewest of the chain's blocks,
    N // w and the micro-batches), its cuts balanced by work and by weights, on contiguous devices; and the same
    stages with the devices left over spread as extra replicas over the busiest stages, so that every device
    has a role (what ``fxpipe.compile`` asks).

    What a model whose blocks each need a device of their own fits as (an MoE layer: its fused experts are neither
    cut nor split by tensor parallelism), such as 56 stages of 2 replicas on 112 devices, or on 64 devices 48 of
    one and 8 of two. The search of a coarsened chain cannot reach them (its stages are whole groups of blocks),
    nor :func:`even_pipelines`' powers of two."""
    chain, num_devices = model.chain, model.cluster.num_devices
    depths: dict[int, int] = {}  # S -> the widest w giving it
    width = 1
    while width <= min(rows, num_devices):
        num_stages = min(chain.num_blocks, num_devices // width, model.global_batch_size // rows)
        if num_stages <= shallowest:
            break
        depths[num_stages] = width
        width *= 2
    found: dict[tuple[object, ...], Candidate] = {}
    work = work_weights(chain)
    balances = (work, param_weights(chain)) if depths else ()
    for num_stages, width in depths.items():
        for weights in balances:
            stops = balanced_cuts(weights, num_stages)
            stage_work = [sum(work[first:stop]) for first, stop in zip([0, *stops[:-1]], stops, strict=True)]
            spread = every_device_widths(stage_work, width, num_devices, rows)
            for counts in [(width,) * num_stages, *([spread] if spread and spread != (width,) * num_stages else [])]:
                spans = contiguous(stops, counts)
                if model.fits(spans, rows):
                    candidate = model.candidate(spans, rows)
                    found.setdefault(candidate.identity(), candidate)
    return list(found.values())


def uniform_pipelines(model: CandidateCosts, rows: int) -> list[Candidate]:
    """S stages of N / S replicas each on contiguous devices (a stage's replicas inside as few hosts as they fill),
    for every S dividing the N devices, cuts balanced by work: the uniform layouts people try by hand, which the
    search of a coarsened chain can prune (12 stages of 2 on 3 x 8 devices, where its pick took 1.16x as long)."""
    chain, num_devices = model.chain, model.cluster.num_devices
    return [candidate
            for num_stages in range(2, min(chain.num_blocks, num_devices, model.global_batch_size // rows) + 1)
            if num_devices % num_stages == 0 and num_devices // num_stages <= rows
            for candidate in _balanced(model, rows, num_stages, num_devices // num_stages)]


def every_device_widths(work: list[float], width: int, num_devices: int, rows: int) -> tuple[int, ...] | None:
    """Replica counts of ``len(work)`` stages of ``width`` replicas with the devices left over given out one at a
    time to the stages with the most work per replica; None when that would give a stage more replicas than rows."""
    counts = [width] * len(work)
    for _ in range(num_devices - width * len(work)):
        busiest = max(range(len(work)), key=lambda s: (work[s] / counts[s], -s))
        if counts[busiest] >= rows:
            return None
        counts[busiest] += 1
    return tuple(counts)


def least_memory(request: PlanRequest, model: CandidateCosts, grid: list[int]) -> Candidate | None:
    """For error messages: the plan with the least memory per device (deepest param-balanced pipeline,
    smallest micro-batch), so the table shows how far even the best attempt is from fitting. Under a forced
    layout, that layout's stages (their replicas and T, on contiguous devices) with param-balanced cuts: the
    table then shows the stages the user asked for."""
    chain, num_devices = model.chain, model.cluster.num_devices
    rows = grid[0]
    if request.layout is not None:
        degrees = request.tensor_parallel or (1,) * len(request.layout)
        sizes = [replicas * degree for replicas, degree in zip(request.layout, degrees, strict=True)]
        return model.candidate(contiguous(balanced_cuts(param_weights(chain), len(sizes)), sizes, degrees), rows)
    num_stages = min(chain.num_blocks, num_devices, model.global_batch_size // rows)
    width = num_devices // num_stages
    spans = spans_from_stops(balanced_cuts(param_weights(chain), num_stages),
                             [tuple(range(s * width, s * width + min(width, rows))) for s in range(num_stages)])
    return model.candidate(spans, rows)
