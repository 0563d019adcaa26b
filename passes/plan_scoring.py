"""What every planner shares: the request, its errors, the micro-batch grid, and simulator scoring."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from tabulate import tabulate

from fxpipe.cluster import Cluster
from fxpipe.passes.candidates import Candidate, CostModel, Span, build_plan, with_prediction
from fxpipe.passes.chain import CostChain
from fxpipe.plan import SCHEDULES, WARMUP_POLICIES, Plan

# Largest number of micro-batches the grid offers: beyond this the bubble is already < 1% for any
# pipeline the planners build, and every extra micro-batch costs simulation time.
MAX_MICROBATCHES = 512
# On clusters with more devices than this, only the MAX_GRID_LARGE largest micro-batch sizes are tried.
LARGE_CLUSTER_DEVICES = 16
MAX_GRID_LARGE = 6
# A candidate whose simulated_lower_bound exceeds the best time by more than this is not simulated; the
# slack only absorbs float rounding between the bound's product and the simulator's running sums.
LOWER_BOUND_SLACK = 1e-9


class PlanningError(ValueError):
    """A planning request cannot be served; the message names the bad value and the fix."""


class InfeasiblePlanError(PlanningError):
    """No plan fits in device memory (or no plan satisfies the request's constraints)."""


class LayoutError(PlanningError):
    """A forced layout such as ``"3:1"`` is malformed or does not fit the cluster."""


@dataclass(frozen=True)
class PlanRequest:
    """Everything a planner needs; built and checked once by :func:`fxpipe.passes.partition.partition`."""

    chain: CostChain
    cluster: Cluster
    global_batch_size: int
    layout: tuple[int, ...] | None = None
    num_microbatches: int | None = None
    schedule: str = "early_backward"
    warmup_policy: str | None = None
    optimizer: str = "adam"
    memory_limit_bytes: int = 0
    rerank: int = 16
    progress: bool = False
    num_stages: int | None = None  # exactly this many stages (cuts fixed by pipe_split markers)
    all_devices: bool = False  # only plans that give every device a role (fxpipe.compile: every rank)

    def cost_model(self) -> CostModel:
        return CostModel(self.chain, self.cluster, self.global_batch_size, self.optimizer,
                         self.memory_limit_bytes, schedule=self.schedule)

    def policies(self) -> tuple[str, ...]:
        if self.schedule == "gpipe":
            return ("A",)  # GPipe keeps every micro-batch in flight; K_s = M regardless of policy
        return (self.warmup_policy,) if self.warmup_policy else WARMUP_POLICIES

    def allows(self, candidate: Candidate) -> bool:
        """Whether a candidate has the forced layout, stage count and device count (when they are forced)."""
        return ((self.layout is None or candidate.layout == self.layout)
                and (self.num_stages is None or len(candidate.spans) == self.num_stages)
                and (not self.all_devices or sum(candidate.layout) == self.cluster.num_devices))


def check_request(request: PlanRequest) -> None:
    """Raise a specific PlanningError for a request no planner can serve."""
    if not isinstance(request.global_batch_size, int) or request.global_batch_size < 1:
        raise PlanningError(f"global_batch_size must be a positive integer, got {request.global_batch_size!r}")
    if request.schedule not in SCHEDULES:
        raise PlanningError(f"schedule {request.schedule!r} is unknown; choose one of {SCHEDULES}")
    if request.warmup_policy is not None and request.warmup_policy not in WARMUP_POLICIES:
        raise PlanningError(f"warmup_policy {request.warmup_policy!r} is unknown; choose one of "
                            f"{WARMUP_POLICIES} or None to let the planner choose")
    if request.num_microbatches is not None:
        m = request.num_microbatches
        if not isinstance(m, int) or m < 1 or request.global_batch_size % m:
            raise PlanningError(f"global batch {request.global_batch_size} does not divide into "
                                f"num_microbatches={m!r} equal micro-batches; choose a divisor of "
                                f"{request.global_batch_size} or leave num_microbatches=None")
        if request.layout is not None and m < len(request.layout):
            raise PlanningError(f"num_microbatches={m} is fewer than the {len(request.layout)} stages of "
                                f"layout {':'.join(map(str, request.layout))}; a pipeline needs M >= S")
        if request.num_stages is not None and m < request.num_stages:
            raise PlanningError(f"num_microbatches={m} is fewer than the {request.num_stages} stages the cuts "
                                "(pipe_split markers) make; a pipeline needs M >= S")
    if request.rerank < 1:
        raise PlanningError(f"rerank must be at least 1, got {request.rerank}")


def microbatch_grid(request: PlanRequest) -> list[int]:
    """Micro-batch sizes (rows) to try: powers of two dividing the global batch, M <= MAX_MICROBATCHES."""
    gbs = request.global_batch_size
    if request.num_microbatches is not None:
        return [gbs // request.num_microbatches]
    grid = []
    rows = 1
    while rows <= gbs:
        if gbs % rows == 0 and gbs // rows <= MAX_MICROBATCHES:
            grid.append(rows)
        rows *= 2
    if gbs not in grid:
        grid.append(gbs)  # a batch that is not a power of two still gets M = 1
    grid = sorted(set(grid))
    if request.cluster.num_devices > LARGE_CLUSTER_DEVICES:
        grid = grid[-MAX_GRID_LARGE:]  # large clusters: the largest micro-batches (wide stages need rows)
    return grid


@dataclass(frozen=True)
class Scored:
    """A plan with its simulated iteration time."""

    time_s: float
    plan: Plan


def simulate_plan(plan: Plan, request: PlanRequest) -> tuple[float, float]:
    """Simulated iteration time and bubble fraction (the one exact judge of every planner)."""
    from fxpipe.simulate import simulate  # the simulator pulls in the schedule machinery lazily

    result = simulate(plan, request.chain, request.cluster, optimizer=request.optimizer, timeline=False)
    return result.iteration_time_s, result.bubble_fraction


def score_candidates(request: PlanRequest, model: CostModel, candidates: Iterable[Candidate],
                     planner: str, bound_s: float = float("inf")) -> Scored | None:
    """Simulate every candidate under every allowed warm-up policy that fits in memory; keep the fastest.

    A candidate is not simulated when it cannot be the answer: its :func:`simulated_lower_bound` is
    above the fastest time so far, or above ``bound_s`` (a time the caller already has and only a
    faster plan would replace). Simulated times are memoised on ``model`` (polish revisits plans).
    """
    best: Scored | None = None
    for candidate in candidates:
        lower_s = simulated_lower_bound(model, candidate)
        if lower_s > min(bound_s, best.time_s if best else float("inf")) * (1 + LOWER_BOUND_SLACK):
            continue
        for policy in request.policies():
            if not model.fits(candidate.spans, candidate.microbatch_rows, policy):
                continue
            key = (candidate.identity(), policy)
            plan = None
            if key not in model.simulated:
                plan = build_plan(model, candidate, schedule=request.schedule, warmup_policy=policy, planner=planner)
                model.simulated[key] = simulate_plan(plan, request)
            time_s, bubble = model.simulated[key]
            if best is None or time_s < best.time_s * (1 - 1e-12):
                plan = plan or build_plan(model, candidate, schedule=request.schedule, warmup_policy=policy,
                                          planner=planner)
                best = Scored(time_s, with_prediction(plan, time_s, bubble, candidate.latency_s, 0.0))
    return best


def simulated_lower_bound(model: CostModel, candidate: Candidate) -> float:
    """A time no simulation of ``candidate`` can beat: the busiest stage's compute, M (F_s + B_s) on its
    largest slice, then its own gradient allreduce (which starts only after its last backward)."""
    rows = candidate.microbatch_rows
    num_microbatches = model.global_batch_size // rows
    own, _ = model.stage_allreduces(candidate.spans)
    costs = [model.cost(span.first, span.stop, rows, len(span.devices)) for span in candidate.spans]
    return max(num_microbatches * (cost.forward_s + cost.backward_s) + allreduce_s
               for cost, allreduce_s in zip(costs, own, strict=True))


def dp_candidates(model: CostModel, rows_grid: Sequence[int]) -> list[Candidate]:
    """Plain data parallelism (one stage on every device) for every micro-batch size it can split."""
    devices = tuple(range(model.cluster.num_devices))
    return [model.candidate((Span(0, model.chain.num_blocks, devices),), rows)
            for rows in sorted(rows_grid, reverse=True) if rows >= len(devices)]


def best_dp(request: PlanRequest, model: CostModel) -> Scored | None:
    return score_candidates(request, model, dp_candidates(model, microbatch_grid(request)), "dp")


def finish(request: PlanRequest, best: Scored | None, dp: Scored | None, closest: Candidate | None,
           model: CostModel) -> Plan:
    """Attach the DP reference time, or raise InfeasiblePlanError explaining the closest miss."""
    if best is None:
        raise infeasible_error(request, model, closest)
    assert best.plan.predicted is not None
    dp_time = dp.time_s if dp is not None else 0.0
    return best.plan.with_updates(predicted=replace(best.plan.predicted, dp_iteration_time_s=dp_time))


def infeasible_error(request: PlanRequest, model: CostModel, closest: Candidate | None) -> InfeasiblePlanError:
    capacity = request.memory_limit_bytes
    head = (f"no plan for global batch {request.global_batch_size} fits in {capacity / 2**30:.2f} GiB per device "
            f"on cluster {request.cluster.name!r} ({request.cluster.num_devices} devices, optimizer "
            f"{request.optimizer!r})")
    if closest is None:
        return InfeasiblePlanError(head + "; no candidate satisfied the request (check the layout and "
                                   "num_microbatches against the global batch and device count)")
    memory = model.memory(closest.spans, closest.microbatch_rows, "A")
    rows = [[index, f"{span.first}..{span.stop - 1}", len(span.devices), f"{need / 2**30:.2f}",
             f"{capacity / 2**30:.2f}", "OVER" if need > capacity else "ok"]
            for index, (span, need) in enumerate(zip(closest.spans, memory, strict=True))]
    table = tabulate(rows, headers=["stage", "blocks", "replicas", "need GiB", "capacity GiB", ""])
    advice = ("fixes: use more devices (more stages split the weights), a smaller micro-batch "
              "(num_microbatches larger), an optimizer with less state (optimizer='sgd'), or a larger "
              "memory_limit_bytes if the device really has more memory")
    return InfeasiblePlanError(f"{head}.\nclosest attempt (micro-batch {closest.microbatch_rows} rows):\n"
                               f"{table}\n{advice}")
