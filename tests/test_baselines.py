"""Baseline planners: each rule's shape, honest scoring by the same simulator, exhaustive limits."""

from __future__ import annotations

import pytest
import torch
from planner_cases import chain, cluster

from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.exhaustive import EXHAUSTIVE_LIMIT
from fxpipe.passes.partition.request import PlanningError

torch.set_num_threads(1)

FORWARD_MS = [1.0, 4.0, 1.0, 1.0, 1.0, 4.0]
PARAMS = [10**7, 10**5, 10**5, 10**5, 10**5, 4 * 10**7]


def test_dp_is_one_stage_on_every_device() -> None:
    plan = partition(chain(FORWARD_MS, PARAMS), cluster(2, 2), 16, planner="dp")
    assert plan.layout == "dp" and plan.stages[0].devices == (0, 1, 2, 3) and plan.planner == "dp"


def test_uniform_splits_blocks_evenly_with_equal_replicas() -> None:
    plan = partition(chain(FORWARD_MS, [10**9] * 6), cluster(1, 4, memory_gib=16, intra=1e9), 16,
                     planner="uniform")
    sizes = {s.stop_block - s.first_block for s in plan.stages}
    assert max(sizes) - min(sizes) <= 1
    assert len({s.replicas for s in plan.stages}) == 1
    assert plan.num_stages > 1  # 1 GB blocks over 1 GB/s make DP's allreduce too slow


def test_params_balances_parameter_bytes() -> None:
    # Weights of 4:1:1:2 x 0.5 GB over 1 GB/s: DP's allreduce (~4 s) loses to two stages, which the
    # parameter balance cuts after block 0 (2 GB | 2 GB), although compute would cut in the middle.
    unit = 5 * 10**8
    plan = partition(chain([1.0] * 4, [4 * unit, unit, unit, 2 * unit]), cluster(1, 2, intra=1e9), 8,
                     planner="params")
    assert plan.layout == "1:1"
    assert [(s.first_block, s.stop_block) for s in plan.stages] == [(0, 1), (1, 4)]


def test_gpipe_is_a_straight_pipeline_replicated_whole() -> None:
    plan = partition(chain(FORWARD_MS, [10**9] * 6), cluster(1, 4, intra=1e9), 16, planner="gpipe")
    num_stages = plan.num_stages
    for stage in plan.stages:
        assert stage.devices == tuple(c * num_stages + stage.stage_index for c in range(4 // num_stages))


def test_pipedream_plans_and_replicates() -> None:
    plan = partition(chain(FORWARD_MS, PARAMS), cluster(2, 2), 16, planner="pipedream")
    assert plan.planner == "pipedream" and sum(s.replicas for s in plan.stages) == 4


@pytest.mark.parametrize("name", ["dp", "gpipe", "uniform", "params", "pipedream"])
def test_exhaustive_is_never_beaten(name: str) -> None:
    chain_ = chain([1.0, 3.0, 1.0, 2.0], [10**8, 10**6, 10**6, 3 * 10**8])
    cluster_ = cluster(2, 2, inter=3e9)
    best = partition(chain_, cluster_, 16, planner="exhaustive")
    other = partition(chain_, cluster_, 16, planner=name)
    assert best.predicted is not None and other.predicted is not None
    assert best.predicted.iteration_time_s <= other.predicted.iteration_time_s * (1 + 1e-9)


def test_exhaustive_refuses_large_inputs() -> None:
    with pytest.raises(PlanningError, match="searches at most 12 devices, the cluster has 16"):
        partition(chain([1.0] * 16, [10**6] * 16), cluster(2, 8), 64, planner="exhaustive")
    # the count it names is of the groups it cuts between (every block holds parameters here: all 40)
    with pytest.raises(PlanningError, match=f"40 groups of blocks .* more than {EXHAUSTIVE_LIMIT} candidates"):
        partition(chain([1.0] * 40, [10**6] * 40), cluster(1, 8), 64, planner="exhaustive")


def test_baselines_get_the_best_microbatch_count() -> None:
    # With a fixed per-micro-batch cost, DP's best M is 1; a baseline pinned to another M would be slower.
    plan = partition(chain([1.0, 1.0], [10**6, 10**6]), cluster(1, 2), 16, planner="dp")
    assert plan.num_microbatches == 1
