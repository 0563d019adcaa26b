"""Exhaustive planner for small inputs: every partition x placement x M, exact under the simulator."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from fxpipe.core.plan import Plan
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.request import InfeasiblePlanError, PlanningError, PlanRequest, microbatch_grid
from fxpipe.passes.partition.scoring import Scored, best_dp, finish, infeasible_error, score_candidates
from fxpipe.passes.partition.spans import Candidate, Span

# Most (partition, placement, micro-batch size) combinations the exhaustive planner will enumerate.
EXHAUSTIVE_LIMIT = 300_000
EXHAUSTIVE_MAX_DEVICES = 12


def _placements(per_host: int, free: tuple[int, ...], num_stages: int,
                prefix: tuple[tuple[int, ...], ...] = ()) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Per-host device counts for every stage (idle devices allowed); hosts are interchangeable, so
    only placements whose per-host columns are in non-increasing order are produced."""
    if len(prefix) == num_stages:
        columns = list(zip(*prefix, strict=True))
        if all(columns[h] >= columns[h + 1] for h in range(len(columns) - 1)):
            yield prefix
        return
    for counts in itertools.product(*(range(f + 1) for f in free)):
        if any(counts):
            remaining = tuple(f - c for f, c in zip(free, counts, strict=True))
            yield from _placements(per_host, remaining, num_stages, (*prefix, counts))


def _devices(per_host: int, placement: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
    used = [0] * len(placement[0])
    result = []
    for counts in placement:
        devices: list[int] = []
        for host, count in enumerate(counts):
            start = host * per_host + used[host]
            devices.extend(range(start, start + count))
            used[host] += count
        result.append(tuple(devices))
    return result


def _too_large(num_blocks: int, num_devices: int) -> PlanningError:
    if num_devices > EXHAUSTIVE_MAX_DEVICES:
        return PlanningError(f"exhaustive planner: searches at most {EXHAUSTIVE_MAX_DEVICES} devices, the cluster has "
                             f"{num_devices}; use planner='dapple' or a smaller cluster")
    # the planners cut only between groups of blocks holding parameters: count those, not the stage table's blocks
    return PlanningError(f"exhaustive planner: {num_blocks} groups of blocks to cut between (each group holds "
                         f"parameters) on {num_devices} devices give more than {EXHAUSTIVE_LIMIT} candidates; use "
                         "planner='dapple' or a smaller model/cluster")


def exhaustive_candidates(model: CandidateCosts, grid: list[int], layout: tuple[int, ...] | None) -> list[Candidate]:
    """Every candidate (latency not yet computed); raises PlanningError when there are more than EXHAUSTIVE_LIMIT."""
    chain, cluster = model.chain, model.cluster
    per_host, num_blocks = cluster.devices_per_host, chain.num_blocks
    found: list[Candidate] = []
    num_partitions = sum(math.comb(num_blocks - 1, s - 1) for s in range(1, min(num_blocks, cluster.num_devices) + 1))
    if num_partitions > EXHAUSTIVE_LIMIT or cluster.num_devices > EXHAUSTIVE_MAX_DEVICES:
        # cheap early refusal: placements multiply the partitions, exponentially in the hosts
        raise _too_large(num_blocks, cluster.num_devices)
    stage_counts = [len(layout)] if layout else range(1, min(num_blocks, cluster.num_devices) + 1)
    for num_stages in stage_counts:
        device_lists = [d for p in _placements(per_host, (per_host,) * cluster.num_hosts, num_stages)
                        if (d := _devices(per_host, p)) and (layout is None or tuple(map(len, d)) == layout)]
        for cuts in itertools.combinations(range(1, num_blocks), num_stages - 1):
            stops = [*cuts, num_blocks]
            for devices in device_lists:
                spans = tuple(Span(stops[s - 1] if s else 0, stops[s], devices[s]) for s in range(num_stages))
                for rows in grid:
                    if max(map(len, devices)) <= rows and model.global_batch_size // rows >= num_stages:
                        found.append(Candidate(0.0, rows, spans))
                        if len(found) > EXHAUSTIVE_LIMIT:
                            raise _too_large(num_blocks, cluster.num_devices)
    return found


def _lower_bound(model: CandidateCosts, candidate: Candidate) -> float:
    """A time the simulator cannot beat: stage s waits for the first forward of every earlier stage (on
    its smallest slice), then its slowest replica runs M forwards and backwards, then the allreduce of
    its own parameters (with buckets, the tail they leave after the last backward); a tie group's allreduce starts after the last of its stages got that far."""
    forward, backward, first_forward = [], [], []
    rows = candidate.microbatch_rows
    for span in candidate.spans:
        cost = model.cost(span.first, span.stop, rows, len(span.devices))
        smallest = model.cost(span.first, span.stop, rows // len(span.devices), 1)  # the earliest replica
        first_forward.append(smallest.forward_s)
        forward.append(cost.forward_s)
        backward.append(cost.backward_s)
    own, ties = model.stage_allreduces(candidate.spans)
    if model.allreduce_bucket_bytes:  # buckets overlap the last backward: only their tail follows it
        own = model.allreduce_tails(candidate.spans, rows)
    num_microbatches = model.global_batch_size // candidate.microbatch_rows
    ready = [sum(first_forward[:s]) + num_microbatches * (forward[s] + backward[s]) for s in range(len(forward))]
    return max([ready[s] + own[s] for s in range(len(ready))]
               + [max(ready[s] for s in stages) + seconds for stages, seconds in ties])


def plan_exhaustive(request: PlanRequest) -> Plan:
    """The simulated-fastest plan over all candidates, by branch and bound on a valid lower bound."""
    model = request.candidate_costs()
    candidates = exhaustive_candidates(model, microbatch_grid(request), request.layout)
    feasible = [c for c in candidates if request.allows(c) and (model.fits(c.spans, c.microbatch_rows, "A")
                or model.fits(c.spans, c.microbatch_rows, "B"))]
    if not feasible:
        closest = min(candidates, key=lambda c: max(model.memory(c.spans, c.microbatch_rows, "A")), default=None)
        raise InfeasiblePlanError(f"planner 'exhaustive': {infeasible_error(request, model, closest)}")
    bounds = sorted((_lower_bound(model, c), index) for index, c in enumerate(feasible))
    best: Scored | None = None
    for bound, index in bounds:
        if best is not None and bound >= best.time_s:
            break
        candidate = model.candidate(feasible[index].spans, feasible[index].microbatch_rows)
        scored = score_candidates(request, model, [candidate], "exhaustive")
        if scored is not None and (best is None or scored.time_s < best.time_s):
            best = scored
    return finish(request, best, best_dp(request, model), None, model)
