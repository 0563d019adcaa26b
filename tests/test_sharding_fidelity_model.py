"""FSDP2's host time per collective in the sharding model: the charge per FSDP unit and call, its calibration
formula, and the figure's way from the cluster file into the simulator."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from reference_sim import reference_run
from test_tensor_parallel_plan import _hand_chain

from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.sim.sharding_cost import sharding_comm, unit_collectives
from fxpipe.sim.simulate import simulate

# memory at 1e12 B/s: the flat-buffer copies (2 bytes moved per byte) stay exact but small; CPU ranks, whose
# collectives block (FSDP2 on gloo), so each call's time adds whole (fxpipe.sim.unit_overlap)
NET = Cluster("1x2", 1, 2, DeviceSpec("CPU", 2**40, (("float32", 1e13),), 1e12), LinkSpec(1e9, 1e-5),
              LinkSpec(1e9, 1e-5))


def test_every_unit_call_pays_fsdp2s_host_time() -> None:
    net = replace(NET, fsdp_call_overhead_s=2e-3)
    # 4 units of 1e6 bytes over 2 ranks: each half a ring allreduce of 1e6 bytes on the 10 us, 1 GB/s link
    # (1 step: 10 us + 0.5e6 B / 1 GB/s) plus its copy through the buffer (2e6 B at 1e12 B/s), plus 2 ms
    one = 1e-5 + 0.5e6 / 1e9 + 2e6 / 1e12
    assert unit_collectives(net, 4e6, (0, 1), 4, "all_gather") == pytest.approx(4 * (one + 2e-3), rel=1e-12)
    assert unit_collectives(net, 0.0, (0, 1), 4, "all_gather") == 0.0  # no bytes, no call
    zero3 = sharding_comm(net, "parameters", (0, 1), 4e6, 4e6, num_units=4)
    plain = sharding_comm(NET, "parameters", (0, 1), 4e6, 4e6, num_units=4)
    # forward: 4 all-gathers; backward: 4 all-gathers and 4 reduce-scatters, each 2 ms more
    assert zero3.forward_s - plain.forward_s == pytest.approx(8e-3, rel=1e-9)
    assert zero3.backward_s - plain.backward_s == pytest.approx(16e-3, rel=1e-9)
    assert zero3.step_seconds(3) - plain.step_seconds(3) == pytest.approx(3 * 24e-3, rel=1e-9)


def test_the_call_overhead_reaches_the_simulator_from_the_cluster_file() -> None:
    chain = _hand_chain()  # two blocks with parameters: two FSDP units
    plan = Plan(4, 2, (StagePlan(0, 0, 2, 2, (0, 1), sharding="parameters"),))
    loaded = Cluster.from_json(json.loads(json.dumps(replace(NET, fsdp_call_overhead_s=1e-3).to_json())))
    assert loaded.fsdp_call_overhead_s == 1e-3
    # per micro-batch 2 units x (all-gather in forward, all-gather and reduce-scatter in backward), M = 2
    expected = simulate(plan, chain, NET).iteration_time_s + 2 * 2 * 3 * 1e-3
    assert simulate(plan, chain, loaded).iteration_time_s == pytest.approx(expected, rel=1e-9)
    assert reference_run(plan, chain, loaded).iteration_time_s == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="fsdp_call_overhead_s must be >= 0"):
        replace(loaded, fsdp_call_overhead_s=-1e-3)
