"""Brute-force planner reference for oracle tests: every plan of a small chain, scored by tests/reference_sim.py.

Shares nothing with the planner (no ``score_candidates``, ``microbatch_grid``, ``fits``, ``stage_memory_bytes``
or the exhaustive planner): its own enumeration of cuts x replica counts x placements x micro-batch counts x
warm-up policies, its own recompute choice and memory rule (:func:`reference_sim.stage_peak_bytes`), and the
reference simulator's iteration time. The bucket size is the planner's own default, read off
``partition``'s signature, so both sides plan for the same runtime.

Placements: devices on one host are interchangeable and so are hosts (links depend only on same-host or
not), so a stage's placement is its device count per host; devices are handed out in order per host.
Recompute: a stage keeps its activations when they fit and recomputes only when they do not (recomputing
only adds time), as ``recompute="auto"`` documents.
Sharding (``sharding="auto"``): every combination over the stages of (level, keep or recompute) that fits,
each stage of several replicas trying the four levels; every combination is simulated, so nothing of the
planner's per-stage choice rule is assumed.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator

from reference_sim import (
    compute_order,
    inflight_peak,
    is_split,
    reference_run,
    stage_peak_bytes,
    stage_seconds,
)

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes.partition.dapple import partition

PLANNER_BUCKET_BYTES: int = inspect.signature(partition).parameters["allreduce_bucket_bytes"].default


def per_host_counts(replicas: tuple[int, ...], free: list[int]) -> Iterator[list[tuple[int, ...]]]:
    """Every way to take each stage's replicas from the hosts' free devices, as counts per host."""
    if not replicas:
        yield []
        return
    for counts in itertools.product(*(range(f + 1) for f in free)):
        if sum(counts) == replicas[0]:
            rest = [f - c for f, c in zip(free, counts, strict=True)]
            for tail in per_host_counts(replicas[1:], rest):
                yield [counts, *tail]


def placements(replicas: tuple[int, ...], net: Cluster) -> Iterator[list[tuple[int, ...]]]:
    """Device tuples per stage, one per distinct per-host count matrix up to reordering the hosts."""
    seen = set()
    for matrix in per_host_counts(replicas, [net.devices_per_host] * net.num_hosts):
        columns = tuple(sorted(zip(*matrix, strict=True)))
        if columns in seen:
            continue
        seen.add(columns)
        used = [0] * net.num_hosts
        devices = []
        for counts in matrix:
            stage_devices: list[int] = []
            for host, count in enumerate(counts):
                first = host * net.devices_per_host + used[host]
                stage_devices += range(first, first + count)
                used[host] += count
            devices.append(tuple(stage_devices))
        yield devices


def layouts(chain: CostChain, net: Cluster, all_devices: bool) -> Iterator[tuple[list[tuple[int, int]], tuple[int, ...]]]:
    """(block bounds per stage, replicas per stage)."""
    num_blocks = chain.num_blocks
    for num_stages in range(1, min(num_blocks, net.num_devices) + 1):
        for cuts in itertools.combinations(range(1, num_blocks), num_stages - 1):
            bounds = list(zip((0, *cuts), (*cuts, num_blocks), strict=True))
            for replicas in itertools.product(range(1, net.num_devices + 1), repeat=num_stages):
                total = sum(replicas)
                if total <= net.num_devices and (total == net.num_devices or not all_devices):
                    yield bounds, replicas


def with_recompute(plan: Plan, chain: CostChain, limit_bytes: int) -> Plan | None:
    """The plan with each stage keeping its activations if that fits, else recomputing; None if neither fits."""
    order = compute_order(plan)
    stages = []
    for stage in plan.stages:
        inflight = inflight_peak(order[stage.stage_index], is_split(order))
        for recompute in (False, True):
            candidate = plan.with_updates(stages=tuple(
                StagePlan(s.stage_index, s.first_block, s.stop_block, s.replicas, s.devices, recompute=recompute)
                if s.stage_index == stage.stage_index else s for s in plan.stages))
            if stage_peak_bytes(candidate, chain, stage.stage_index, inflight) <= limit_bytes:
                stages.append(candidate.stages[stage.stage_index])
                break
        else:
            return None
    return plan.with_updates(stages=tuple(stages))


LEVELS = ("none", "optimizer", "gradients", "parameters")


def with_every_choice(plan: Plan, chain: CostChain, limit_bytes: int) -> Iterator[Plan]:
    """The plan under every per-stage (sharding level, recompute) combination that fits in ``limit_bytes``."""
    order = compute_order(plan)
    fitting = []
    for stage in plan.stages:
        inflight = inflight_peak(order[stage.stage_index], is_split(order))
        options = []
        for level in LEVELS if stage.replicas > 1 else ("none",):
            for recompute in (False, True):
                trial = StagePlan(stage.stage_index, stage.first_block, stage.stop_block, stage.replicas,
                                  stage.devices, recompute=recompute, sharding=level)
                candidate = plan.with_updates(stages=tuple(trial if s.stage_index == stage.stage_index else s
                                                           for s in plan.stages))
                if stage_peak_bytes(candidate, chain, stage.stage_index, inflight) <= limit_bytes:
                    options.append(trial)
        if not options:
            return
        fitting.append(options)
    for stages in itertools.product(*fitting):
        yield plan.with_updates(stages=tuple(stages))


def every_plan(chain: CostChain, net: Cluster, batch: int, *, all_devices: bool = False,
               bucket_bytes: int = PLANNER_BUCKET_BYTES, sharding: str = "none") -> Iterator[Plan]:
    """Every runnable plan that fits in device memory (recompute chosen per stage; with ``sharding="auto"``
    every fitting level and recompute combination), early-backward schedule."""
    for bounds, replicas in layouts(chain, net, all_devices):
        for devices in placements(replicas, net):
            stages = tuple(StagePlan(s, first, stop, r, devices[s])
                           for s, ((first, stop), r) in enumerate(zip(bounds, replicas, strict=True)))
            for num_microbatches in range(len(stages), batch + 1):
                if batch % num_microbatches or batch // num_microbatches < max(replicas):
                    continue
                for policy in ("A", "B") if len(stages) > 1 else ("A",):
                    bare = Plan(batch, num_microbatches, stages, warmup_policy=policy,
                                allreduce_bucket_bytes=bucket_bytes)
                    if sharding == "auto":
                        yield from with_every_choice(bare, chain, net.device.memory_bytes)
                        continue
                    plan = with_recompute(bare, chain, net.device.memory_bytes)
                    if plan is not None:
                        yield plan


def compute_bound(plan: Plan, chain: CostChain, net: Cluster) -> float:
    """No device finishes before its own M forwards and backwards (largest slice): a lower bound."""
    split = is_split(compute_order(plan))
    rows = [-(-plan.microbatch_size // stage.replicas) for stage in plan.stages]
    return max(plan.num_microbatches * sum(stage_seconds(plan, chain, net, s, rows[s], split, 0.5).values())
               for s in range(plan.num_stages))


def best_plan(chain: CostChain, net: Cluster, batch: int, *, all_devices: bool = False,
              bucket_bytes: int = PLANNER_BUCKET_BYTES, sharding: str = "none") -> tuple[float, Plan] | None:
    """The fastest plan under the reference simulator (branch and bound on :func:`compute_bound`); None if
    nothing fits."""
    plans = sorted(((compute_bound(p, chain, net), index, p) for index, p in
                    enumerate(every_plan(chain, net, batch, all_devices=all_devices, bucket_bytes=bucket_bytes,
                                         sharding=sharding))),
                   key=lambda item: item[:2])
    best: tuple[float, Plan] | None = None
    for bound, _, plan in plans:
        if best is not None and bound >= best[0]:
            break
        seconds = reference_run(plan, chain, net).iteration_time_s
        if best is None or seconds < best[0]:
            best = (seconds, plan)
    return best
