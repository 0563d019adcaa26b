"""Schedules as data: exact tables of the generators, validation, in-flight peaks, lowering."""

from __future__ import annotations

import pytest

from fxpipe.core.schedule import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    early_backward,
    format_schedule,
    gpipe,
    inflight_peak,
    lower,
    make_schedule,
    validate_schedule,
    warmup_forwards,
)


def table(text: str) -> str:
    """A literal table as written in a test: strip the surrounding blank lines and indentation."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return "\n".join(lines)


def normalized(schedule: Schedule) -> str:
    return "\n".join(line.rstrip() for line in format_schedule(schedule).splitlines())


def parse(name: str, rows: str, num_microbatches: int) -> Schedule:
    """Build a schedule from rows of action names, e.g. "F0 B0 F1 B1" per stage."""
    per_stage = tuple(
        tuple(Action(Op(cell[:1]), int(cell[1:])) for cell in line.split())
        for line in rows.strip().splitlines()
    )
    return Schedule(name, len(per_stage), num_microbatches, per_stage)


def test_gpipe_two_stages_three_microbatches() -> None:
    assert normalized(gpipe(2, 3)) == table("""
        gpipe    0    1    2    3    4    5
        stage 0  F0   F1   F2   B2   B1   B0
        stage 1  F0   F1   F2   B2   B1   B0
    """)


def test_early_backward_policy_a() -> None:
    assert normalized(early_backward(3, 4, "A")) == table("""
        early_backward_A    0    1    2    3    4    5    6    7
        stage 0             F0   F1   F2   B0   F3   B1   B2   B3
        stage 1             F0   F1   B0   F2   B1   F3   B2   B3
        stage 2             F0   B0   F1   B1   F2   B2   F3   B3
    """)


def test_early_backward_policy_b() -> None:
    assert normalized(early_backward(3, 6, "B")) == table("""
        early_backward_B    0    1    2    3    4    5    6    7    8    9    10    11
        stage 0             F0   F1   F2   F3   F4   B0   F5   B1   B2   B3   B4    B5
        stage 1             F0   F1   F2   B0   F3   B1   F4   B2   F5   B3   B4    B5
        stage 2             F0   B0   F1   B1   F2   B2   F3   B3   F4   B4   F5    B5
    """)


def test_early_backward_fewer_microbatches_than_stages() -> None:
    assert normalized(early_backward(4, 2, "A")) == table("""
        early_backward_A    0    1    2    3
        stage 0             F0   F1   B0   B1
        stage 1             F0   F1   B0   B1
        stage 2             F0   F1   B0   B1
        stage 3             F0   B0   F1   B1
    """)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("num_microbatches", [1, 2, 3, 7, 16])
@pytest.mark.parametrize("name,policy", [("gpipe", "A"), ("early_backward", "A"), ("early_backward", "B")])
def test_generated_schedules_validate(num_stages: int, num_microbatches: int, name: str, policy: str) -> None:
    schedule = make_schedule(name, num_stages, num_microbatches, policy)
    validate_schedule(schedule)
    for stage_index in range(num_stages):
        expected = (num_microbatches if name == "gpipe"
                    else warmup_forwards(stage_index, num_stages, num_microbatches, policy))
        assert inflight_peak(schedule, stage_index) == expected


def test_validator_rejects_missing_backward() -> None:
    schedule = parse("missing", """
        F0 F1 B1 B0
        F0 F1 B1
    """, 2)
    with pytest.raises(ScheduleError, match=r"stage 1: B of micro-batches \[0\] never runs") as error:
        validate_schedule(schedule)
    assert format_schedule(schedule) in str(error.value)


def test_validator_rejects_backward_before_forward() -> None:
    schedule = parse("early", """
        F0 B1 F1 B0
        F0 F1 B1 B0
    """, 2)
    with pytest.raises(ScheduleError, match="stage 0: step 1 runs B1 before F1") as error:
        validate_schedule(schedule)
    assert format_schedule(schedule) in str(error.value)


def test_validator_rejects_repeats_and_out_of_range() -> None:
    with pytest.raises(ScheduleError, match="repeats F0"):
        validate_schedule(parse("repeat", "F0 F0 B0", 1))
    with pytest.raises(ScheduleError, match="micro-batch 3 is outside 0..1"):
        validate_schedule(parse("range", "F0 F1 F3 B0 B1", 2))
    with pytest.raises(ScheduleError, match="per_stage has 1 lists"):
        validate_schedule(Schedule("short", 2, 1, parse("x", "F0 B0", 1).per_stage))


def test_validator_reports_deadlock_with_stuck_actions() -> None:
    schedule = parse("crossed", """
        F0 B0 F1 B1
        F1 B1 F0 B0
    """, 2)
    with pytest.raises(ScheduleError) as error:
        validate_schedule(schedule)
    message = str(error.value)
    assert "deadlock: stage 0 waits at step 1 (B0) for B0 on stage 1" in message
    assert "stage 1 waits at step 0 (F1) for F1 on stage 0" in message
    assert format_schedule(schedule) in message


def test_validator_accepts_a_reordered_but_live_schedule() -> None:
    validate_schedule(parse("live", """
        F0 F1 B1 B0
        F1 F0 B1 B0
    """, 2))


def test_deadlock_three_stages_middle_waits_on_last() -> None:
    # the last stage wants F1 before F0 and stage 1 backward-first: a cycle through stages 1 and 2
    schedule = parse("cycle", """
        F0 F1 B0 B1
        F0 B0 F1 B1
        F1 B1 F0 B0
    """, 2)
    with pytest.raises(ScheduleError, match="deadlock: stage 0 waits at step 2 .B0. for B0 on stage 1"):
        validate_schedule(schedule)


def test_inflight_peak_rejects_unknown_stage() -> None:
    with pytest.raises(ScheduleError, match="stage 2 is not in schedule"):
        inflight_peak(gpipe(2, 2), 2)


def test_lower_adds_transfers_and_allreduce() -> None:
    lowered = lower(gpipe(2, 1))
    assert [str(a) for a in lowered[0]] == ["F0", "SA0", "RG0", "B0", "AR"]
    assert [str(a) for a in lowered[1]] == ["RA0", "F0", "B0", "SG0", "AR"]


def test_one_schedule_registry_feeds_plans_the_cli_and_compile() -> None:
    from fxpipe.cli import _build_parser
    from fxpipe.compile_plan import _schedule_name
    from fxpipe.core.schedule import SCHEDULES, TRAINING_SCHEDULES, schedule_name

    choices = next(action.choices for sub in _build_parser()._subparsers._group_actions  # type: ignore[union-attr]
                   for action in sub.choices["plan"]._actions if action.dest == "schedule")
    assert sorted(choices) == sorted([*TRAINING_SCHEDULES, "auto"])  # "auto": the planner picks per plan
    assert set(SCHEDULES) - set(TRAINING_SCHEDULES) == {"forward_only"}  # evaluate/predict run it
    for name, kind in TRAINING_SCHEDULES.items():
        if kind.build_virtual is not None:  # virtual stages: 3 groups of 2 chunks (tests/test_virtual_schedules.py)
            validate_schedule(make_schedule(name, 6, 4, "B", virtual_stages=2))
            with pytest.raises(ScheduleError, match="virtual_stages >= 2"):
                make_schedule(name, 3, 4, "B")
            continue
        built = make_schedule(name, 3, 4, "B")
        validate_schedule(built)
        assert all(schedule_name(alias) == name == _schedule_name(alias) for alias in (name, *kind.aliases))
        # all_in_flight says every stage runs all forwards before its first backward
        firsts = [[action.op for action in stage].index(Op.BACKWARD) for stage in built.per_stage]
        assert kind.all_in_flight == all(first == 4 for first in firsts)


def test_forward_only_is_forwards_in_order_without_allreduce() -> None:
    schedule = make_schedule("forward_only", 3, 2)
    validate_schedule(schedule)
    assert schedule.forward_only and not schedule.split_backward
    assert [[str(a) for a in stage] for stage in lower(schedule)] == [
        ["F0", "SA0", "F1", "SA1"],
        ["RA0", "F0", "SA0", "RA1", "F1", "SA1"],
        ["RA0", "F0", "RA1", "F1"],
    ]
    assert [inflight_peak(schedule, s) for s in range(3)] == [1, 1, 1]  # nothing kept for a backward


def test_forward_only_cannot_train_a_plan_and_a_training_schedule_without_backwards_fails() -> None:
    from dataclasses import replace

    from fxpipe.core.plan import Plan, PlanError, StagePlan

    with pytest.raises(ScheduleError, match="B of micro-batches"):
        validate_schedule(replace(make_schedule("forward_only", 2, 2), name="gpipe"))
    stages = (StagePlan(0, 0, 1, 1, (0,)), StagePlan(1, 1, 2, 1, (1,)))
    Plan(4, 2, stages)  # a training schedule: fine
    with pytest.raises(PlanError, match="forward_only.* is unknown"):
        Plan(4, 2, stages, schedule="forward_only")
