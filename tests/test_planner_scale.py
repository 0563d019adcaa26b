"""The planner's speed shortcuts at scale change no plan: the simulator's cached, unvalidated programs equal the
validated, lowered schedules, and the fill-and-drain lower bound never exceeds a simulated time, so plans made
with it and without it are identical (benchmarks/microbatch_search_speed.md measures the time it saves)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from planner_cases import random_case

from fxpipe.core.schedule import TRAINING_SCHEDULES, lower, make_schedule, validate_schedule
from fxpipe.core.schedule import inflight_peak as schedule_inflight_peak
from fxpipe.passes.partition import pipeline_bound
from fxpipe.passes.partition import scoring as plan_scoring
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import PlanningError
from fxpipe.sim.events import encode_program
from fxpipe.sim.programs import built_programs

PLAIN = [name for name, kind in TRAINING_SCHEDULES.items() if kind.build_virtual is None]


@pytest.mark.parametrize("name", [*PLAIN, "forward_only"])
def test_cached_programs_equal_the_validated_lowered_schedule(name: str) -> None:
    for stages, microbatches, policy in itertools.product((1, 2, 3, 5, 8), (1, 2, 3, 7, 16), ("A", "B")):
        schedule = make_schedule(name, stages, microbatches, policy)
        validate_schedule(schedule)  # what the simulator no longer checks at run time for registry schedules
        ready = built_programs(name, stages, microbatches, policy)
        assert ready.programs == tuple(encode_program(actions) for actions in lower(schedule))
        assert ready.inflight == tuple(schedule_inflight_peak(schedule, s) for s in range(stages))
        assert (ready.name, ready.split_backward) == (schedule.name, schedule.split_backward)


def _cases() -> list[tuple[object, ...]]:
    """Random chains and clusters, some with per-message, per-action and split-backward costs (terms of the bound),
    under early backward and under schedule="auto" (zero-bubble and GPipe tried too), with and without sharding."""
    found: list[tuple[object, ...]] = []
    for seed in range(16):
        chain, cluster, batch = random_case(seed)
        if seed % 2:
            cluster = replace(cluster, message_overhead_s=2e-5, action_overhead_s=5e-5, split_backward_overhead=0.3)
        schedule = "auto" if seed % 3 == 0 else "early_backward"
        found.append((chain, cluster, batch, schedule, "auto" if seed % 4 == 1 else "none"))
    return found


def _plans(cases: list[tuple[object, ...]]) -> list[object]:
    plans: list[object] = []
    for chain, cluster, batch, schedule, sharding in cases:
        try:
            plan = partition(chain, cluster, batch, schedule=schedule, sharding=sharding)  # type: ignore[arg-type]
        except PlanningError as error:
            plans.append(type(error).__name__)
            continue
        plans.append(plan.with_updates(planning_time_s=0.0).to_json_dict())
    return plans


def test_the_pipeline_bound_never_exceeds_a_simulated_time_and_changes_no_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cases = _cases()
    checked: list[float] = []
    real = plan_scoring._score_candidate

    def checking(request, model, candidate, planner):  # type: ignore[no-untyped-def]
        scored = real(request, model, candidate, planner)
        if scored is not None:
            bound = plan_scoring.simulated_lower_bound(model, candidate)
            assert bound <= scored.time_s * (1 + 1e-12), (candidate, bound, scored.time_s)
            checked.append(bound / scored.time_s)
        return scored

    monkeypatch.setattr(plan_scoring, "_score_candidate", checking)
    with_bound = _plans(cases)
    assert len(checked) > 100 and max(checked) > 0.9  # the bound was tested, and is tight somewhere
    monkeypatch.setattr(pipeline_bound, "ENABLED", False)
    assert _plans(cases) == with_bound


@pytest.mark.parametrize(("requested", "overhead"), [("early_backward", 0.0), ("auto", 0.0), ("auto", 0.3)])
def test_the_pipeline_bound_is_exact_for_equal_stages_and_below_every_schedule(requested: str, overhead: float) -> None:
    """Equal one-device stages with free transfers: early backward takes exactly (M + S - 1)(F + B) before the
    step's close, which the bound must reach when only early backward is asked for; under "auto" zero-bubble's
    shorter drain (B without W upstream) must stay above it, and so must GPipe."""
    from planner_cases import chain as uniform_chain
    from planner_cases import cluster as make_cluster

    from fxpipe.passes.partition.plan_build import build_plan
    from fxpipe.passes.partition.request import PlanRequest
    from fxpipe.passes.partition.spans import Span
    from fxpipe.sim.stagecost import step_close_time

    chain = uniform_chain([1.0] * 4, [10**6] * 4, cut_bytes_per_row=0.0)
    cluster = replace(make_cluster(1, 4, memory_gib=1000), split_backward_overhead=overhead)
    request = PlanRequest(chain, cluster, 8, schedule=requested, memory_limit_bytes=cluster.device.memory_bytes)
    model = request.candidate_costs()
    candidate = model.candidate(tuple(Span(s, s + 1, (s,)) for s in range(4)), 1)
    bound = plan_scoring.simulated_lower_bound(model, candidate)
    times = {schedule: plan_scoring.simulate_plan(build_plan(model, candidate, schedule=schedule, warmup_policy="A",
                                                             planner="dapple"), request)[0]
             for schedule in ("early_backward", "zero_bubble", "gpipe")}
    close = step_close_time(cluster, tuple(range(4)))
    if requested == "early_backward":
        assert bound == pytest.approx(times["early_backward"] - close, rel=1e-9)
        return
    assert all(bound <= time_s * (1 + 1e-12) for time_s in times.values()), (bound, times)
    if overhead == 0.0:
        assert times["zero_bubble"] < times["early_backward"]  # the case the split-backward share exists for
