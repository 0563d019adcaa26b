"""Virtual stages chosen with the plan: the plain plan's groups re-cut into chunks when that is predicted faster."""

from __future__ import annotations

from dataclasses import replace

from fxpipe.core.plan import BaselineResult, Plan
from fxpipe.passes.partition.request import InfeasiblePlanError, PlanRequest
from fxpipe.passes.partition.virtual_request import VirtualRequest
from fxpipe.passes.partition.virtual_search import best_virtual

# The name of the plain plan (v = 1) in ``Plan.baselines`` when the chosen plan has virtual stages.
PLAIN_BASELINE = "dapple_v1"


def plan_virtual(request: PlanRequest, virtual: VirtualRequest, plain: Plan, *, forced_layout: bool,
                 compare: bool = False) -> Plan:
    """The plan with virtual stages, or ``plain`` (the best plan without them, searched under the same request).

    ``virtual.virtual_stages`` None ("auto"): the fastest of ``plain`` and every priced virtual plan that fits;
    a number: the fastest virtual plan with that many chunks per group (InfeasiblePlanError when none fits).
    Virtual plans sum gradients once per group after its list, each group at its own ZeRO level under
    ``sharding="auto"`` (or the forced one) with per-block recompute where it does not fit
    (:mod:`fxpipe.passes.partition.virtual_choices`; what :func:`fxpipe.sim.virtual_simulate.simulate_virtual` models). ``compare``:
    a chosen virtual plan lists the plain plan in ``baselines`` as :data:`PLAIN_BASELINE`.
    """
    best = best_virtual(request, virtual, plain, forced_layout)
    assert plain.predicted is not None
    plain_s = plain.predicted.iteration_time_s
    if best is None:
        if virtual.virtual_stages is not None:
            raise InfeasiblePlanError(
                f"no plan with virtual_stages={virtual.virtual_stages} under {list(virtual.schedules)} fits in "
                f"{request.memory_limit_bytes / 2**30:.2f} GiB per device on cluster {request.cluster.name!r} (each "
                "group holds every chunk's weights and more micro-batches in flight than one stage does); use "
                "virtual_stages=1 or 'auto', more device groups, or more micro-batches")
        return _noted(plain, "virtual_stages='auto': no plan with virtual stages fits in memory (or has M >= G and "
                             "a block per chunk); kept one stage per device group")
    if virtual.virtual_stages is None and best.time_s >= plain_s:
        return _noted(plain, f"virtual_stages='auto': the best plan with virtual stages ({_describe(best.plan)}, "
                             f"{best.time_s * 1e3:.3f} ms) is not predicted faster than one stage per group "
                             f"({plain_s * 1e3:.3f} ms); kept one stage per device group")
    assert best.plan.predicted is not None
    chosen = best.plan.with_updates(predicted=replace(
        best.plan.predicted, dp_iteration_time_s=plain.predicted.dp_iteration_time_s))
    baseline = BaselineResult(layout=plain.layout, iteration_time_s=plain_s, num_microbatches=plain.num_microbatches,
                              note=f"the best plan without virtual stages ({plain.schedule})")
    return chosen.with_updates(notes=(*plain.notes, f"virtual stages: {_describe(chosen)}, predicted "
                                      f"{best.time_s * 1e3:.3f} ms against {plain_s * 1e3:.3f} ms for the best plan "
                                      f"without ({plain.layout}, M={plain.num_microbatches}, {plain.schedule}); "
                                      f"{_sharding_note(chosen)} and sum gradients once per group after its list"),
                               baselines=((PLAIN_BASELINE, baseline),) if compare else ())


def _sharding_note(plan: Plan) -> str:
    levels = [plan.stages[plan.chunks_of_group(g)[0]].sharding for g in range(plan.num_groups)]
    sharded = [f"group {g}'s chunks sharded at {level!r}" for g, level in enumerate(levels) if level != "none"]
    return ", ".join(sharded) if sharded else "chunks are unsharded"


def _describe(plan: Plan) -> str:
    return (f"{plan.layout} x v={plan.virtual_stages} ({plan.chunk_layout}), {plan.schedule}, "
            f"M={plan.num_microbatches}")


def _noted(plan: Plan, note: str) -> Plan:
    return plan.with_updates(notes=(*plan.notes, note))
