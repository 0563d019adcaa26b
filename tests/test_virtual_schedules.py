"""Virtual-stage schedules and plans as data: literal tables, lowering with local hand-offs, validation that catches
broken schedules, per-chunk in-flight peaks, torch's orders, plan JSON (new keys round trip; old files unchanged)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_schedule import normalized, table

from fxpipe.core.plan import Plan, PlanError, StagePlan
from fxpipe.core.schedule import (
    Action,
    Op,
    Schedule,
    ScheduleError,
    inflight_peak,
    lower,
    make_schedule,
    validate_schedule,
)
from fxpipe.core.virtual import chunk_groups_for, loop_chunk_groups, v_chunk_groups

VIRTUAL = ("interleaved", "interleaved_zero_bubble", "zbv")


def test_interleaved_1f1b_g2_v2_m4_table() -> None:
    """Chunks 0 and 2 on group 0, 1 and 3 on group 1; micro-batches in groups of G = 2 per chunk (Megatron)."""
    assert normalized(make_schedule("interleaved", 4, 4, virtual_stages=2)) == table("""
        interleaved    0    1    2    3    4    5    6    7    8    9    10    11    12    13    14    15
        group 0        0F0  0F1  2F0  2F1  0F2  2B0  0F3  2B1  2F2  0B0  2F3   0B1   2B2   2B3   0B2   0B3
        group 1        1F0  1F1  3F0  3B0  3F1  3B1  1F2  1B0  1F3  1B1  3F2   3B2   3F3   3B3   1B2   1B3
    """)


def test_interleaved_with_m_not_a_multiple_of_g_puts_the_remainder_in_the_last_group() -> None:
    """G = 2, M = 3: one micro-batch group of 3; the warm-up grows to reach the last chunk's first backward."""
    assert normalized(make_schedule("interleaved", 4, 3, virtual_stages=2)) == table("""
        interleaved    0    1    2    3    4    5    6    7    8    9    10    11
        group 0        0F0  0F1  0F2  2F0  2F1  2F2  2B0  2B1  2B2  0B0  0B1   0B2
        group 1        1F0  1F1  1F2  3F0  3B0  3F1  3B1  3F2  3B2  1B0  1B1   1B2
    """)


def test_interleaved_zero_bubble_g2_v2_m4_table() -> None:
    """B computes input gradients, W parameter gradients; group g defers its W's by g backwards."""
    assert normalized(make_schedule("interleaved_zero_bubble", 4, 4, virtual_stages=2)) == table("""
        interleaved_zero_bubble    0    1    2    3    4    5    6    7    8    9    10    11    12    13    14    15    16    17    18    19    20    21    22    23
        group 0                    0F0  0F1  2F0  2F1  2B0  2W0  0F2  2B1  2W1  0F3  0B0   0W0   2F2   0B1   0W1   2F3   2B2   2W2   2B3   2W3   0B2   0W2   0B3   0W3
        group 1                    1F0  1F1  3F0  3B0  3F1  3B1  3W0  1F2  1B0  3W1  1F3   1B1   1W0   3F2   3B2   1W1   3F3   3B3   3W2   1B2   3W3   1B3   1W2   1W3
    """)  # noqa: E501


def test_zbv_g2_m4_table() -> None:
    """The V: group 0 holds chunks 0 and 3, group 1 chunks 1 and 2 (handed over locally)."""
    assert normalized(make_schedule("zbv", 4, 4, virtual_stages=2)) == table("""
        zbv      0    1    2    3    4    5    6    7    8    9    10    11    12    13    14    15    16    17    18    19    20    21    22    23
        group 0  0F0  0F1  0F2  3F0  3B0  3W0  3F1  3B1  3W1  0F3  0B0   0W0   3F2   3B2   3W2   0B1   0W1   3F3   3B3   3W3   0B2   0W2   0B3   0W3
        group 1  1F0  2F0  1F1  2F1  2B0  2W0  1F2  1B0  1W0  2F2  2B1   2W1   1F3   1B1   1W1   2F3   2B2   2W2   1B2   2B3   1B3   1W2   2W3   1W3
    """)  # noqa: E501


def test_lowering_sends_between_groups_and_hands_over_locally_on_one_group() -> None:
    lowered = [[str(a) for a in row] for row in lower(make_schedule("zbv", 4, 1, virtual_stages=2))]
    assert lowered == [
        ["0F0", "0SA0", "3RA0", "3F0", "3B0", "3SG0", "3W0", "0RG0", "0B0", "0W0", "AR"],
        ["1RA0", "1F0", "2F0", "2SA0", "2RG0", "2B0", "2W0", "1B0", "1SG0", "1W0", "AR"],  # 1 -> 2: no message
    ]
    # a loop: the last chunk of group 1 hands to the next chunk of group 0 over the link
    assert [str(a) for a in lower(make_schedule("interleaved", 4, 2, virtual_stages=2))[1]][:5] == [
        "1RA0", "1F0", "1SA0", "1RA1", "1F1"]


