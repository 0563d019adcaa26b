"""The DAPPLE planner over a cost chain, and ``partition``: the one entry point that dispatches to every planner."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from tqdm import tqdm

from fxpipe.core.block_recompute import expanded_choices
from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import BaselineResult, Plan
from fxpipe.core.recompute import RecomputeError, RecomputeSetting, parse_recompute
from fxpipe.core.sharding import ShardingRequest
from fxpipe.passes.partition import baselines, seeds
from fxpipe.passes.partition.block_partition import (
    coarse_boundaries,
    coarsen_chain,
    parameter_groups,
    refine_cuts,
)
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.cut_scores import cut_scorer
from fxpipe.passes.partition.every_device import plan_every_device
from fxpipe.passes.partition.layout import (
    check_degrees,
    parse_layout,
    parse_stage_layout,
    replicated_block_notes,
)
from fxpipe.passes.partition.placement import host_aligned
from fxpipe.passes.partition.polish import polish
from fxpipe.passes.partition.request import (
    AUTO_SCHEDULE,
    InfeasiblePlanError,
    LayoutError,
    PlanningError,
    PlanRequest,
    check_request,
    microbatch_grid,
)
from fxpipe.passes.partition.scoring import Scored, best_dp, finish, score_candidates
from fxpipe.passes.partition.search import search
from fxpipe.passes.partition.selective import with_block_node_counts
from fxpipe.passes.partition.spans import Candidate, Span, spans_from_stops
from fxpipe.passes.partition.virtual_plan import plan_virtual
from fxpipe.passes.partition.virtual_request import check_virtual_layout, virtual_request
from fxpipe.sim.allreduce_overlap import DEFAULT_BUCKET_BYTES
from fxpipe.sim.tensor_parallel_cost import tensor_parallel_degrees, tied_degree_conflict

__all__ = ["PLANNERS", "InfeasiblePlanError", "LayoutError", "PlanningError", "on_fine_chain", "parse_layout", "partition",
           "parse_stage_layout", "plan_dapple"]

# Chains longer than this are searched on merged groups of blocks, then the cuts are refined.
MAX_SEARCH_BLOCKS = 32
MAX_SEARCH_BLOCKS_LARGE = 16  # on host-aligned (large) clusters
DEEP_RERANK = 2  # fine-chain seeds past a coarsened search (_search_all) refined and simulated apart


def _fine_spans(spans: Iterable[Span], stops: list[int]) -> list[Span]:
    return [Span(stops[s.first - 1] if s.first else 0, stops[s.stop - 1], s.devices, s.tensor_parallel) for s in spans]


def _refined(model: CandidateCosts, candidate: Candidate, stops: list[int]) -> Candidate:
    """Map a coarse candidate to the fine chain and move its cuts where the pivot model prefers."""
    return _with_refined_cuts(model, _fine_spans(candidate.spans, stops), candidate.microbatch_rows)


def _with_refined_cuts(model: CandidateCosts, spans: list[Span], rows: int) -> Candidate:
    """The candidate of ``spans`` (on ``model``'s chain) with its cuts moved where the pivot model prefers."""
    devices = [span.devices for span in spans]
    degrees = [span.tensor_parallel for span in spans]

    def rebuilt(cut_stops: list[int]) -> list[Span]:
        return spans_from_stops(cut_stops, devices, degrees)

    scored: dict[tuple[int, ...], float] = {}  # refine_cuts tries a position again after each move next to it
    kept = cut_scorer(model, spans, rows)  # the same figures, each stage's kept (None: tied weights, sharding...)

    def score(cut_stops: list[int]) -> float:
        key = tuple(cut_stops)
        if key not in scored and kept is not None:
            scored[key] = kept(cut_stops)
        elif key not in scored:
            trial = rebuilt(cut_stops)
            scored[key] = model.latency(trial, rows) if model.fits(trial, rows) else float("inf")
        return scored[key]

    best = refine_cuts([span.stop for span in spans], model.chain.num_blocks, score)
    return model.candidate(rebuilt(best), rows)


def _search_all(request: PlanRequest, model: CandidateCosts, grid: list[int],
                bound_s: float) -> tuple[list[Candidate], Candidate | None, list[Candidate]]:
    """Run the state search for every micro-batch size; returns the candidates, the closest miss and, where the
    search ran on a coarsened chain, seeds on the fine chain that it can miss: pipelines deeper than its groups
    and uniform contiguous layouts (:mod:`fxpipe.passes.partition.seeds`). The seeds are kept apart:
    :func:`plan_dapple` refines, simulates and polishes the best of them after the search's own best, and takes
    them only where the simulator predicts them faster, so they never crowd the search's best out of its pool."""
    chain = request.chain
    stops = list(range(1, chain.num_blocks + 1))
    search_model = model
    max_blocks = MAX_SEARCH_BLOCKS_LARGE if host_aligned(request.cluster) else MAX_SEARCH_BLOCKS
    if chain.num_blocks > max_blocks:
        stops = coarse_boundaries(chain, max_blocks)
        search_model = CandidateCosts(coarsen_chain(chain, stops), request.cluster, request.global_batch_size,
                                      request.optimizer, request.memory_limit_bytes, schedule=request.schedule,
                                      recompute=request.recompute,
                                      allreduce_bucket_bytes=request.allreduce_bucket_bytes,
                                      sharding=request.sharding)
    found: list[Candidate] = []
    closest: Candidate | None = None
    closest_ratio = float("inf")
    for rows in tqdm(grid, desc="dapple: micro-batch sizes", disable=not request.progress):
        evens = [c for c in seeds.even_pipelines(search_model, rows) if request.allows(c)]
        found.extend(evens)
        bound_s = min([bound_s, *(c.latency_s for c in evens)])
        result = search(search_model, rows, layout=request.layout, bound_s=bound_s, pool_size=request.rerank,
                        num_stages=request.num_stages, accept=request.allows, degrees=request.tensor_parallel)
        found.extend(result.candidates)
        if result.closest_ratio < closest_ratio:
            closest, closest_ratio = result.closest_miss, result.closest_ratio
        bound_s = min([bound_s, *(c.latency_s for c in result.candidates)])
    deep: list[Candidate] = []
    if search_model is not model:
        found = [_refined(model, c, stops) for c in sorted(found)[: 2 * request.rerank]]
        if closest is not None:
            closest = model.candidate(_fine_spans(closest.spans, stops), closest.microbatch_rows)
            if model.fits(closest.spans, closest.microbatch_rows) and request.allows(closest):
                found.append(closest)  # a coarse miss that fits once its groups are the fine chain's blocks
        deep = [c for rows in grid
                for c in (*seeds.deep_pipelines(model, rows, max_blocks), *seeds.uniform_pipelines(model, rows))
                if request.allows(c)]
    return found, closest, deep


def _grid_seeds(request: PlanRequest, model: CandidateCosts) -> list[Candidate]:
    """With tensor-parallel blocks: the uniform T x P x D grid points that fit (the ``megatron`` baseline's), so
    the plan is never slower than what people search by hand; none otherwise (plans stay as without TP)."""
    if tensor_parallel_degrees(request.chain, request.cluster.devices_per_host) == (1,):
        return []
    return [c for c in baselines.megatron_candidates(request, model)
            if request.allows(c) and model.fits(c.spans, c.microbatch_rows)]


def _top(candidates: Iterable[Candidate], count: int) -> list[Candidate]:
    """The ``count`` best by the pivot model, plus the best of every other layout among the next ones.

    The pivot model can misjudge one layout against another by several percent, so each layout
    near the top gets at least one simulation.
    """
    unique: dict[tuple[object, ...], Candidate] = {}
    for candidate in sorted(candidates):
        unique.setdefault(candidate.identity(), candidate)
    ordered = list(unique.values())
    chosen = ordered[:count]
    layouts = {c.layout for c in chosen}
    for candidate in ordered[count:4 * count]:
        if candidate.layout not in layouts and len(chosen) < count + count // 2:
            layouts.add(candidate.layout)
            chosen.append(candidate)
    return chosen


def _runs_tied(chain: CostChain, candidate: Candidate) -> bool:
    """Whether the runtime can run ``candidate``'s tied weights (their holders share one T)."""
    return not tied_degree_conflict(chain, [(span.first, span.stop, span.tensor_parallel) for span in candidate.spans])


def _plan_runs_tied(chain: CostChain, plan: Plan) -> bool:
    return not tied_degree_conflict(chain, [(stage.first_block, stage.stop_block, stage.tensor_parallel)
                                            for stage in plan.stages])


def _polished(request: PlanRequest, model: CandidateCosts, best: Scored | None, grid: list[int]) -> Scored | None:
    """``best`` after :func:`polish` (kept as it is where the polished plan's tied weights could not run)."""
    if best is None:
        return None
    polished = polish(request, model, best, grid, "dapple")
    return polished if _plan_runs_tied(model.chain, polished.plan) else best


def plan_dapple(request: PlanRequest) -> Plan:
    """DAPPLE: state search by the pivot model, whole-pipeline replication, simulator re-ranking, DP floor."""
    model = request.candidate_costs()
    grid = [rows for rows in microbatch_grid(request) if request.layout is None or rows >= max(request.layout)]
    forced_dp = request.layout == (request.cluster.num_devices,)
    dp_allowed = (request.layout is None or forced_dp) and request.num_stages in (None, 1)
    dp = best_dp(request, model) if dp_allowed else None
    bound = dp.plan.predicted.analytic_iteration_time_s if dp and dp.plan.predicted else float("inf")
    grids = _grid_seeds(request, model)
    bound = min([bound, *(c.latency_s for c in grids)])
    found, closest, deep = _search_all(request, model, grid, bound)
    found.extend(grids)
    if request.layout is None:
        found.extend(c for c in seeds.replicated_pipelines(model, grid) if request.allows(c))
    found = [candidate for candidate in found if _runs_tied(model.chain, candidate)]
    best = _polished(request, model, score_candidates(request, model, _top(found, request.rerank), "dapple"), grid)
    deep = [candidate for candidate in deep if _runs_tied(model.chain, candidate)]
    refined = [c for c in (_with_refined_cuts(model, list(seed.spans), seed.microbatch_rows)
                           for seed in _top(deep, DEEP_RERANK)) if _runs_tied(model.chain, c)]
    deep_best = _polished(request, model, score_candidates(request, model, refined, "dapple"), grid)
    if deep_best is not None and (best is None or deep_best.time_s < best.time_s):
        best = deep_best
    # every grid point simulated, not only those the pivot model ranks in the pool: it charges a stage that does
    # not fit a whole recomputation, where the plan recomputes a few blocks, and so ranked Megatron-Bridge's TP4
    # PP8 layout for 70B on 64 GPUs 25% slow (benchmarks/issue33_rows.md); a few dozen points, a second or so
    grid_best = _polished(request, model, score_candidates(request, model, [c for c in sorted(grids)
                                                                            if _runs_tied(model.chain, c)], "dapple"),
                          grid)
    if grid_best is not None and (best is None or grid_best.time_s < best.time_s):
        best = grid_best
    if dp is not None and (best is None or dp.time_s <= best.time_s):
        best = dp.__class__(dp.time_s, dp.plan.with_updates(planner="dapple"))
    if best is None and closest is None and grid:
        closest = seeds.least_memory(request, model, grid)
    return finish(request, best, dp, closest, model)


Planner = Callable[[PlanRequest], Plan]

PLANNERS: dict[str, Planner] = {"dapple": plan_dapple, **baselines.BASELINES}


def _baseline_results(request: PlanRequest) -> tuple[tuple[str, BaselineResult], ...]:
    if request.schedule == AUTO_SCHEDULE:  # the baselines keep their published schedule, early backward
        request = replace(request, schedule="early_backward")
    request = replace(request, sharding="none")  # and their published data parallelism: unsharded replicas
    results = []
    for name, planner in sorted(baselines.BASELINES.items()):
        try:
            plan = planner(request)
        except PlanningError as error:
            results.append((name, BaselineResult(layout="", iteration_time_s=None, feasible=False,
                                                 note=str(error).splitlines()[0])))
            continue
        assert plan.predicted is not None
        results.append((name, BaselineResult(layout=plan.layout, iteration_time_s=plan.predicted.iteration_time_s,
                                             num_microbatches=plan.num_microbatches)))
    return tuple(results)


def on_fine_chain(plan: Plan, chain: CostChain, stops: list[int]) -> Plan:
    """A plan made on the parameter-grouped chain, restated in the blocks of the original ``chain``."""
    if len(stops) == chain.num_blocks:
        return plan

    def fine(index: int) -> int:
        return stops[index - 1] if index else 0

    stages = tuple(replace(stage, first_block=fine(stage.first_block), stop_block=fine(stage.stop_block),
                           block_recompute=expanded_choices(stage.block_recompute, stage.first_block, stops))
                   for stage in plan.stages)
    return plan.with_updates(stages=stages, num_blocks=chain.num_blocks,
                             block_names=tuple(block.name for block in chain.blocks))


def _planned(request: PlanRequest, planner: Planner) -> Plan:
    return plan_every_device(request, planner) if request.all_devices else planner(request)


def _no_slower_than_unsharded(plan: Plan, request: PlanRequest, planner: Planner) -> Plan:
    """``sharding="auto"``: the unsharded plan instead when it is predicted faster.

    Every unsharded plan is an ``"auto"`` candidate too, but the search keeps a pool ranked by the pivot
    model for the simulator to score, and sharded candidates can crowd the best unsharded one out of it
    (benchmarks/sharding_study.md once found ``"auto"`` 0.97x the unsharded plan); planning both keeps
    ``"auto"`` never slower than ``"none"`` by the simulator's own figures.
    """
    try:
        unsharded = _planned(replace(request, sharding="none"), planner)
    except InfeasiblePlanError:
        return plan
    if plan.predicted is None or unsharded.predicted is None:
        return plan
    sharded_s, unsharded_s = plan.predicted.iteration_time_s, unsharded.predicted.iteration_time_s
    if unsharded_s >= sharded_s:
        return plan
    note = (f"sharding='auto': the best unsharded plan ({unsharded_s * 1e3:.3f} ms per iteration) is predicted "
            f"faster than the best sharded one the search found (layout {plan.layout}, {sharded_s * 1e3:.3f} ms)")
    return unsharded.with_updates(notes=(*unsharded.notes, note))


def _check_num_stages(num_stages: int | None, planner: str, num_groups: int) -> None:
    if num_stages is None:
        return
    if planner != "dapple":
        raise PlanningError(f"planner {planner!r} cannot keep fixed cuts (num_stages={num_stages}); use 'dapple'")
    if not 1 <= num_stages <= num_groups:
        raise PlanningError(f"num_stages={num_stages} but the model has {num_groups} cuttable block(s) "
                            "(runs of layers holding parameters); every stage needs parameters")


def _recompute_setting(value: object) -> RecomputeSetting:
    try:
        return parse_recompute(value)
    except RecomputeError as error:
        raise PlanningError(str(error)) from None


def partition(chain: CostChain, cluster: Cluster, global_batch_size: int, *, planner: str = "dapple",
              layout: str | None = None, num_microbatches: int | None = None,
              schedule: str = "early_backward", warmup_policy: str | None = None, optimizer: str = "adam",
              memory_limit_bytes: int | None = None, rerank: int = 16, progress: bool = False,
              compare: bool = False, num_stages: int | None = None, all_devices: bool = False,
              recompute: object = "auto", allreduce_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
              sharding: ShardingRequest = "none", virtual_stages: int | str = 1) -> Plan:
    """Plan hybrid pipeline + data parallel training of ``chain`` on ``cluster``.

    ``planner`` is a key of :data:`PLANNERS`; ``layout`` forces replica counts per stage
    (``"3:1"``, ``"dp"``) and leaves cuts and placement to the planner; ``compare`` also runs
    every baseline and records its simulated time in ``Plan.baselines``; ``num_stages`` (DAPPLE only)
    keeps exactly that many stages (``fxpipe.planning.plan_markers`` passes one block per stage).
    ``all_devices`` (what ``fxpipe.compile`` asks: every launched rank gets a role) keeps only plans
    using every device; when a plan on fewer devices is predicted faster, the plan's ``notes`` say so.
    ``recompute`` (:func:`fxpipe.core.recompute.parse_recompute`): ``"auto"`` recomputes a stage's activations
    in backward only where keeping them does not fit in memory; ``"never"``, ``"always"`` or per stage.
    ``allreduce_bucket_bytes``: each stage all-reduces its gradients in buckets of this size as its last
    backward produces them (0: one allreduce after it); recorded in the plan for the runtime.
    ``sharding`` (:mod:`fxpipe.core.sharding`): ``"none"`` (DAPPLE's replicas), ``"auto"`` (each stage the
    fastest level that fits, decided with recompute), one level for every replicated stage, or one level per
    stage (the stage count fixed by ``layout`` or ``num_stages``); recorded as ``stages[*].sharding``.
    ``--compare``'s baselines stay unsharded. ``virtual_stages`` (docs/virtual_stages.md): 1 (default) one stage
    per device group; a number of chunks per group, or ``"auto"`` (the planner chooses, 1 included), with a
    schedule that runs chunks (``"interleaved"``, ``"interleaved_zero_bubble"``, ``"zbv"``; ``"dapple"``,
    ``"zero_bubble"`` and ``"auto"`` map to them).
    Every stage holds parameters: cuts fall only between :func:`parameter_groups`, so the README's
    ``torch.optim.AdamW(pipe.parameters())`` works on every rank.
    """
    start = time.perf_counter()
    if planner not in PLANNERS:
        raise PlanningError(f"planner {planner!r} is unknown; choose one of {sorted(PLANNERS)}")
    stops = parameter_groups(chain)
    grouped = chain if len(stops) == chain.num_blocks else coarsen_chain(chain, stops)
    _check_num_stages(num_stages, planner, grouped.num_blocks)
    virtual = virtual_request(virtual_stages, schedule, planner=planner, num_stages=num_stages, sharding=sharding)
    forced, degrees = (None, None) if layout is None else parse_stage_layout(
        layout, cluster.num_devices, grouped.num_blocks, cluster.devices_per_host)
    if virtual is not None:
        check_virtual_layout(virtual, forced, layout, grouped.num_blocks, num_microbatches)
        schedule = virtual.plain_schedule
    if degrees is not None:
        check_degrees(str(layout), degrees, grouped)
    if all_devices and forced is not None and degrees is not None:
        used = sum(r * t for r, t in zip(forced, degrees, strict=True))
        if used != cluster.num_devices:
            raise LayoutError(f"layout {layout!r} uses {used} of the {cluster.num_devices} devices (replicas x T "
                              f"per stage), but every device (rank) needs a role; give the stages "
                              f"{cluster.num_devices} devices in all or launch {used} ranks")
    request = PlanRequest(
        chain=grouped, cluster=cluster, global_batch_size=global_batch_size, layout=forced,
        tensor_parallel=degrees if degrees is not None and any(t > 1 for t in degrees) else None,
        num_microbatches=num_microbatches, schedule=schedule, warmup_policy=warmup_policy,
        optimizer=optimizer, memory_limit_bytes=memory_limit_bytes or cluster.device.memory_bytes,
        rerank=rerank, progress=progress, num_stages=num_stages, all_devices=all_devices,
        recompute=_recompute_setting(recompute), allreduce_bucket_bytes=allreduce_bucket_bytes,
        sharding=sharding if isinstance(sharding, str) else tuple(sharding),
    )
    check_request(request)
    plan = _planned(request, PLANNERS[planner])
    if request.sharding == "auto":
        plan = _no_slower_than_unsharded(plan, request, PLANNERS[planner])
    if virtual is not None:
        plan = plan_virtual(request, virtual, plan, forced_layout=forced is not None, compare=compare)
    if compare:
        plan = plan.with_updates(baselines=(*plan.baselines, *_baseline_results(request)))
    plan = with_block_node_counts(on_fine_chain(plan, chain, stops), chain)
    return plan.with_updates(notes=(*plan.notes, *replicated_block_notes(plan, chain)),
                             planning_time_s=time.perf_counter() - start)
