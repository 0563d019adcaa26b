"""partition(all_devices=True): what fxpipe.compile asks the planner, every launched rank gets a role."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from fxpipe import models as zoo
from fxpipe.core.cluster import LinkSpec, parse_cluster
from fxpipe.passes.partition.dapple import InfeasiblePlanError, LayoutError, partition
from fxpipe.passes.partition.every_device import fewer_devices_note
from fxpipe.planning import costed_model
from tests.planner_cases import random_case
from tests.reference_planner import best_plan
from tests.reference_sim import reference_run


def _mlp_chain(cluster: str) -> tuple:
    entry = zoo.get("mlp")
    model, example_inputs = zoo.build("mlp", **entry.tiny_overrides)
    resolved = parse_cluster(cluster, calibrate=False)
    return costed_model(model, example_inputs, resolved).chain, resolved


def test_every_device_gets_a_role_and_the_note_compares_with_fewer() -> None:
    chain, cluster = _mlp_chain("local:2")
    fewer = partition(chain, cluster, 8)
    every = partition(chain, cluster, 8, all_devices=True)
    assert every.all_devices() == [0, 1]
    assert fewer.world_size < 2, "the tiny mlp runs fastest on one rank with the default CPU figures"
    assert fewer.predicted is not None and every.predicted is not None
    assert fewer.predicted.iteration_time_s < every.predicted.iteration_time_s
    (note,) = every.notes
    assert note == fewer_devices_note(every, fewer)
    percent = float(re.search(r"predicted ([0-9.]+)% faster", note).group(1))  # type: ignore[union-attr]
    expected = 100 * (1 - fewer.predicted.iteration_time_s / every.predicted.iteration_time_s)
    assert percent == pytest.approx(expected, abs=0.05)
    assert f"a plan on {fewer.world_size} of the 2 devices (layout {fewer.layout}" in note
    assert fewer_devices_note(fewer, every) is None  # more devices are never "fewer"
    again = partition(chain, cluster, 8, all_devices=True)
    assert again.with_updates(planning_time_s=0.0).to_json() == every.with_updates(planning_time_s=0.0).to_json()


def test_unconstrained_plan_on_every_device_is_kept_as_is() -> None:
    entry = zoo.get("gpt-mini")
    model, example_inputs = zoo.build("gpt-mini", **entry.tiny_overrides)
    cluster = parse_cluster("1x2:v100")
    chain = costed_model(model, example_inputs, cluster).chain
    free = partition(chain, cluster, 64)
    assert free.world_size == 2
    every = partition(chain, cluster, 64, all_devices=True)
    assert every.with_updates(planning_time_s=0.0) == free.with_updates(planning_time_s=0.0)
    assert every.notes == ()


def test_impossible_every_device_requests_say_why() -> None:
    chain, cluster = _mlp_chain("local:2")
    # one row on two devices: the MLP's linear pairs split over a 2-way tensor-parallel group
    assert partition(chain, cluster, 1, all_devices=True).layout == "1x2"
    chain = replace(chain, blocks=tuple(replace(block, tp=None) for block in chain.blocks))
    with pytest.raises(InfeasiblePlanError, match="gives all 2 devices .* the best plan uses 1 .*launch 1 rank,"):
        partition(chain, cluster, 1, all_devices=True)  # without splits: neither two replicas nor two stages
    with pytest.raises(LayoutError, match="layout '1' uses 1 of the 2 devices"):
        partition(chain, cluster, 8, layout="1", all_devices=True)
    assert partition(chain, cluster, 8, layout="1").all_devices() == [0]  # allowed without the constraint


def test_oracle_every_device_within_three_percent_of_brute_force() -> None:
    """DAPPLE with every device used vs the test-owned brute force under the same constraint (tests/reference_planner.py:
    its own enumeration and scoring by the reference simulator), small random cases."""
    gaps, constrained = [], 0
    slow = LinkSpec(2e8, 1e-3)  # slow links make plans on fewer devices win in some cases
    for seed in range(200, 212):
        chain_, fast, batch = random_case(seed, max_blocks=5, max_devices=4)
        cluster_ = replace(fast, intra_host=slow, inter_host=slow, inter_host_collective=None)
        best = best_plan(chain_, cluster_, batch, all_devices=True)
        if best is None:
            with pytest.raises(InfeasiblePlanError):
                partition(chain_, cluster_, batch, all_devices=True)
            continue
        plan = partition(chain_, cluster_, batch, all_devices=True)
        assert plan.world_size == best[1].world_size == cluster_.num_devices
        constrained += bool(plan.notes)
        gaps.append(reference_run(plan, chain_, cluster_).iteration_time_s / best[0] - 1)
    assert gaps and max(gaps) <= 0.03, gaps
    assert constrained, "no case where fewer devices were faster: the constraint went untested"