def test_every_virtual_schedule_validates_over_many_sizes() -> None:
    for name in VIRTUAL:
        for num_groups in range(1, 6):
            for v in (2,) if name == "zbv" else (2, 3, 4):
                for m in range(1 if name == "zbv" else num_groups, 14):
                    schedule = make_schedule(name, num_groups * v, m, virtual_stages=v)
                    validate_schedule(schedule)
                    assert schedule.num_chunks == num_groups * v and schedule.virtual


def _swap(schedule: Schedule, group: int, i: int, j: int) -> Schedule:
    rows = [list(row) for row in schedule.per_stage]
    rows[group][i], rows[group][j] = rows[group][j], rows[group][i]
    return replace(schedule, per_stage=tuple(tuple(row) for row in rows))


def test_validation_catches_a_broken_local_hand_off() -> None:
    """Group 1 of a V runs chunk 2's forward before chunk 1's: it waits for itself."""
    schedule = _swap(make_schedule("zbv", 4, 2, virtual_stages=2), 1, 0, 1)
    assert [str(a) for a in schedule.per_stage[1][:2]] == ["2F0", "1F0"]
    with pytest.raises(ScheduleError, match=r"deadlock: .*group 1 waits at step 0 \(2F0\) for 1F0 on group 1"):
        validate_schedule(schedule)


def test_validation_catches_a_deadlock_across_groups_and_chunks() -> None:
    """Group 1 starts with 3F0, which waits for 2F0 on group 0, which waits for 1F0 that group 1 now runs later."""
    schedule = make_schedule("interleaved", 4, 2, virtual_stages=2)
    broken = _swap(schedule, 1, 0, 2)
    with pytest.raises(ScheduleError, match=r"group 1 waits at step 0 \(3F0\) for 2F0 on group 0"):
        validate_schedule(broken)


@pytest.mark.parametrize("mutate, message", [
    (lambda rows: rows[0].__setitem__(0, Action(Op.FORWARD, 0, 1)), "chunk 1 runs on another group"),
    (lambda rows: rows[0].remove(Action(Op.WEIGHT, 1, 0)), r"group 0 chunk 0: W of micro-batches \[1\] never runs"),
    (lambda rows: rows[1].__setitem__(rows[1].index(Action(Op.BACKWARD, 0, 1)), Action(Op.BACKWARD, 0, 2)),
     "repeats 2B0"),
])
def test_validation_catches_broken_shapes(mutate, message) -> None:  # type: ignore[no-untyped-def]
    schedule = make_schedule("zbv", 4, 2, virtual_stages=2)
    rows = [list(row) for row in schedule.per_stage]
    mutate(rows)
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(replace(schedule, per_stage=tuple(tuple(row) for row in rows)))


