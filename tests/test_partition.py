"""DAPPLE planner: exact small cases, forced layouts, the DP floor, oracle vs exhaustive, errors."""

from __future__ import annotations

import json

import pytest
import torch
from planner_cases import GiB, chain, cluster, random_case
from reference_planner import best_plan
from reference_sim import gradient_allreduce_seconds, reference_run, step_end_seconds

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import BaselineResult, Plan, PlanError, StagePlan
from fxpipe.passes.partition.dapple import (
    PLANNERS,
    InfeasiblePlanError,
    LayoutError,
    PlanningError,
    partition,
)
from fxpipe.passes.partition.scoring import apart, memory_unit
from fxpipe.report import baseline_table

torch.set_num_threads(1)


def test_no_weights_means_plain_dp() -> None:
    # Without parameters there is no allreduce, so DP has neither bubbles nor communication.
    plan = partition(chain([1.0, 1.0], [0, 0]), cluster(1, 2), 8)
    assert plan.layout == "dp"
    assert plan.stages[0].devices == (0, 1)
    assert plan.predicted is not None
    # 8 rows over 2 devices, 1 + 2 ms per row and block: 4 rows * 2 blocks * 3 ms.
    assert plan.predicted.iteration_time_s == pytest.approx(0.024)
    assert plan.predicted.dp_iteration_time_s == pytest.approx(0.024)


def test_heavy_weights_on_a_slow_link_make_a_pipeline() -> None:
    # 1 GB per block over a 1 GB/s link: DP's allreduce (2 s) dwarfs compute, a 1:1 pipeline has none.
    plan = partition(chain([1.0, 1.0], [10**9, 10**9]), cluster(1, 2, intra=1e9), 8)
    assert plan.layout == "1:1"
    assert [(s.first_block, s.stop_block) for s in plan.stages] == [(0, 1), (1, 2)]
    assert plan.predicted is not None and plan.predicted.iteration_time_s < plan.predicted.dp_iteration_time_s


def test_plan_fields_are_filled() -> None:
    plan = partition(chain([1.0, 2.0, 1.0], [10**8, 10**6, 10**8]), cluster(1, 4), 16)
    assert plan.planner == "dapple" and plan.cluster == "1x4" and plan.num_devices == 4
    assert plan.num_blocks == 3 and plan.block_names == ("b0", "b1", "b2")
    assert plan.planning_time_s > 0
    for stage in plan.stages:
        expected = tuple(f"n{i}{s}" for i in range(stage.first_block, stage.stop_block) for s in "ab")
        assert stage.node_names == expected
        assert stage.forward_s > 0 and stage.peak_memory_bytes > 0 and stage.inflight_microbatches >= 1
    assert plan.predicted is not None and plan.predicted.analytic_iteration_time_s > 0


@pytest.mark.parametrize("layout, replicas", [("1:1", (1, 1)), ("3:1", (3, 1)), ("dp", (4,)), ("1:1:1:1", (1,) * 4)])
def test_forced_layouts(layout: str, replicas: tuple[int, ...]) -> None:
    plan = partition(chain([1.0, 2.0, 1.0, 1.0], [10**5, 10**6, 10**5, 10**5]), cluster(1, 4), 16, layout=layout)
    assert tuple(s.replicas for s in plan.stages) == replicas


