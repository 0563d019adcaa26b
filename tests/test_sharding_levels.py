"""Sharding levels and requests (fxpipe.core.sharding) and the plan field that records them: exact data tests."""

from __future__ import annotations

import json

import pytest

from fxpipe.core.plan import Plan, PlanError, StagePlan
from fxpipe.core.sharding import ShardingError, check_request, force_sharding, parse_request, stage_levels


def _plan(*shardings: str) -> Plan:
    stages = tuple(StagePlan(i, i, i + 1, 2, (2 * i, 2 * i + 1), sharding=s) for i, s in enumerate(shardings))
    return Plan(global_batch_size=8, num_microbatches=2, stages=stages)


def test_requests_parse_to_auto_one_level_or_one_level_per_stage() -> None:
    assert parse_request("auto") == "auto"
    assert parse_request("optimizer") == "optimizer"
    assert parse_request("none, parameters") == ("none", "parameters")
    assert check_request(["gradients", "none"]) == ("gradients", "none")
    with pytest.raises(ShardingError, match="'zero2' is unknown.*'gradients'"):
        parse_request("zero2")
    with pytest.raises(ShardingError, match=r"sharding\[1\] 'all' is unknown"):
        check_request(["none", "all"])
    with pytest.raises(ShardingError, match="empty sequence"):
        check_request([])


def test_stage_levels_spread_one_level_and_drop_it_on_single_replica_stages() -> None:
    assert stage_levels("optimizer", [2, 1, 4]) == ("optimizer", "none", "optimizer")
    assert stage_levels(["parameters", "gradients"], [3, 2]) == ("parameters", "gradients")
    with pytest.raises(ShardingError, match="gives 1 levels.*plan of 2 stages"):
        stage_levels(["optimizer"], [2, 2])
    with pytest.raises(ShardingError, match="decided by the planner"):
        stage_levels("auto", [2])


def test_plan_files_record_each_stage_level_and_old_files_load_unsharded() -> None:
    plan = _plan("parameters", "none")
    data = json.loads(plan.to_json())
    assert [stage["sharding"] for stage in data["stages"]] == ["parameters", "none"]
    assert Plan.from_json(plan.to_json()) == plan
    for stage in data["stages"]:
        del stage["sharding"]  # written before the field existed
    assert [stage.sharding for stage in Plan.from_json(json.dumps(data)).stages] == ["none", "none"]


def test_plans_refuse_unknown_levels_and_sharding_a_single_replica() -> None:
    with pytest.raises(PlanError, match="stage 1 has sharding 'zero'"):
        _plan("none", "zero")
    with pytest.raises(PlanError, match="on 1 replica.*use 'none'"):
        Plan(global_batch_size=4, num_microbatches=2, stages=(StagePlan(0, 0, 1, 1, (0,), sharding="optimizer"),))


def test_force_sharding_sets_explicit_levels_and_auto_keeps_the_plans() -> None:
    plan = _plan("gradients", "none")
    assert force_sharding(plan, "auto") is plan
    assert [s.sharding for s in force_sharding(plan, "parameters").stages] == ["parameters", "parameters"]
    assert [s.sharding for s in force_sharding(plan, ("none", "optimizer")).stages] == ["none", "optimizer"]
