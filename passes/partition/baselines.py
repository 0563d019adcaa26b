"""Baseline planners (PipeDream, GPipe balance, uniform, parameter balance, DP, Megatron's grid, exhaustive), scored
like DAPPLE."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fxpipe.core.plan import Plan
from fxpipe.passes.partition.block_partition import balanced_cuts, param_weights, uniform_cuts
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.exhaustive import plan_exhaustive
from fxpipe.passes.partition.pipedream import pipedream_layout
from fxpipe.passes.partition.request import InfeasiblePlanError, PlanRequest, microbatch_grid
from fxpipe.passes.partition.scoring import best_dp, dp_candidates, finish, infeasible_error, score_candidates
from fxpipe.passes.partition.spans import Candidate, Span, spans_from_stops
from fxpipe.sim.tensor_parallel_cost import TENSOR_PARALLEL_DEGREES

__all__ = ["BASELINES", "megatron_candidates", "plan_dp", "plan_exhaustive", "plan_gpipe", "plan_megatron",
           "plan_params", "plan_pipedream", "plan_uniform"]


def _valid(model: CandidateCosts, spans: list[Span], rows: int) -> bool:
    """Every replica gets a row and there are at least as many micro-batches as stages."""
    return (max(s.replicas for s in spans) <= rows
            and model.global_batch_size // rows >= len(spans))


def _best(request: PlanRequest, model: CandidateCosts, candidates: Iterable[Candidate], name: str) -> Plan:
    listed = list(candidates)
    best = score_candidates(request, model, listed, name)
    if best is None:
        closest = min(listed, key=lambda c: max(model.memory(c.spans, c.microbatch_rows, "A")), default=None)
        raise InfeasiblePlanError(f"planner {name!r}: {infeasible_error(request, model, closest)}")
    return finish(request, best, best_dp(request, model), None, model)


def plan_dp(request: PlanRequest) -> Plan:
    """One stage on every device; the best number of gradient-accumulation micro-batches that fits."""
    model = request.candidate_costs()
    return _best(request, model, dp_candidates(model, microbatch_grid(request)), "dp")


def _straight_pipelines(request: PlanRequest, model: CandidateCosts,
                        weights_at: Callable[[int], list[float]]) -> Iterable[Candidate]:
    num_devices, num_blocks = request.cluster.num_devices, request.chain.num_blocks
    for rows in microbatch_grid(request):
        weights = weights_at(rows)
        for num_stages in range(1, min(num_blocks, num_devices) + 1):
            copies = num_devices // num_stages
            devices = [tuple(k * num_stages + s for k in range(copies)) for s in range(num_stages)]
            spans = spans_from_stops(balanced_cuts(weights, num_stages), devices)
            if _valid(model, spans, rows):
                yield model.candidate(spans, rows)


def plan_gpipe(request: PlanRequest) -> Plan:
    """torchgpipe ``balance_by_time``: S stages minimising the slowest (F+B), one device each, the whole
    pipeline replicated over the devices (stage s on devices s, s+S, ...); best S and M."""
    model = request.candidate_costs()

    def times(rows: int) -> list[float]:
        return [b.forward_s.at(rows) + b.backward_s.at(rows) for b in request.chain.blocks]

    return _best(request, model, _straight_pipelines(request, model, times), "gpipe")


def _uniform_dp_pipelines(request: PlanRequest, model: CandidateCosts, stops_for: Callable[[int], list[int]]
                          ) -> Iterable[Candidate]:
    """DeepSpeed topology: S stages, N/S data-parallel replicas each, stage s on devices [sD, (s+1)D)."""
    num_devices, num_blocks = request.cluster.num_devices, request.chain.num_blocks
    for num_stages in range(1, min(num_blocks, num_devices) + 1):
        if num_devices % num_stages:
            continue
        width = num_devices // num_stages
        spans = spans_from_stops(stops_for(num_stages),
                                 [tuple(range(s * width, (s + 1) * width)) for s in range(num_stages)])
        for rows in microbatch_grid(request):
            if _valid(model, spans, rows):
                yield model.candidate(spans, rows)


def plan_uniform(request: PlanRequest) -> Plan:
    """Equal block counts per stage (DeepSpeed ``partition_method='uniform'``); best S and M."""
    num_blocks = request.chain.num_blocks
    model = request.candidate_costs()
    return _best(request, model, _uniform_dp_pipelines(request, model, lambda s: uniform_cuts(num_blocks, s)),
                 "uniform")


def plan_params(request: PlanRequest) -> Plan:
    """Parameter-count balance (DeepSpeed's default ``partition_method='parameters'``); best S and M."""
    weights = param_weights(request.chain)
    model = request.candidate_costs()
    return _best(request, model, _uniform_dp_pipelines(request, model, lambda s: balanced_cuts(weights, s)),
                 "params")


def plan_pipedream(request: PlanRequest) -> Plan:
    """PipeDream's hierarchical DP (asynchronous slowest-stage objective), run synchronously with the same
    micro-batching; the plan is recomputed for every micro-batch size of the grid."""
    model = request.candidate_costs()
    found = []
    for rows in microbatch_grid(request):
        spans = [Span(first, stop, devices) for first, stop, devices in pipedream_layout(model, rows)]
        if _valid(model, spans, rows):
            found.append(model.candidate(spans, rows))
    return _best(request, model, found, "pipedream")


def megatron_candidates(request: PlanRequest, model: CandidateCosts) -> list[Candidate]:
    """Megatron-LM's uniform grid, what people search by hand: T x P x D = N devices, T in
    :data:`TENSOR_PARALLEL_DEGREES` dividing a host, P stages of equal block counts (Megatron splits layers
    evenly), D replicas of T-way groups each, stage s on devices [s D T, (s+1) D T); every micro-batch size.
    Sorted by the pivot model (the simulator scores them in that order, pruning by lower bounds)."""
    num_devices, num_blocks = request.cluster.num_devices, request.chain.num_blocks
    per_host = request.cluster.devices_per_host
    found: list[Candidate] = []
    for degree in TENSOR_PARALLEL_DEGREES:
        if per_host % degree or num_devices % degree:
            continue
        for num_stages in range(1, min(num_blocks, num_devices // degree) + 1):
            if (num_devices // degree) % num_stages:
                continue
            width = num_devices // num_stages
            spans = spans_from_stops(uniform_cuts(num_blocks, num_stages),
                                     [tuple(range(s * width, (s + 1) * width)) for s in range(num_stages)],
                                     (degree,) * num_stages)
            found.extend(model.candidate(spans, rows) for rows in microbatch_grid(request)
                         if _valid(model, spans, rows))
    return sorted(found)


def plan_megatron(request: PlanRequest) -> Plan:
    """The best of Megatron-LM's uniform tensor x pipeline x data grid (:func:`megatron_candidates`)."""
    model = request.candidate_costs()
    return _best(request, model, megatron_candidates(request, model), "megatron")


BASELINES: dict[str, Callable[[PlanRequest], Plan]] = {
    "dp": plan_dp,
    "megatron": plan_megatron,
    "exhaustive": plan_exhaustive,
    "gpipe": plan_gpipe,
    "params": plan_params,
    "pipedream": plan_pipedream,
    "uniform": plan_uniform,
}
