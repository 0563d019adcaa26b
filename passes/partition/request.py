"""A planning request: what to plan (chain, cluster, batch, options), its checks, its errors and its micro-batch grid."""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.recompute import RecomputeError, RecomputeSetting, check_stage_count
from fxpipe.core.schedule import SCHEDULES, TRAINING_SCHEDULES, WARMUP_POLICIES
from fxpipe.core.sharding import ShardingError, ShardingRequest
from fxpipe.core.sharding import check_request as check_sharding
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.spans import Candidate

# Largest number of micro-batches the grid offers: beyond this the bubble is already < 1% for any
# pipeline the planners build, and every extra micro-batch costs simulation time.
MAX_MICROBATCHES = 512


# The schedule value that lets the planner pick early backward, zero-bubble or GPipe per plan.
AUTO_SCHEDULE = "auto"
# Under "auto", zero-bubble or GPipe replaces early backward only when predicted this much faster: the
# simulated ratio between two schedules was off from the measured one by up to 0.16 on local CPU ranks
# (benchmarks/runtime_fidelity.md), and a near tie picked the schedule that measured 1.2x slower.
AUTO_SWITCH_MARGIN = 0.10


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
    tensor_parallel: tuple[int, ...] | None = None  # with layout: each stage's forced group size (None: all 1)
    num_microbatches: int | None = None
    schedule: str = "early_backward"  # or "auto": each candidate under every schedule, keep the fastest
    warmup_policy: str | None = None
    optimizer: str = "adam"
    memory_limit_bytes: int = 0
    rerank: int = 16
    progress: bool = False
    num_stages: int | None = None  # exactly this many stages (cuts fixed by pipe_split markers)
    all_devices: bool = False  # only plans that give every device a role (fxpipe.compile: every rank)
    recompute: RecomputeSetting = "auto"  # checked by fxpipe.core.recompute.parse_recompute
    allreduce_bucket_bytes: int = 0  # > 0: gradient allreduce in buckets overlapping the last backward
    # "none", "auto" (the planner picks per stage), one level, or one per stage (fxpipe.core.sharding)
    sharding: ShardingRequest = "none"

    def candidate_costs(self) -> CandidateCosts:
        return CandidateCosts(self.chain, self.cluster, self.global_batch_size, self.optimizer,
                              self.memory_limit_bytes, schedule=self.schedule, recompute=self.recompute,
                              allreduce_bucket_bytes=self.allreduce_bucket_bytes, sharding=self.sharding)

    def policies(self, schedule: str | None = None) -> tuple[str, ...]:
        """Warm-up policies to try under ``schedule`` (default: the request's; not "auto")."""
        if SCHEDULES[schedule or self.schedule].all_in_flight:
            return ("A",)  # e.g. GPipe: every micro-batch in flight, K_s = M regardless of policy
        return (self.warmup_policy,) if self.warmup_policy else WARMUP_POLICIES

    def allows(self, candidate: Candidate) -> bool:
        """Whether a candidate has the forced layout, stage count and device count (when they are forced)."""
        return ((self.layout is None or (candidate.layout == self.layout and candidate.degrees == (
                    self.tensor_parallel or (1,) * len(self.layout))))
                and (self.num_stages is None or len(candidate.spans) == self.num_stages)
                and (not self.all_devices or candidate.num_devices == self.cluster.num_devices))


def check_request(request: PlanRequest) -> None:
    """Raise a specific PlanningError for a request no planner can serve."""
    if not isinstance(request.global_batch_size, int) or request.global_batch_size < 1:
        raise PlanningError(f"global_batch_size must be a positive integer, got {request.global_batch_size!r}")
    if request.schedule not in (*TRAINING_SCHEDULES, AUTO_SCHEDULE):
        raise PlanningError(f"schedule {request.schedule!r} is unknown; choose one of {sorted(TRAINING_SCHEDULES)} or "
                            f"{AUTO_SCHEDULE!r} (the planner picks per plan)")
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
    if isinstance(request.recompute, tuple):
        _check_recompute_stages(request.recompute, request.layout, request.num_stages)
    if request.schedule == "zero_bubble" and (request.recompute == "always" or (
            isinstance(request.recompute, tuple) and any(request.recompute))):
        raise PlanningError(f"recompute={request.recompute!r} with schedule='zero_bubble': split backward (B, then W "
                            "on the same graph) cannot rerun a checkpointed forward; use schedule='early_backward' "
                            "or 'auto' (the planner then keeps zero-bubble for plans that need no recomputation)")
    try:
        sharding = check_sharding(request.sharding)
    except ShardingError as error:
        raise PlanningError(str(error)) from None
    if not isinstance(sharding, str):
        _check_sharding_stages(tuple(sharding), request.layout, request.num_stages)
    explicit = (sharding,) if isinstance(sharding, str) else sharding
    if request.schedule == "zero_bubble" and "parameters" in explicit:
        raise PlanningError(f"sharding={request.sharding!r} with schedule='zero_bubble': ZeRO-3 ('parameters') "
                            "frees the gathered weights after each forward, but a micro-batch's W runs after later "
                            "forwards (docs/sharding.md); use 'gradients' or 'optimizer' with zero_bubble, "
                            "schedule='early_backward' with 'parameters', or schedule='auto'")
    bucket = request.allreduce_bucket_bytes
    if not isinstance(bucket, int) or isinstance(bucket, bool) or bucket < 0:
        raise PlanningError(f"allreduce_bucket_bytes must be a non-negative integer (0: one allreduce after "
                            f"backward), got {bucket!r}")
    if request.rerank < 1:
        raise PlanningError(f"rerank must be at least 1, got {request.rerank}")


def _check_recompute_stages(recompute: tuple[bool, ...], layout: tuple[int, ...] | None,
                            num_stages: int | None) -> None:
    """A per-stage recompute setting needs the stage count fixed (a layout or cuts) and matching."""
    counts = {len(layout)} if layout is not None else set()
    counts |= {num_stages} if num_stages is not None else set()
    if not counts:
        raise PlanningError(f"recompute gives per-stage choices {recompute} but the stage count is the planner's "
                            "choice; force a layout such as '1:1' (or pipe_split cuts), or use 'auto'/'never'/"
                            "'always'")
    try:
        for count in counts:
            check_stage_count(recompute, count)
    except RecomputeError as error:
        raise PlanningError(str(error)) from None


def _check_sharding_stages(levels: tuple[str, ...], layout: tuple[int, ...] | None, num_stages: int | None) -> None:
    """Per-stage sharding levels need the stage count fixed (a layout or cuts) and matching, as per-stage recompute."""
    counts = {len(layout)} if layout is not None else set()
    counts |= {num_stages} if num_stages is not None else set()
    if not counts:
        raise PlanningError(f"sharding gives per-stage levels {list(levels)} but the stage count is the planner's "
                            "choice; force a layout such as '2:2' (or pipe_split cuts), or give one level for every "
                            "stage or 'auto'")
    for count in counts:
        if len(levels) != count:
            raise PlanningError(f"sharding gives {len(levels)} per-stage levels {list(levels)} but the plan has "
                                f"{count} stages; give {count} levels or one level for every stage or 'auto'")
    if layout is not None:
        for index, (level, replicas) in enumerate(zip(levels, layout, strict=True)):
            if level != "none" and replicas == 1:
                raise PlanningError(f"sharding[{index}] is {level!r} but layout stage {index} has 1 replica, which "
                                    "has nothing to split; give it 'none' or more replicas")


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
    return sorted(set(grid))
