"""The planner's shortcuts change nothing: memoised block sums, the vectorised balance, the simulation memo
and the lower bound that skips simulations (benchmarks/planner_identity.py checks whole plans)."""

from __future__ import annotations

import gc
import itertools
import random

import pytest
from planner_cases import random_case

from fxpipe.core import block_sums as block_sums_module
from fxpipe.core.block_sums import block_sums
from fxpipe.core.costgraph import Affine
from fxpipe.passes.partition import scoring as plan_scoring
from fxpipe.passes.partition.block_partition import balanced_cuts
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import PlanningError, PlanRequest
from fxpipe.passes.partition.scoring import score_candidates, simulated_lower_bound
from fxpipe.passes.partition.spans import Candidate, Span


def test_block_sums_are_bit_identical_to_summing_the_slice() -> None:
    chain, _, _ = random_case(7, max_blocks=8)
    rng = random.Random(0)
    sums = block_sums(chain)
    for _ in range(500):
        first, stop = rng.randint(0, chain.num_blocks), rng.randint(0, chain.num_blocks + 2)
        for field in ("forward_s", "backward_s", "saved_bytes"):
            expected = Affine.total(getattr(block, field) for block in chain.blocks[first:stop])
            assert sums.total(first, stop, field) == expected  # ==, not approx: ties between plans hinge on bits
    key = id(chain)
    assert key in block_sums_module._BY_CHAIN
    del chain, sums
    gc.collect()
    assert key not in block_sums_module._BY_CHAIN  # dropped with its chain: an id reused later is not confused


@pytest.mark.parametrize("seed", range(40))
def test_balanced_cuts_is_min_max_optimal(seed: int) -> None:
    rng = random.Random(seed)
    weights = [float(rng.randint(0, 4)) for _ in range(rng.randint(1, 9))]  # small integers: many ties
    num_parts = rng.randint(1, len(weights))
    stops = balanced_cuts(weights, num_parts)
    assert len(stops) == num_parts and stops[-1] == len(weights) and stops == sorted(set(stops))

    def largest(cuts: tuple[int, ...]) -> float:
        bounds = [0, *cuts, len(weights)]
        return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))

    best = min(largest(c) for c in itertools.combinations(range(1, len(weights)), num_parts - 1))
    assert largest(tuple(stops[:-1])) == best
    assert balanced_cuts(weights, num_parts) == stops  # deterministic


def test_lower_bound_never_exceeds_the_simulated_time_and_scores_are_memoised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    simulated: list[float] = []
    real = plan_scoring.simulate_plan

    def counting(plan, request):  # type: ignore[no-untyped-def]
        result = real(plan, request)
        simulated.append(result[0])
        return result

    monkeypatch.setattr(plan_scoring, "simulate_plan", counting)
    checked = 0
    for seed in range(12):
        chain, cluster, batch = random_case(seed)
        try:
            plan = partition(chain, cluster, batch)
        except PlanningError:
            continue
        request = PlanRequest(chain, cluster, batch, memory_limit_bytes=cluster.device.memory_bytes,
                              allreduce_bucket_bytes=plan.allreduce_bucket_bytes)
        model = request.candidate_costs()
        candidate = model.candidate(tuple(Span(s.first_block, s.stop_block, s.devices) for s in plan.stages),
                                    plan.microbatch_size)
        assert plan.predicted is not None
        assert simulated_lower_bound(model, candidate) <= plan.predicted.iteration_time_s * (1 + 1e-12)
        simulated.clear()
        first = score_candidates(request, model, [candidate], "dapple")
        count = len(simulated)
        again = score_candidates(request, model, [candidate], "dapple")
        assert len(simulated) == count  # the second scoring simulates nothing
        assert first == again and first is not None and first.time_s == plan.predicted.iteration_time_s
        assert score_candidates(request, model, [candidate], "dapple", bound_s=0.5 * first.time_s) is None
        checked += 1
    assert checked >= 6


def test_a_candidate_above_the_bound_is_not_simulated(monkeypatch: pytest.MonkeyPatch) -> None:
    chain, cluster, batch = random_case(3)
    request = PlanRequest(chain, cluster, batch, memory_limit_bytes=cluster.device.memory_bytes)
    model = request.candidate_costs()
    candidate = Candidate(0.0, batch, (Span(0, chain.num_blocks, (0,)),))
    monkeypatch.setattr(plan_scoring, "simulate_plan", lambda plan, request: pytest.fail("simulated"))
    bound = simulated_lower_bound(model, candidate) / 2
    assert score_candidates(request, model, [candidate], "dapple", bound_s=bound) is None