def test_inflight_peaks_are_per_chunk() -> None:
    """Interleaved 1F1B keeps the most on the earliest chunks (group 0's warm-up of 2(G-1) + (v-1)G forwards);
    ZB-V releases at W; a plan stage is a chunk, counted in its group's list."""
    interleaved = make_schedule("interleaved", 8, 8, virtual_stages=2)
    assert [inflight_peak(interleaved, c) for c in range(8)] == [8, 8, 7, 5, 4, 4, 3, 1]
    zbv = make_schedule("zbv", 8, 8, virtual_stages=2)
    assert [inflight_peak(zbv, c) for c in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    with pytest.raises(ScheduleError, match="stage 8 is not in schedule"):
        inflight_peak(zbv, 8)


def test_orders_match_torch_pipelining_where_both_apply() -> None:
    """torch.distributed.pipelining builds the same compute order per rank (M a multiple of G for the loops)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    kinds = {"interleaved": "ScheduleInterleaved1F1B", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
             "zbv": "ScheduleZBVZeroBubble"}
    try:
        codes = {schedules._ComputationType.FORWARD: "F", schedules._ComputationType.FULL_BACKWARD: "B",
                 schedules._ComputationType.BACKWARD_INPUT: "B", schedules._ComputationType.BACKWARD_WEIGHT: "W"}
        for name, class_name in kinds.items():
            for groups, v, m in [(2, 2, 4), (3, 3, 6), (4, 2, 8), (4, 2, 3), (3, 2, 9), (1, 2, 2)]:
                if name != "zbv" and m % groups or name == "zbv" and v != 2:
                    continue
                built = object.__new__(getattr(schedules, class_name))  # only the order: no stages, no group
                built.pp_group_size, built.n_local_stages, built._n_microbatches = groups, v, m
                built.num_stages, built.number_of_rounds = groups * v, max(1, m // groups)
                built.microbatches_per_round = m // built.number_of_rounds
                theirs = [[f"{a.stage_index}{codes[a.computation_type]}{a.microbatch_index}"
                           for a in built._calculate_single_rank_operations(rank) if a is not None]
                          for rank in range(groups)]
                ours = make_schedule(name, groups * v, m, virtual_stages=v).per_stage
                assert theirs == [[str(a) for a in row] for row in ours], (name, groups, v, m)
    except (AttributeError, KeyError, TypeError) as error:  # torch's private schedule internals moved
        pytest.skip(f"torch's schedule internals changed: {error!r}")


def virtual_plan(schedule: str = "interleaved", layout: str = "loop", **changes: object) -> Plan:
    groups = chunk_groups_for(layout, 4, 2)
    stages = tuple(StagePlan(c, c, c + 1, 1 + (g == 0), ((g, 9) if g == 0 else (g,)))
                   for c, g in enumerate(groups))
    return Plan(16, 4, stages, schedule=schedule, virtual_stages=2, chunk_groups=groups).with_updates(**changes)


def test_plan_with_virtual_stages_round_trips_and_names_its_groups() -> None:
    plan = virtual_plan()
    data = json.loads(plan.to_json())
    assert (data["virtual_stages"], data["chunk_groups"], data["layout"]) == (2, [0, 1, 2, 3, 0, 1, 2, 3], "2:1:1:1")
    assert Plan.from_json(plan.to_json()) == plan
    assert (plan.num_groups, plan.world_size, plan.all_devices()) == (4, 5, [0, 1, 2, 3, 9])
    assert (plan.group_of_chunk(5), plan.chunks_of_group(1), plan.chunk_layout) == (1, (1, 5), "loop")
    vplan = virtual_plan("zbv", "v")
    assert (vplan.chunks_of_group(0), vplan.chunks_of_group(3), vplan.chunk_layout) == ((0, 7), (3, 4), "v")
    assert loop_chunk_groups(2, 3) == (0, 1, 0, 1, 0, 1) and v_chunk_groups(3) == (0, 1, 2, 2, 1, 0)


def test_plans_without_virtual_stages_keep_their_bytes() -> None:
    stages = (StagePlan(0, 0, 1, 2, (0, 1)), StagePlan(1, 1, 2, 1, (2,)))
    plan = Plan(8, 4, stages)
    text = plan.to_json()
    assert "virtual_stages" not in text and "chunk_groups" not in text
    old = json.loads(text)  # a file written before virtual stages existed has neither key
    assert Plan.from_json(json.dumps(old, indent=2, sort_keys=True) + "\n").to_json() == text
    assert (plan.num_groups, plan.chunks_of_group(1), plan.group_of_chunk(1), plan.chunk_layout) == (2, (1,), 1, None)


@pytest.mark.parametrize("changes, message", [
    ({"virtual_stages": 1, "chunk_groups": ()}, "runs several model chunks per device group but the plan has "
                                                "virtual_stages=1"),
    ({"schedule": "early_backward"}, r"runs one stage per device group .* choose one of \['interleaved', "),
    ({"schedule": "zbv"}, r"zbv' runs chunks laid out as a v \[0, 1, 2, 3, 3, 2, 1, 0\], not chunk_groups"),
    ({"chunk_groups": (0, 1, 2, 3, 0, 1, 3, 2)}, "is not a layout of 8 chunks on 4 groups; use the loop"),
    ({"virtual_stages": 3}, "virtual_stages=3 does not divide the 8 stages"),
    ({"virtual_stages": 0}, "virtual_stages must be a positive integer"),
    ({"num_microbatches": 2}, "M=2 is fewer: use at least 4 micro-batches"),
])
def test_plan_validation_names_the_value_and_the_fix(changes: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        virtual_plan(**changes)


def test_devices_repeat_only_across_one_groups_chunks() -> None:
    plan = virtual_plan()
    moved = list(plan.stages)
    moved[5] = replace(moved[5], devices=(7,))  # chunk 5 of group 1 somewhere else
    with pytest.raises(PlanError, match=r"chunk 5 runs on group 1 with devices=\[7\].*chunk 1 of that group has "
                                        r"devices=\[1\]"):
        plan.with_updates(stages=tuple(moved))
    shared = list(plan.stages)
    shared[2] = replace(shared[2], devices=(1,))  # group 2 on group 1's device
    shared[6] = replace(shared[6], devices=(1,))
    with pytest.raises(PlanError, match=r"devices \[1\] are assigned to more than one device group"):
        plan.with_updates(stages=tuple(shared))
    fewer = list(plan.stages)
    fewer[4] = replace(fewer[4], replicas=1, devices=(0,))  # one replica of group 0 on a chunk: not the group
    with pytest.raises(PlanError, match="chunk 4 runs on group 0"):
        plan.with_updates(stages=tuple(fewer))


def test_compile_takes_a_virtual_plan_and_refuses_a_virtual_schedule_without_one() -> None:
    from fxpipe.compile_options import CompileOptions
    from fxpipe.compile_plan import apply_overrides

    options = CompileOptions(loss_fn=None, global_batch_size=None)
    assert apply_overrides(virtual_plan(), options) == virtual_plan()  # the runtime runs it (test_virtual_runtime.py)
    with pytest.raises(PlanError, match="runs several model chunks per device group"):  # forcing the schedule
        apply_overrides(Plan(8, 4, (StagePlan(0, 0, 1, 1, (0,)),)), CompileOptions(loss_fn=None,
                                                                                   global_batch_size=None,
                                                                                   schedule="zbv"))
