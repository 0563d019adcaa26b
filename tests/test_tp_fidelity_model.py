"""The tensor-parallel cost terms behind issue 33's fidelity: ring collectives of T - 1 steps, the lock-step wait a
group's members pay for meeting their peers, its calibration formula, and the figure's way from the cluster file
into the simulator."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from reference_sim import reference_run
from test_tensor_parallel_plan import _hand_chain, _one_host

from fxpipe.core.cluster import Cluster, LinkSpec
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.runtime.calibration.calibrate_lockstep import lockstep_wait
from fxpipe.sim.simulate import simulate
from fxpipe.sim.tensor_parallel_cost import collective_seconds, ring_seconds, tensor_parallel_times


@pytest.mark.parametrize("degree", [2, 4, 8])
def test_a_ring_collective_pays_one_latency_per_step(degree: int) -> None:
    link = LinkSpec(1e9, 1e-5)
    # T - 1 steps of 10 us, each member moving 8,000 x (T-1)/T bytes at 1 GB/s
    expected = (degree - 1) * 1e-5 + 8000 * (degree - 1) / degree / 1e9
    assert ring_seconds(link, 8000, degree) == pytest.approx(expected, rel=1e-12)
    assert (ring_seconds(link, 8000, 1), ring_seconds(link, 0, degree)) == (0.0, 0.0)
    net = _one_host(8, bandwidth=2e9)  # the group's collectives run on the host's link: 10 us, 2 GB/s
    both = 2 * ((degree - 1) * 1e-5 + 8000 * (degree - 1) / degree / 2e9)
    assert collective_seconds(net, 8000, degree) == pytest.approx(both, rel=1e-12)


def test_split_blocks_wait_for_their_peers_and_whole_blocks_do_not() -> None:
    chain, net = _hand_chain(), replace(_one_host(), lockstep_wait_fraction=0.5)
    # 4 rows, T = 4: mm forward 4 ms x (0.2 + 0.8/4) x (1 + 3 x 0.5) = 4 ms, its rings 2 x (3 x 10 us + 3,000 B /
    # 1 GB/s) = 66 us; norm (does not split) 4 ms whole; backward: mm 8 ms x 0.4 x 2.5 = 8 ms
    forward, backward = tensor_parallel_times(chain, net, 0, 2, 4, 4)
    assert forward == pytest.approx(4e-3 + 66e-6 + 4e-3, rel=1e-12)
    assert backward == pytest.approx(8e-3 + 66e-6 + 4e-3, rel=1e-12)
    alone = tensor_parallel_times(chain, net, 0, 2, 4, 1)  # T = 1 meets nobody
    assert alone == tensor_parallel_times(chain, _one_host(), 0, 2, 4, 1) == pytest.approx((8e-3, 12e-3))


def test_the_wait_fraction_reaches_the_simulator_from_the_cluster_file() -> None:
    chain = _hand_chain()
    plan = Plan(4, 1, (StagePlan(0, 0, 2, 1, (0, 1), tensor_parallel=2),))
    waiting = Cluster.from_json(json.loads(json.dumps(replace(_one_host(), lockstep_wait_fraction=0.25).to_json())))
    assert waiting.lockstep_wait_fraction == 0.25
    # the split share of mm (forward 4 ms, backward 8 ms, x 0.6 at T = 2) waits 0.25 of itself for the one peer
    extra = (4e-3 + 8e-3) * 0.6 * 0.25
    base = simulate(plan, chain, _one_host()).iteration_time_s
    assert simulate(plan, chain, waiting).iteration_time_s == pytest.approx(base + extra, rel=1e-12)
    assert reference_run(plan, chain, waiting).iteration_time_s == pytest.approx(base + extra, rel=1e-12)
    with pytest.raises(ValueError, match="lockstep_wait_fraction must be >= 0"):
        replace(waiting, lockstep_wait_fraction=-0.1)


def test_lockstep_wait_is_the_loops_excess_over_its_parts() -> None:
    # 30 rounds: 60 ms of matmuls, 9 ms of all-reduces back to back, 90 ms together: 21 ms waited, 0.35 of compute
    assert lockstep_wait(0.090, 0.009, 0.060) == pytest.approx(0.35, rel=1e-12)
    assert lockstep_wait(0.060, 0.009, 0.060) == 0.0  # noise below the parts: no negative wait
    with pytest.raises(ValueError, match="compute alone must take some time"):
        lockstep_wait(0.09, 0.009, 0.0)
