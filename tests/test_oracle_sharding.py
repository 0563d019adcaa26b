"""Planner oracle for ``sharding="auto"``: the planner against the independent brute force of
tests/reference_planner.py, which simulates every fitting combination of (sharding level, recompute) per stage
for every cut, replica count, placement, micro-batch count and warm-up policy with tests/reference_sim.py.

Tight memory is drawn so that plans often fit only sharded. Tolerance as tests/test_oracle_planner.py: the
planner screens with its pivot model, tries power-of-two micro-batch sizes, and picks each stage's level by
the stage's own step time, so it may miss the optimum by a little, never by more than ``TOLERANCE``.
"""

from __future__ import annotations

import functools
import random

import pytest
from reference_planner import best_plan
from reference_sim import compute_order, inflight_peak, reference_run, stage_peak_bytes

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan
from fxpipe.passes.partition.dapple import InfeasiblePlanError, partition

TOLERANCE = 0.01


def tight_case(seed: int) -> tuple[CostChain, Cluster, int]:
    """3-4 blocks of 1e7-1e8 parameter bytes, 4 devices (1x4 or 2x2), memory 2.5-5x the largest block's (a block
    alone takes 4x unsharded under Adam, 2x + 3x/r gathered under ZeRO-1, more under ZeRO-2/3)."""
    rng = random.Random(seed)
    num_blocks = rng.randint(3, 4)
    blocks = tuple(Block(f"b{i}", (f"n{i}",), Affine(0.0, rng.uniform(1e-4, 1e-3)), Affine(0.0, rng.uniform(2e-4, 2e-3)),
                         int(10 ** rng.uniform(7, 8)), Affine(0, 10 ** rng.uniform(4, 6)))
                   for i in range(num_blocks))
    cuts = tuple(Affine(0, 10 ** rng.uniform(3, 5)) for _ in range(num_blocks - 1))
    largest = max(b.param_bytes for b in blocks)
    device = DeviceSpec("dev", int(largest * rng.uniform(2.5, 5.0)), (("float32", 1e13),), 1e12)
    num_hosts = rng.choice([1, 2])
    net = Cluster(f"tight{seed}", num_hosts, 4 // num_hosts, device, LinkSpec(25e9, 5e-6),
                  LinkSpec(rng.choice([1e9, 12.5e9]), 2e-5))
    chain = CostChain(blocks, cuts, Affine(0, 1e4), Affine(0, 1e3), f"tight:{seed}")
    return chain, net, rng.choice([8, 16])


@functools.cache
def oracle(seed: int, sharding: str) -> tuple[float, Plan] | None:
    return best_plan(*tight_case(seed), sharding=sharding)


def fits(plan: Plan, chain: CostChain, limit_bytes: int) -> bool:
    order = compute_order(plan)
    return all(stage_peak_bytes(plan, chain, s, inflight_peak(order[s], False)) <= limit_bytes
               for s in range(plan.num_stages))


SEEDS = tuple(range(24))


@pytest.mark.parametrize("seed", SEEDS)
def test_auto_sharding_is_near_the_brute_force_optimum_and_feasible(seed: int) -> None:
    chain, net, batch = tight_case(seed)
    best = oracle(seed, "auto")
    if best is None:
        with pytest.raises(InfeasiblePlanError):
            partition(chain, net, batch, sharding="auto")
        return
    plan = partition(chain, net, batch, sharding="auto")
    where = (f"seed {seed}: planner {plan.layout} M={plan.num_microbatches} {[s.sharding for s in plan.stages]} "
             f"vs oracle {best[1].layout} M={best[1].num_microbatches} {[s.sharding for s in best[1].stages]}")
    assert fits(plan, chain, net.device.memory_bytes), where
    reference = reference_run(plan, chain, net)
    assert plan.predicted is not None
    assert plan.predicted.iteration_time_s == pytest.approx(reference.iteration_time_s, rel=1e-9), where
    assert [s.peak_memory_bytes for s in plan.stages] == reference.peak_memory_bytes, where
    assert reference.iteration_time_s / best[0] - 1 <= TOLERANCE, (where, reference.iteration_time_s, best[0])


def test_cases_include_plans_that_fit_only_sharded() -> None:
    """The seeds are worth running: some fit only sharded, and the oracle's best is sharded somewhere."""
    only_sharded = [seed for seed in SEEDS if oracle(seed, "none") is None and oracle(seed, "auto") is not None]
    sharded_best = [seed for seed in SEEDS if (best := oracle(seed, "auto")) is not None
                    and any(s.sharding != "none" for s in best[1].stages)]
    assert only_sharded and sharded_best, (only_sharded, sharded_best)
