"""Multi-node launches: the topology from the process group, the cluster it forms, plan devices on the real nodes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe.core.cluster import parse_cluster
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.runtime.calibration.topology import (
    NODE_ENV,
    Topology,
    cluster_for,
    device_ranks,
    node_name,
    placed_plan,
    topology_from_records,
)
from fxpipe.runtime.faults.errors import PipelineSetupError
from tests.mp_utils import join_world, leave_world, reserved_port, run_ranks

ROOT = Path(__file__).resolve().parents[1]
INTERLEAVED = [("node-a", 0), ("node-b", 0), ("node-a", 1), ("node-b", 1)]  # e.g. a cyclic SLURM layout


def _plan(devices: list[tuple[int, ...]], num_devices: int = 4) -> Plan:
    stages = tuple(StagePlan(stage_index=i, first_block=i, stop_block=i + 1, replicas=len(d), devices=d)
                   for i, d in enumerate(devices))
    return Plan(global_batch_size=8, num_microbatches=2, stages=stages, num_devices=num_devices, num_blocks=len(stages))


def test_topology_groups_ranks_by_node_and_local_rank() -> None:
    topology = topology_from_records(INTERLEAVED)
    assert topology.nodes == ((0, 2), (1, 3))
    assert (topology.num_nodes, topology.ranks_per_node, topology.world_size) == (2, 2, 4)
    assert [topology.node_of(rank) for rank in range(4)] == [0, 1, 0, 1]
    assert topology_from_records([("x", 1), ("x", 0)]).nodes == ((1, 0),)  # local rank orders a node's ranks
    uneven = topology_from_records([("a", 0), ("a", 1), ("b", 0)])
    assert uneven.ranks_per_node is None
    with pytest.raises(PipelineSetupError, match=r"different numbers of ranks \[2, 1\]"):
        cluster_for(uneven, torch.device("cpu"))
    with pytest.raises(ValueError, match="rank 7"):
        topology.node_of(7)


def test_node_name_honours_the_override_and_torchrun_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_ENV, raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert node_name() == socket.gethostname()
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_name() == socket.gethostname() + "/agent1"
    monkeypatch.setenv(NODE_ENV, "rack3-node7")
    assert node_name() == "rack3-node7"


def test_cluster_for_the_launched_nodes() -> None:
    two_nodes = cluster_for(Topology(((0, 1), (2, 3))), torch.device("cpu"))
    assert (two_nodes.num_hosts, two_nodes.devices_per_host, two_nodes.name) == (2, 2, "2x2:local")
    assert two_nodes.link(0, 2) != two_nodes.link(0, 1)  # between nodes is not the loopback link
    one_node = cluster_for(Topology(((0, 1, 2),)), torch.device("cpu"))
    assert one_node == parse_cluster("local:3")


def test_plan_devices_land_on_the_ranks_of_the_planned_hosts() -> None:
    topology = topology_from_records(INTERLEAVED)
    cluster = parse_cluster("2x2:cpu")
    assert device_ranks(topology, cluster) == (0, 2, 1, 3)
    placed = placed_plan(_plan([(0, 1), (2, 3)]), topology, cluster)  # stage s on host s
    assert [stage.devices for stage in placed.stages] == [(0, 2), (1, 3)]
    assert [{topology.node_of(r) for r in stage.devices} for stage in placed.stages] == [{0}, {1}]
    assert placed.notes == ("devices 0..3 run on ranks [0, 2, 1, 3] (the ranks of each planned host's node)",)
    contiguous = Topology(((0, 1), (2, 3)))
    assert placed_plan(_plan([(0, 1), (2, 3)]), contiguous, cluster) == _plan([(0, 1), (2, 3)])
    flat = placed_plan(_plan([(0, 1), (2, 3)]), topology, parse_cluster("1x4:cpu"))
    assert [stage.devices for stage in flat.stages] == [(0, 1), (2, 3)] and "does not match the launch" in flat.notes[0]
    with pytest.raises(PipelineSetupError, match="has 8 devices but the process group has 4 ranks"):
        placed_plan(_plan([(0, 1), (2, 3)], 8), topology, parse_cluster("2x4:cpu"))


def _interleaved_nodes(rank: int, world_size: int, store_dir: str) -> list[dict[str, Any]]:
    from tests.multinode_worker import check_rank

    node_id, _ = INTERLEAVED[rank]
    os.environ[NODE_ENV] = node_id
    join_world(store_dir, "interleaved", rank, world_size)
    try:
        return [check_rank(node_id, "auto"), check_rank(node_id, "2:2")]
    finally:
        leave_world()


def _check_results(results: list[dict[str, Any]], cluster_name: str) -> None:
    for result in results:
        assert result["cluster"] == cluster_name, result
        assert result["exact"] and result["num_params"] > 0, result
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-5), result
        assert sorted(d for stage in result["devices"] for d in stage) == [0, 1, 2, 3], result  # every rank
        for stage in result["placement"]:
            assert all(node == host for node, host in stage), result  # planned host == the rank's real node
        assert result["devices"] == results[0]["devices"], result


@pytest.mark.multiprocess
def test_interleaved_nodes_train_exactly_on_the_planned_hosts(tmp_path: Path) -> None:
    """Ranks 0, 2 on node-a and 1, 3 on node-b (FXPIPE_NODE_ID): the plan's hosts are the real nodes."""
    auto, forced = zip(*run_ranks(_interleaved_nodes, 4, tmp_path), strict=True)
    _check_results(list(auto), "2x2:local")
    _check_results(list(forced), "2x2:local")
    assert forced[0]["layout"] == "2:2"
    assert forced[0]["devices"] != forced[0]["planned_devices"]  # the ranks are not host-major: devices moved


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_torchrun_launches_act_as_two_nodes(tmp_path: Path) -> None:
    """torchrun --nnodes 2, two launches of 2 processes on this host: GROUP_RANK tells the nodes apart."""
    with reserved_port("localhost") as port:
        _two_launches(tmp_path, port)


def _two_launches(tmp_path: Path, port: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATE": "0", "PYTHONPATH": str(ROOT),
           "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks even where a GPU is visible (two ranks cannot share one)
    env.pop(NODE_ENV, None)
    launches = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
         "--max-restarts", "0", str(ROOT / "tests" / "multinode_worker.py"), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for node in (0, 1)]
    outputs = []
    try:
        for launch in launches:
            outputs.append(launch.communicate(timeout=240)[0])
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
                launch.wait()
    assert [launch.returncode for launch in launches] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]
    assert [result["node"] for result in results] == ["agent0", "agent0", "agent1", "agent1"]
    _check_results(results, "2x2:local")


def test_gpu_worlds_use_the_preset_of_their_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = torch.device("cuda", 0)  # no GPU needed: only the device name is read
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    two_nodes = cluster_for(Topology(((0, 1), (2, 3))), gpu)
    assert two_nodes == parse_cluster("2x2:h100")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    with pytest.raises(PipelineSetupError, match="no cluster preset for GPU 'NVIDIA GeForce RTX 4090'; pass cluster="):
        cluster_for(Topology(((0, 1), (2, 3))), gpu)
    assert cluster_for(Topology(((0, 1),)), gpu) == parse_cluster("local:2")  # one node: this host's figures
