"""What every planner shares after the request: simulator scoring of candidates, the DP floor, and the final plan."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from tabulate import tabulate

from fxpipe.core.plan import Plan
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.passes.partition.pipeline_bound import pipeline_lower_bound
from fxpipe.passes.partition.plan_build import build_plan, with_prediction
from fxpipe.passes.partition.request import (
    AUTO_SCHEDULE,
    AUTO_SWITCH_MARGIN,
    InfeasiblePlanError,
    PlanRequest,
    microbatch_grid,
)
from fxpipe.passes.partition.spans import Candidate, Span
from fxpipe.sim.stagecost import step_close_time

# A candidate whose simulated_lower_bound exceeds the best time by more than this is not simulated; the
# slack only absorbs float rounding between the bound's product and the simulator's running sums.
LOWER_BOUND_SLACK = 1e-9


@dataclass(frozen=True)
class Scored:
    """A plan with its simulated iteration time."""

    time_s: float
    plan: Plan


def simulate_plan(plan: Plan, request: PlanRequest) -> tuple[float, float]:
    """Simulated iteration time and bubble fraction (the one exact judge of every planner)."""
    from fxpipe.sim.simulate import simulate  # the simulator pulls in the schedule machinery lazily

    result = simulate(plan, request.chain, request.cluster, optimizer=request.optimizer, timeline=False)
    return result.iteration_time_s, result.bubble_fraction


def score_candidates(request: PlanRequest, model: CandidateCosts, candidates: Iterable[Candidate],
                     planner: str, bound_s: float = float("inf")) -> Scored | None:
    """Simulate every candidate under every allowed schedule and warm-up policy that fits in memory;
    keep the fastest (the first on ties: candidates in the order given).

    A candidate is not simulated when it cannot be the answer: its :func:`simulated_lower_bound` is
    above the fastest time so far, or above ``bound_s`` (a time the caller already has and only a
    faster plan would replace). Simulated times are memoised on ``model`` (polish revisits plans).
    """
    best: Scored | None = None
    for candidate in candidates:
        lower_s = simulated_lower_bound(model, candidate)
        if lower_s > min(bound_s, best.time_s if best else float("inf")) * (1 + LOWER_BOUND_SLACK):
            continue
        scored = _score_candidate(request, model, candidate, planner)
        if scored is not None and (best is None or scored.time_s < best.time_s * (1 - 1e-12)):
            best = scored
    return best


def simulated_lower_bound(model: CandidateCosts, candidate: Candidate) -> float:
    """A time no simulation of ``candidate`` can beat, under any schedule: the busiest stage's compute,
    M (F_s + B_s) on its largest slice (recomputation and split backward only add or move work), then
    its own gradient allreduce, or with buckets the tail left after its last backward; under a sharding
    request, the least of that and every allowed level's collectives in one step (a sharded stage runs
    them all before, inside or after its compute: :mod:`fxpipe.sim.sharding_cost`)."""
    rows = candidate.microbatch_rows
    num_microbatches = model.global_batch_size // rows
    if model.allreduce_bucket_bytes:
        own = model.allreduce_tails(candidate.spans, rows)
    else:
        own, _ = model.stage_allreduces(candidate.spans)
    if model.sharding != "none":
        own = [min(seconds, model.least_comm_seconds(span, num_microbatches))
               for span, seconds in zip(candidate.spans, own, strict=True)]
    costs = [model.cost(span.first, span.stop, rows, span.replicas, span.tensor_parallel) for span in candidate.spans]
    return max(max(num_microbatches * (cost.forward_s + cost.backward_s) + allreduce_s
                   for cost, allreduce_s in zip(costs, own, strict=True)),
               pipeline_lower_bound(model, candidate, costs, own if model.sharding == "none" else None))


def _score_candidate(request: PlanRequest, model: CandidateCosts, candidate: Candidate,
                     planner: str) -> Scored | None:
    """The candidate's fastest schedule. Under ``"auto"``: early backward (policies A and B) first, then
    zero-bubble with the better policy (same memory), then GPipe; another schedule must be predicted at
    least :data:`AUTO_SWITCH_MARGIN` faster to replace early backward (the simulator's ratio between two
    schedules was off by up to 0.16 on local CPU ranks: benchmarks/runtime_fidelity.md), so the default
    stays unless another schedule clearly wins."""
    best: Scored | None = None
    forced_recompute = request.recompute == "always" or (isinstance(request.recompute, tuple) and any(request.recompute))
    zero3 = request.sharding == "parameters" or (not isinstance(request.sharding, str) and "parameters" in request.sharding)

    def trial(schedule: str, policy: str, margin: float = 1e-12) -> None:
        nonlocal best
        if schedule == "zero_bubble" and (forced_recompute or zero3):  # split backward cannot rerun a
            return  # checkpointed forward, nor keep ZeRO-3's weights to W
        if not model.fits(candidate.spans, candidate.microbatch_rows, policy, schedule):
            return
        key = (candidate.identity(), schedule, policy)
        plan = None
        if key not in model.simulated:
            plan = build_plan(model, candidate, schedule=schedule, warmup_policy=policy, planner=planner)
            model.simulated[key] = simulate_plan(plan, request)
        time_s, bubble = model.simulated[key]
        if best is None or time_s < best.time_s * (1 - margin):
            plan = plan or build_plan(model, candidate, schedule=schedule, warmup_policy=policy, planner=planner)
            # the pivot model's figure: the candidate's own, or that of the schedule tried when it differs
            analytic_s = candidate.latency_s + step_close_time(request.cluster, plan.all_devices())
            if schedule == "zero_bubble" and model.schedule != schedule:
                analytic_s = analytic_iteration_time(plan, request.chain, request.cluster)
            best = Scored(time_s, with_prediction(plan, time_s, bubble, analytic_s, 0.0))

    auto = request.schedule == AUTO_SCHEDULE
    first = "early_backward" if auto else request.schedule
    for policy in request.policies(first):
        trial(first, policy)
    if auto and best is not None:  # neither fits when early backward does not (same or more memory)
        trial("zero_bubble", best.plan.warmup_policy, AUTO_SWITCH_MARGIN)
        trial("gpipe", "A", AUTO_SWITCH_MARGIN)
    return best


def dp_candidates(model: CandidateCosts, rows_grid: Sequence[int]) -> list[Candidate]:
    """Plain data parallelism (one stage on every device) for every micro-batch size it can split."""
    devices = tuple(range(model.cluster.num_devices))
    return [model.candidate((Span(0, model.chain.num_blocks, devices),), rows)
            for rows in sorted(rows_grid, reverse=True) if rows >= len(devices)]


def best_dp(request: PlanRequest, model: CandidateCosts) -> Scored | None:
    return score_candidates(request, model, dp_candidates(model, microbatch_grid(request)), "dp")


def finish(request: PlanRequest, best: Scored | None, dp: Scored | None, closest: Candidate | None,
           model: CandidateCosts) -> Plan:
    """Attach the DP reference time, or raise InfeasiblePlanError explaining the closest miss."""
    if best is None:
        raise infeasible_error(request, model, closest)
    assert best.plan.predicted is not None
    dp_time = dp.time_s if dp is not None else 0.0
    return best.plan.with_updates(predicted=replace(best.plan.predicted, dp_iteration_time_s=dp_time))


def memory_unit(capacity_bytes: float) -> tuple[str, int]:
    """The binary unit a device of ``capacity_bytes`` reads best in (GiB from 1 GiB up, else MiB or KiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if capacity_bytes >= scale:
            return unit, scale
    return "KiB", 2**10


def apart(need: float, capacity: float, scale: int) -> tuple[str, str]:
    """``need`` and ``capacity`` in units of ``scale``, with 2 decimals or as many more (up to 6) as keep two
    different byte counts from reading the same."""
    for decimals in range(2, 7):
        shown = (f"{need / scale:.{decimals}f}", f"{capacity / scale:.{decimals}f}")
        if need == capacity or shown[0] != shown[1]:
            return shown
    return shown


def infeasible_error(request: PlanRequest, model: CandidateCosts, closest: Candidate | None) -> InfeasiblePlanError:
    capacity = request.memory_limit_bytes
    unit, scale = memory_unit(capacity)
    head = (f"no plan for global batch {request.global_batch_size} fits in {capacity / scale:.2f} {unit} per device "
            f"on cluster {request.cluster.name!r} ({request.cluster.num_devices} devices, optimizer "
            f"{request.optimizer!r})")
    if closest is None:
        return InfeasiblePlanError(head + "; no candidate satisfied the request (check the layout and "
                                   "num_microbatches against the global batch and device count)")
    memory = model.memory(closest.spans, closest.microbatch_rows, "A")
    rows = [[index, f"{span.first}..{span.stop - 1}", span.replicas if span.tensor_parallel == 1 else
             f"{span.replicas}x{span.tensor_parallel}", *apart(need, capacity, scale),
             "OVER" if need > capacity else "ok"]
            for index, (span, need) in enumerate(zip(closest.spans, memory, strict=True))]
    table = tabulate(rows, headers=["stage", "blocks", "replicas", f"need {unit}", f"capacity {unit}", ""],
                     disable_numparse=True, colalign=("right", "left", "right", "right", "right", "left"))
    advice = ("fixes: use more devices (more stages split the weights), a smaller micro-batch "
              "(num_microbatches larger), an optimizer with less state (optimizer='sgd'), or a larger "
              "memory_limit_bytes if the device really has more memory"
              + (", or recompute='auto' (recompute activations where they do not fit)"
                 if request.recompute == "never" else "")
              + (", or sharding='auto' (ZeRO-1/2/3 inside replicated stages where that fits)"
                 if request.sharding == "none" else ""))
    return InfeasiblePlanError(f"{head}.\nclosest attempt (micro-batch {closest.microbatch_rows} rows):\n"
                               f"{table}\n{advice}")