def dp_closed_form(chain_: CostChain, cluster_: Cluster, batch: int, num_microbatches: int) -> float:
    """Plain data parallelism by hand: the largest slice's M x (forward + backward), then one ring allreduce
    of the gradients (copied into one buffer and back), then the loss allreduce ending the step."""
    rows = -(-batch // num_microbatches // cluster_.num_devices)
    per_microbatch = sum(b.forward_s.at(rows) + b.backward_s.at(rows) for b in chain_.blocks)
    weights = sum(b.param_bytes for b in chain_.blocks)
    devices = tuple(range(cluster_.num_devices))
    plan = Plan(batch, num_microbatches, (StagePlan(0, 0, chain_.num_blocks, len(devices), devices),))
    return (num_microbatches * per_microbatch + gradient_allreduce_seconds(cluster_, weights, devices)
            + step_end_seconds(cluster_, plan))


def dp_fits(chain_: CostChain, cluster_: Cluster, batch: int, num_microbatches: int) -> bool:
    """Adam's 4x weights plus one micro-batch's saved activations (one stage holds one at a time)."""
    rows = -(-batch // num_microbatches // cluster_.num_devices)
    need = sum(4 * b.param_bytes + b.saved_bytes.at(rows) for b in chain_.blocks)
    return need <= cluster_.device.memory_bytes


BY_HAND = {"recompute": "never", "allreduce_bucket_bytes": 0}  # what dp_closed_form and dp_fits assume


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5, 24])
def test_dp_scored_by_hand_and_never_beaten_by_it(seed: int) -> None:
    """DP's time from a closed form (not the planner's ``best_dp``): the dp planner reports exactly that for
    its M and picks the best power-of-two micro-batch size that fits; DAPPLE is never slower; when no M
    fits, both planners say so instead of the test returning. The closed form keeps every activation
    and reduces after the backward, so the dp planner is asked for exactly that (``BY_HAND``)."""
    chain_, cluster_, batch = random_case(seed, max_blocks=5, max_devices=4)
    num_devices = cluster_.num_devices
    counts = [m for m in (2**k for k in range(batch.bit_length())) if batch % m == 0 and batch // m >= num_devices]
    fitting = {m: dp_closed_form(chain_, cluster_, batch, m) for m in counts if dp_fits(chain_, cluster_, batch, m)}
    if not fitting:
        with pytest.raises(InfeasiblePlanError):
            partition(chain_, cluster_, batch, planner="dp", **BY_HAND)
        return
    dp = partition(chain_, cluster_, batch, planner="dp", **BY_HAND)
    assert dp.predicted is not None and dp.num_microbatches in fitting
    assert dp.predicted.iteration_time_s == pytest.approx(fitting[dp.num_microbatches], rel=1e-9)
    assert dp.predicted.iteration_time_s <= min(fitting.values()) * (1 + 1e-9)
    plan = partition(chain_, cluster_, batch)
    assert plan.predicted is not None
    assert plan.predicted.iteration_time_s <= min(fitting.values()) * (1 + 1e-9)


def test_dp_cases_include_one_where_dp_does_not_fit() -> None:
    outcomes = set()
    for seed in [0, 1, 2, 3, 4, 5, 24]:
        chain_, cluster_, batch = random_case(seed, max_blocks=5, max_devices=4)
        outcomes.add(any(dp_fits(chain_, cluster_, batch, m) for m in range(1, batch + 1) if batch % m == 0))
    assert outcomes == {True, False}


def test_oracle_within_three_percent_of_brute_force() -> None:
    """A fast subset of benchmarks/planner_oracle.py, against the test-owned brute force (tests/reference_planner.py:
    its own enumeration, recompute choice, memory rule and reference simulator, nothing of the planner's scoring)."""
    gaps = []
    for seed in range(100, 112):
        chain_, cluster_, batch = random_case(seed, max_blocks=5, max_devices=4)
        best = best_plan(chain_, cluster_, batch)
        if best is None:
            with pytest.raises(InfeasiblePlanError):
                partition(chain_, cluster_, batch)
            continue
        plan = partition(chain_, cluster_, batch)
        gaps.append(reference_run(plan, chain_, cluster_).iteration_time_s / best[0] - 1)
    assert gaps and max(gaps) <= 0.03, gaps


def test_compare_fills_every_baseline() -> None:
    plan = partition(chain([1.0, 2.0, 1.0], [10**8, 10**6, 10**8]), cluster(1, 2), 8, compare=True)
    names = dict(plan.baselines)
    assert set(names) == set(PLANNERS) - {"dapple"}
    assert plan.predicted is not None
    for result in names.values():
        assert result.feasible and result.iteration_time_s >= plan.predicted.iteration_time_s * (1 - 1e-9)


def test_memory_infeasible_explains_the_closest_attempt() -> None:
    with pytest.raises(InfeasiblePlanError) as error:
        partition(chain([1.0, 1.0], [GiB, GiB]), cluster(1, 2, memory_gib=1), 8)
    message = str(error.value)
    assert "need GiB" in message and "capacity GiB" in message and "OVER" in message
    assert "more devices" in message and "optimizer" in message


def test_memory_infeasible_reads_in_the_devices_unit_and_tells_need_from_capacity() -> None:
    assert memory_unit(80 * GiB) == ("GiB", GiB) and memory_unit(2**20 - 1) == ("KiB", 1024)
    assert memory_unit(8 * 2**20) == ("MiB", 2**20)
    assert apart(17.49 * GiB, 16 * GiB, GiB) == ("17.49", "16.00")
    assert apart(8 * 2**20 + 4096, 8 * 2**20 - 1, 2**20) == ("8.004", "8.000")  # 2 decimals would read 8.00 both
    assert apart(GiB, GiB, GiB) == ("1.00", "1.00")
    with pytest.raises(InfeasiblePlanError) as error:
        partition(chain([1.0, 1.0], [2**20, 2**20]), cluster(1, 2, memory_gib=3 / 1024), 8)
    assert "need MiB" in str(error.value) and "3.00 MiB per device" in str(error.value), str(error.value)


def test_memory_limit_override_changes_the_plan() -> None:
    roomy = partition(chain([1.0, 1.0], [10**8, 10**8]), cluster(1, 2), 8)
    assert roomy.predicted is not None
    with pytest.raises(InfeasiblePlanError):
        partition(chain([1.0, 1.0], [10**8, 10**8]), cluster(1, 2), 8, memory_limit_bytes=10**8)


@pytest.mark.parametrize("kwargs, match", [
    ({"planner": "magic"}, "planner 'magic' is unknown"),
    ({"layout": "3:x"}, "layout '3:x' is malformed"),
    ({"layout": "4:4"}, "needs 8 devices but the cluster has 4"),
    ({"num_microbatches": 3}, "does not divide into num_microbatches=3"),
    ({"layout": "1:1:1", "num_microbatches": 2}, "fewer than the 3 stages"),
    ({"warmup_policy": "C"}, "warmup_policy 'C' is unknown"),
])
def test_bad_requests_name_the_value(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(PlanningError, match=match):
        partition(chain([1.0, 1.0, 1.0], [0, 0, 0]), cluster(1, 4), 16, **kwargs)  # type: ignore[arg-type]
    assert issubclass(LayoutError, ValueError)


def test_plan_json_is_byte_identical_and_infeasible_baselines_are_null() -> None:
    # DP holds both 1 GB blocks (with Adam state) on each 6 GiB device: it does not fit; a 1:1 pipeline does.
    case = (chain([1.0, 1.0], [10**9, 10**9]), cluster(1, 2, memory_gib=6), 8)
    first, second = (partition(*case, compare=True) for _ in range(2))
    assert first.planning_time_s > 0 and second.planning_time_s > 0
    assert first.to_json() == second.to_json()  # byte-identical: the run's timing is not in the plan
    data = json.loads(first.to_json())
    assert "planning_time_s" not in data
    assert first.layout == "1:1" and data["baselines"]["dp"]["iteration_time_s"] is None
    assert data["baselines"]["dp"]["feasible"] is False
    assert Plan.from_json(first.to_json()) == first
    dp_row = next(line for line in baseline_table(first).splitlines() if line.startswith("dp "))
    assert "infeasible" in dp_row
    with pytest.raises(PlanError, match="infeasible baseline has no time"):
        first.with_updates(baselines=(("dp", BaselineResult("", 0.0, feasible=False)),))


def test_plan_files_differ_only_inside_the_run_object(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """DESIGN: two runs of the same command write the same bytes except inside the top-level "run" object."""
    from fxpipe.cli import main
    from fxpipe.core.planfile import load_plan_file

    paths = [tmp_path / name for name in ("a.json", "b.json", "c.json", "d.json")]
    for path in paths[:2]:
        assert main(["plan", "gpt-mini", "--cluster", "local:2", "--global-batch", "8", "--json", str(path)]) == 0
    for path in paths[2:]:
        assert main(["plan", "gpt-mini", "--cluster", "local:2", "--global-batch", "8", "--json", str(path),
                     "--no-run-info"]) == 0
    first, second = (json.loads(path.read_text()) for path in paths[:2])
    assert set(first["run"]) == {"planning_time_s", "host", "fxpipe_version", "python_version"}
    assert first["run"]["planning_time_s"] > 0
    del first["run"], second["run"]
    assert first == second
    assert paths[2].read_bytes() == paths[3].read_bytes() and "run" not in json.loads(paths[2].read_text())
    assert load_plan_file(paths[0])[0] == load_plan_file(paths[2])[0]  # reading ignores the run object
