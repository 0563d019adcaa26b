"""Expected iteration time under per-device speed draws (fxpipe.sim.stragglers): exact small cases and oracles."""

from __future__ import annotations

import itertools
import statistics

import pytest

from fxpipe.sim.simulate import simulate
from fxpipe.sim.stragglers import SpeedSpread, StragglerEstimate, expected_iteration_time
from tests.test_simulate import BACKWARD_PER_ROW, FORWARD_PER_ROW, cluster, plan_of, uniform_chain


def test_from_times_divides_by_the_mean() -> None:
    spread = SpeedSpread.from_times([0.03, 0.04, 0.05], "three runs")
    assert spread.factors == pytest.approx((0.75, 1.0, 1.25), rel=1e-12)
    assert statistics.fmean(spread.factors) == pytest.approx(1.0, abs=1e-12)
    assert spread.max_ratio == pytest.approx(5 / 3) and spread.description == "three runs"


@pytest.mark.parametrize("times", [[], [0.01, 0.0], [0.02, -0.01]])
def test_from_times_needs_positive_times(times: list[float]) -> None:
    with pytest.raises(ValueError, match="positive times of the same work"):
        SpeedSpread.from_times(times)


@pytest.mark.parametrize(("factors", "pattern"), [((), "at least one positive factor"),
                                                  ((1.0, 0.0, 2.0), "at least one positive factor"),
                                                  ((1.0, 1.5), r"must average 1 \(got mean 1\.25")])
def test_spread_factors_are_checked(factors: tuple[float, ...], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        SpeedSpread(factors)


def test_no_spread_gives_the_deterministic_time() -> None:
    plan, chain, net = plan_of((2, 1), 2, 4, 4), uniform_chain(4, cut_bytes_per_row=64.0), cluster(latency=1e-4)
    estimate = expected_iteration_time(plan, chain, net, SpeedSpread((1.0,)), draws=5)
    deterministic = simulate(plan, chain, net).iteration_time_s
    assert estimate == StragglerEstimate(deterministic, deterministic, deterministic, deterministic, 5)
    assert estimate.straggler_cost == 0.0


def test_data_parallel_waits_for_its_slowest_replica() -> None:
    """Two replicas, no communication cost: the step is the slower replica's compute (exact oracle)."""
    rows, num_microbatches = 4, 2
    plan, chain, net = plan_of((2,), 1, rows, num_microbatches), uniform_chain(1, param_bytes=0), cluster(per_host=2, bandwidth=1e30)
    spread = SpeedSpread((0.5, 1.5))
    compute = num_microbatches * (rows // 2) * (FORWARD_PER_ROW + BACKWARD_PER_ROW)
    # every pair of draws is equally likely: E[max] = (0.5 + 1.5 + 1.5 + 1.5) / 4 = 1.25
    expected_max = statistics.fmean(max(pair) for pair in itertools.product(spread.factors, repeat=2))
    estimate = expected_iteration_time(plan, chain, net, spread, draws=4000, seed=3)
    assert estimate.deterministic_s == pytest.approx(compute)
    assert estimate.mean_s == pytest.approx(expected_max * compute, rel=0.03)
    assert (estimate.p10_s, estimate.p90_s) == pytest.approx((0.5 * compute, 1.5 * compute))
    assert estimate.straggler_cost == pytest.approx(0.25, abs=0.03)


def test_draws_are_seeded_and_checked() -> None:
    plan, chain, net = plan_of((1, 1), 1, 2, 3), uniform_chain(2), cluster(per_host=2)
    spread = SpeedSpread.from_times([1.0, 2.0, 4.0])
    first = expected_iteration_time(plan, chain, net, spread, draws=16, seed=7)
    assert expected_iteration_time(plan, chain, net, spread, draws=16, seed=7) == first
    assert expected_iteration_time(plan, chain, net, spread, draws=16, seed=8) != first
    with pytest.raises(ValueError, match="draws must be at least 1; got 0"):
        expected_iteration_time(plan, chain, net, spread, draws=0)
