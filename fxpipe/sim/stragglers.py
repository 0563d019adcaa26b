"""Expected iteration time when device speeds vary from step to step (stragglers on shared hosts).

:func:`fxpipe.sim.simulate.simulate` is deterministic: every device computes at the speed of the cost
chain. On shared hardware that is an average; at any moment some devices run slower than others
(on this project's 2-core VM, two ranks running the same forward + backward side by side were up to
1.46x apart for a second at a time, and which one was slow changed from round to round). A
synchronous step waits for its slowest device, so the expected step is longer than the step at the
average speed. This module measures nothing: it takes the observed spread of compute times
(:class:`SpeedSpread`, e.g. from ranks timing the same work side by side) and returns the mean
iteration time over simulations in which every device draws its own speed factor for the step.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan
from fxpipe.core.schedule import Schedule
from fxpipe.sim.simulate import simulate

__all__ = ["SpeedSpread", "StragglerEstimate", "expected_iteration_time"]


@dataclass(frozen=True)
class SpeedSpread:
    """Compute-time factors of one device relative to the average device (their mean is 1).

    Build it with :meth:`from_times` from times of the same work measured on the devices at the
    same time, each over about one step; a factor of 1.3 is a device 30% slower than the average.
    """

    factors: tuple[float, ...]
    description: str = ""

    def __post_init__(self) -> None:
        if not self.factors or not all(f > 0 for f in self.factors):
            raise ValueError(f"SpeedSpread needs at least one positive factor; got {list(self.factors)}")
        mean = statistics.fmean(self.factors)
        if abs(mean - 1.0) > 1e-9:
            raise ValueError(f"SpeedSpread factors must average 1 (got mean {mean:.6f}); "
                             "build it with SpeedSpread.from_times(times)")

    @classmethod
    def from_times(cls, times_s: Sequence[float], description: str = "") -> SpeedSpread:
        """The spread of ``times_s`` (seconds of the same work on several devices): each over their mean."""
        if not times_s or not all(t > 0 for t in times_s):
            raise ValueError(f"from_times needs positive times of the same work; got {list(times_s)}")
        mean = statistics.fmean(times_s)
        factors = [t / mean for t in times_s]
        # Rounding can leave the mean a few ulps off 1; spread the remainder over all factors.
        correction = 1.0 / statistics.fmean(factors)
        return cls(tuple(f * correction for f in factors), description)

    @property
    def max_ratio(self) -> float:
        """Slowest over fastest factor."""
        return max(self.factors) / min(self.factors)


@dataclass(frozen=True)
class StragglerEstimate:
    """Iteration seconds of a plan at the chain's speed and over ``draws`` draws of device speeds."""

    deterministic_s: float
    mean_s: float
    p10_s: float
    p90_s: float
    draws: int

    @property
    def straggler_cost(self) -> float:
        """How much longer the expected step is than the step at the average speed (0.07: 7%)."""
        return self.mean_s / self.deterministic_s - 1.0 if self.deterministic_s > 0 else 0.0


def expected_iteration_time(plan: Plan, chain: CostChain, cluster: Cluster, spread: SpeedSpread, *,
                            draws: int = 64, seed: int = 0, optimizer: str = "adam",
                            schedule: Schedule | None = None) -> StragglerEstimate:
    """Mean simulated iteration time when each device draws a speed factor from ``spread`` per step.

    Every draw gives each cluster device an independent factor (uniformly from ``spread.factors``,
    seeded, so the result is deterministic for a given ``seed``) that stretches all its compute for
    the whole step (:func:`fxpipe.sim.simulate.simulate`'s ``compute_scale``); links are unchanged.
    """
    if draws < 1:
        raise ValueError(f"draws must be at least 1; got {draws}")
    deterministic = simulate(plan, chain, cluster, optimizer=optimizer, schedule=schedule,
                             timeline=False).iteration_time_s
    rng = random.Random(seed)
    times = sorted(
        simulate(plan, chain, cluster, optimizer=optimizer, schedule=schedule, timeline=False,
                 compute_scale=[rng.choice(spread.factors) for _ in range(cluster.num_devices)]).iteration_time_s
        for _ in range(draws)
    )
    deciles = statistics.quantiles(times, n=10, method="inclusive") if draws > 1 else [times[0]] * 9
    return StragglerEstimate(deterministic_s=deterministic, mean_s=statistics.fmean(times), p10_s=deciles[0],
                             p90_s=deciles[-1], draws=draws)
