"""The tensor-parallel cost terms behind issue 33's fidelity: ring collectives of T - 1 steps, the group's collectives
charged on the link calibrated between compute in lock-step, its calibration's fit, and the link's way from the
cluster file into the simulator."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from reference_sim import reference_run
from test_tensor_parallel_plan import _hand_chain, _one_host

from fxpipe.core.cluster import Cluster, LinkSpec
from fxpipe.core.cluster_spec import lockstep_link
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.runtime.calibration import calibrate_lockstep
from fxpipe.runtime.calibration.calibrate_lockstep import (
    LOCKSTEP_LARGE_BYTES,
    LOCKSTEP_SMALL_BYTES,
    timed_after_compute,
)
from fxpipe.runtime.calibration.ring_fit import ring_fit
from fxpipe.sim.simulate import simulate
from fxpipe.sim.tensor_parallel_cost import (
    collective_seconds,
    ring_seconds,
    tensor_parallel_link,
    tensor_parallel_times,
)


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


def test_split_blocks_charge_their_collectives_on_the_lockstep_link() -> None:
    lockstep = LinkSpec(2e8, 7e-4)  # 0.7 ms per ring step, 200 MB/s: collectives between compute on CPU ranks
    chain, net = _hand_chain(), replace(_one_host(), tensor_parallel_collective=lockstep)
    # 4 rows, T = 4: mm forward 4 ms x (0.2 + 0.8/4) = 1.6 ms, its rings 2 x (3 x 0.7 ms + 3,000 B / 200 MB/s) =
    # 4.23 ms; norm (does not split) 4 ms whole; backward: mm 8 ms x 0.4 = 3.2 ms and the same rings
    forward, backward = tensor_parallel_times(chain, net, 0, 2, 4, 4)
    assert forward == pytest.approx(1.6e-3 + 4.23e-3 + 4e-3, rel=1e-12)
    assert backward == pytest.approx(3.2e-3 + 4.23e-3 + 4e-3, rel=1e-12)
    assert tensor_parallel_link(net, "all_gather") == lockstep
    assert tensor_parallel_link(_one_host(), "all_gather") == _one_host().collective_link((0,))  # not measured
    alone = tensor_parallel_times(chain, net, 0, 2, 4, 1)  # T = 1 meets nobody
    assert alone == tensor_parallel_times(chain, _one_host(), 0, 2, 4, 1) == pytest.approx((8e-3, 12e-3))


def test_the_lockstep_link_reaches_the_simulator_from_the_cluster_file() -> None:
    chain = _hand_chain()
    plan = Plan(4, 1, (StagePlan(0, 0, 2, 1, (0, 1), tensor_parallel=2),))
    lockstep = LinkSpec(2e8, 7e-4)
    calibrated = Cluster.from_json(json.loads(json.dumps(
        replace(_one_host(), tensor_parallel_collective=lockstep).to_json())))
    assert calibrated.tensor_parallel_collective == lockstep
    # mm's rings at T = 2 (4 rows x 1,000 B, half moved in the one step), forward and backward, each an all-gather
    # and a reduce-scatter: 4 x (0.7 ms + 2,000 B / 200 MB/s) on the lock-step link, against 4 x (10 us + 2 us)
    extra = 4 * (7e-4 + 2000 / 2e8) - 4 * (1e-5 + 2000 / 1e9)
    base = simulate(plan, chain, _one_host()).iteration_time_s
    assert simulate(plan, chain, calibrated).iteration_time_s == pytest.approx(base + extra, rel=1e-12)
    assert reference_run(plan, chain, calibrated).iteration_time_s == pytest.approx(base + extra, rel=1e-12)


def test_calibrated_lockstep_figures_make_the_clusters_link() -> None:
    # calibrate_lockstep's two-rank all-reduces after compute: 0.9 ms at 8 B, 1.9 ms at 128 KiB; a ring of 2 steps
    latency, bandwidth = ring_fit(2, (LOCKSTEP_SMALL_BYTES, 0.9e-3), (LOCKSTEP_LARGE_BYTES, 1.9e-3), passes=2)
    assert bandwidth == pytest.approx((LOCKSTEP_LARGE_BYTES - 8) / 1e-3, rel=1e-12)
    assert 2 * latency + LOCKSTEP_LARGE_BYTES / bandwidth == pytest.approx(1.9e-3, rel=1e-12)
    figures = {"lockstep_latency": latency, "lockstep_bandwidth": bandwidth}
    assert lockstep_link(figures) == LinkSpec(bandwidth, latency)
    assert lockstep_link({}) is None  # GPUs and caches written before: the allreduce link stands
    # never faster than the allreduce link timed back to back (here 1 GB/s, 0.2 ms): a noisy fit is bounded by it
    bare = {"allreduce_bandwidth": 1e9, "allreduce_latency": 2e-4}
    assert lockstep_link({**figures, **bare}) == LinkSpec(bandwidth, latency)  # 131 MB/s, 0.45 ms: slower already
    noisy = {"lockstep_bandwidth": 1.3e14, "lockstep_latency": 1e-4, **bare}  # 128 KiB timed no slower than 8 B
    assert lockstep_link(noisy) == LinkSpec(1e9, 2e-4)
    # the model's all-reduce of 128 KiB on two members (a reduce-scatter and an all-gather) gives the timed 1.9 ms
    net = replace(_one_host(), tensor_parallel_collective=LinkSpec(bandwidth, latency))
    assert collective_seconds(net, LOCKSTEP_LARGE_BYTES, 2) == pytest.approx(1.9e-3, rel=1e-12)


def test_timed_after_compute_times_the_collective_and_not_the_compute() -> None:
    clock = {"now": 0.0}
    seen: list[str] = []

    def compute() -> None:
        seen.append("compute")
        clock["now"] += 1.0  # a long compute, never timed

    def collective() -> None:
        seen.append("collective")
        clock["now"] += 0.25

    real = calibrate_lockstep.time.perf_counter
    calibrate_lockstep.time.perf_counter = lambda: clock["now"]  # type: ignore[assignment]
    try:
        times = timed_after_compute(compute, collective, 3)
    finally:
        calibrate_lockstep.time.perf_counter = real  # type: ignore[assignment]
    assert times == [0.25, 0.25, 0.25]
    assert seen == ["compute", "collective"] * 3
