"""Overlap that costs something: a bucket allreduce in flight slows the compute beside it and is slowed by it
(Cluster.overlap_compute_slowdown / overlap_comm_slowdown), in the tail model, the simulator, the pivot model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.core.cluster import Cluster, ClusterSpecError, parse_cluster
from fxpipe.core.hardware import GPU_OVERLAP_SLOWDOWNS
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.sim.allreduce_overlap import Overlap, bucket_offsets, overlap_offsets, stage_allreduce_overlap
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import step_end_sync_time
from tests.test_simulate import BACKWARD_PER_ROW, FORWARD_PER_ROW, cluster, plan_of, uniform_chain

FOUR_BLOCKS = ([1.0] * 4, [10.0] * 4)  # 1 s of backward and 10 bytes each; buckets of 20 bytes full at 2 s and 4 s


def test_free_overlap_is_the_old_model() -> None:
    assert overlap_offsets(*FOUR_BLOCKS, 20, lambda b: b * 0.1) == Overlap(-2.0, 2.0, 0.0)


@pytest.mark.parametrize("seconds_per_byte, compute, comm, expected", [
    # bucket 0 (2 s alone) from 2 s: both at half speed until 6 s, when the pass (2 s left) and the bucket end
    # together; bucket 1 runs alone 6..8 s: tail 4 s after the 4 s pass, which took 2 s longer
    (0.1, 1.0, 1.0, Overlap(-2.0, 4.0, 2.0)),
    # compute 1.5x: the pass ends at 5 s with 0.5 s of bucket 0 left (2 s at half speed: 1.5 s done)
    (0.1, 0.5, 1.0, Overlap(-2.0, 3.5, 1.0)),
    # a fast link (1 s per bucket, unslowed): bucket 0 ends at 3 s, the pass did 0.5 s of compute beside it;
    # 1.5 s alone to 4.5 s, then bucket 1 alone to 5.5 s
    (0.05, 1.0, 0.0, Overlap(-2.0, 1.5, 0.5)),
])
def test_contended_buckets_by_hand(seconds_per_byte: float, compute: float, comm: float, expected: Overlap) -> None:
    got = overlap_offsets(*FOUR_BLOCKS, 20, lambda b: b * seconds_per_byte, compute, comm)
    assert got == expected
    assert bucket_offsets(*FOUR_BLOCKS, 20, lambda b: b * seconds_per_byte, compute, comm) == expected[:2]


def test_no_buckets_no_overlap_no_cost() -> None:
    assert overlap_offsets(*FOUR_BLOCKS, 0, lambda b: b * 0.1, 1.0, 1.0) == Overlap(0.0, 4.0, 0.0)
    # stage 0 under split backward: an empty last W, every bucket starts as it ends
    assert overlap_offsets([0.0] * 4, [10.0] * 4, 20, lambda b: b * 0.1, 1.0, 1.0) == Overlap(0.0, 4.0, 0.0)


def overlap_net(compute: float, comm: float) -> Cluster:
    return replace(cluster(1, 4, bandwidth=2.0**19, latency=2.0**-14), overlap_compute_slowdown=compute,
                   overlap_comm_slowdown=comm)


@pytest.mark.parametrize("compute, comm", [(0.5, 1.0), (0.25, 0.0), (0.0, 3.0)])
def test_simulator_stretches_the_last_backward_and_agrees_with_the_pivot_model(compute: float, comm: float) -> None:
    rows, num_microbatches, replicas = 8, 3, 2
    chain, net = uniform_chain(4, param_bytes=2**16), overlap_net(compute, comm)
    plan = plan_of((replicas,), 4, rows, num_microbatches).with_updates(allreduce_bucket_bytes=2**16)
    slice_rows = rows // replicas
    overlap = stage_allreduce_overlap(chain, net, 0, 4, (0, 1), slice_rows, 4 * 2**16, 2**16)
    free = stage_allreduce_overlap(chain, replace(net, overlap_compute_slowdown=0.0, overlap_comm_slowdown=0.0),
                                   0, 4, (0, 1), slice_rows, 4 * 2**16, 2**16)
    assert overlap.start == free.start and overlap.end > free.end
    assert (overlap.stretch > 0) == (compute > 0)
    compute_s = num_microbatches * 4 * slice_rows * (FORWARD_PER_ROW + BACKWARD_PER_ROW)
    result = simulate(plan, chain, net)
    sync = step_end_sync_time(net, range(replicas))
    assert result.iteration_time_s == pytest.approx(compute_s + overlap.end + sync, rel=1e-12)
    assert result.allreduce_start_s[0] == pytest.approx(compute_s + overlap.start, rel=1e-12)
    last_backward = [e for e in result.events if e.op == "B" and e.device == 0][-1]
    assert last_backward.end_s - last_backward.start_s == pytest.approx(
        4 * slice_rows * BACKWARD_PER_ROW + overlap.stretch, rel=1e-12)
    assert result.busy_s[0] == pytest.approx(compute_s + overlap.stretch, rel=1e-12)
    assert analytic_iteration_time(plan, chain, net) == pytest.approx(result.iteration_time_s, rel=1e-12)


def test_a_pipeline_stage_stretched_delays_the_stage_before_it() -> None:
    """Stage 1's last backward runs beside its buckets; stage 0's last backward waits for its gradient (and
    is stretched by its own buckets)."""
    chain, net = uniform_chain(4, param_bytes=2**16), overlap_net(1.0, 0.0)
    plan = plan_of((2, 2), 2, 8, 3).with_updates(allreduce_bucket_bytes=2**16)
    free = simulate(plan, chain, replace(net, overlap_compute_slowdown=0.0))
    costly = simulate(plan, chain, net)
    stretch = stage_allreduce_overlap(chain, net, 2, 4, (2, 3), 4, 2 * 2**16, 2**16).stretch
    assert stretch > 0
    stage0_last = [e for e in costly.events if e.op == "B" and e.device == 0][-1]
    free0_last = [e for e in free.events if e.op == "B" and e.device == 0][-1]
    assert stage0_last.start_s == pytest.approx(free0_last.start_s + stretch, rel=1e-12)
    own = stage_allreduce_overlap(chain, net, 0, 2, (0, 1), 4, 2 * 2**16, 2**16).stretch  # its own buckets
    assert stage0_last.end_s - stage0_last.start_s == pytest.approx(free0_last.end_s - free0_last.start_s + own,
                                                                    rel=1e-12)
    assert costly.iteration_time_s > free.iteration_time_s


def test_cluster_json_round_trip_defaults_and_checks() -> None:
    net = overlap_net(0.19, 0.1)
    assert Cluster.from_json(net.to_json()) == net
    data = net.to_json()
    del data["overlap_compute_slowdown"], data["overlap_comm_slowdown"]
    old = Cluster.from_json(data)  # written before the fields: overlap is free
    assert (old.overlap_compute_slowdown, old.overlap_comm_slowdown) == (0.0, 0.0)
    for key in ("overlap_compute_slowdown", "overlap_comm_slowdown"):
        with pytest.raises(ClusterSpecError, match=key):
            Cluster.from_json({**net.to_json(), key: -0.1})
        with pytest.raises(ClusterSpecError, match=key):
            Cluster.from_json({**net.to_json(), key: "fast"})
        with pytest.raises(ValueError, match=key):
            replace(net, **{key: -1.0})
    for spec in ("dapple-a", "dapple-c", "2x8:h100", "dgx-h100"):
        gpu = parse_cluster(spec)
        assert (gpu.overlap_compute_slowdown, gpu.overlap_comm_slowdown) == GPU_OVERLAP_SLOWDOWNS
    cpu = parse_cluster("1x2:cpu")
    assert cpu.overlap_compute_slowdown > 0 and cpu.overlap_comm_slowdown > 0
