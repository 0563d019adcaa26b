"""Plans that give every device a role (``fxpipe.compile`` runs on every launched rank), with a note when fewer would be faster."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from fxpipe.core.plan import Plan
from fxpipe.passes.partition.request import InfeasiblePlanError, PlanningError, PlanRequest


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def _predicted_s(plan: Plan) -> float:
    return plan.predicted.iteration_time_s if plan.predicted is not None else float("inf")


def fewer_devices_note(plan: Plan, fewer: Plan) -> str | None:
    """The note for ``plan`` (every device) when ``fewer`` (a plan on fewer devices) is predicted faster."""
    every_s, fewer_s = _predicted_s(plan), _predicted_s(fewer)
    if fewer.world_size >= plan.world_size or not fewer_s < every_s:
        return None
    return (f"a plan on {fewer.world_size} of the {plan.world_size} devices (layout {fewer.layout}, "
            f"{fewer_s * 1e3:.3f} ms per iteration) is predicted {100 * (1 - fewer_s / every_s):.1f}% faster "
            f"than this plan on all of them ({every_s * 1e3:.3f} ms); launch {_ranks(fewer.world_size)} to run it")


def plan_every_device(request: PlanRequest, planner: Callable[[PlanRequest], Plan]) -> Plan:
    """``planner``'s best plan that uses every device of the cluster.

    The unconstrained plan is made first: when it already uses every device it is the answer;
    otherwise the constrained plan follows and its notes compare the two.
    """
    num_devices = request.cluster.num_devices
    fewer = planner(replace(request, all_devices=False))
    if fewer.world_size == num_devices:
        return fewer
    try:
        plan = planner(replace(request, all_devices=True))
    except InfeasiblePlanError as error:
        raise InfeasiblePlanError(
            f"no plan for global batch {request.global_batch_size} gives all {num_devices} devices of cluster "
            f"{request.cluster.name!r} a role (a stage cannot have more replicas than a micro-batch has rows, nor "
            f"more stages than micro-batches); the best plan uses {fewer.world_size} (layout {fewer.layout}): "
            f"launch {_ranks(fewer.world_size)}, or use a larger global batch") from error
    if plan.world_size != num_devices:
        raise PlanningError(f"planner {plan.planner!r} made a plan on {plan.world_size} of the {num_devices} devices "
                            "but every device (rank) needs a role; use the 'dapple' or 'dp' planner")
    note = fewer_devices_note(plan, fewer)
    return plan.with_updates(notes=(*plan.notes, note)) if note else plan
