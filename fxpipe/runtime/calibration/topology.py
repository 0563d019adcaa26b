"""Which node every rank runs on: discovery over the process group, the cluster it forms, plan devices -> ranks."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
from fxpipe.core.cluster import Cluster, compact_cluster, parse_cluster
from fxpipe.core.hardware import ETHERNET_10G_COLLECTIVE, ETHERNET_10G_P2P
from fxpipe.core.plan import Plan
from fxpipe.runtime.faults.errors import PipelineSetupError

# Overrides the node a rank reports (tests, or launchers whose hostnames do not tell nodes apart).
NODE_ENV = "FXPIPE_NODE_ID"
# Device names (lower case) -> compact cluster kinds, for GPU worlds given no cluster.
_GPU_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v100", "v100"))


@dataclass(frozen=True)
class Topology:
    """The process group's ranks grouped by node.

    ``nodes[k]`` are the ranks on node k, ordered by local rank; nodes are numbered by their lowest
    rank, so under torchrun (ranks contiguous per node) node k holds ranks ``k * L .. k * L + L - 1``.
    """

    nodes: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int | None:
        """Ranks on every node, or None when nodes run different numbers of ranks."""
        counts = {len(ranks) for ranks in self.nodes}
        return counts.pop() if len(counts) == 1 else None

    def node_of(self, rank: int) -> int:
        for node, ranks in enumerate(self.nodes):
            if rank in ranks:
                return node
        raise ValueError(f"rank {rank} is not in this topology (world of {self.world_size})")


def node_name() -> str:
    """This process's node: ``$FXPIPE_NODE_ID`` if set, else the hostname plus torchrun's agent rank.

    torchrun runs one agent per node and numbers them ``GROUP_RANK``, so two launches on one host
    (``--nnodes 2``) count as two nodes, as torchrun itself treats them.
    """
    override = os.environ.get(NODE_ENV, "").strip()
    if override:
        return override
    agent = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"/agent{agent}" if agent is not None else "")


def topology_from_records(records: Sequence[tuple[str, int]]) -> Topology:
    """The topology from every rank's ``(node name, local rank)``, indexed by rank."""
    by_node: dict[str, list[tuple[int, int]]] = {}
    for rank, (name, local_rank) in enumerate(records):
        by_node.setdefault(name, []).append((local_rank, rank))
    nodes = [tuple(rank for _, rank in sorted(entries)) for entries in by_node.values()]
    return Topology(tuple(sorted(nodes, key=min)))


def discover_topology(group: dist.ProcessGroup | None = None) -> Topology:
    """All-gather ``(node name, local rank)`` over ``group`` (default: the default group; a collective)."""
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    record = (node_name(), local_rank)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return topology_from_records([record])
    records: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record, group=group)
    return topology_from_records([entry for entry in records if entry is not None])


def _gpu_kind(device: torch.device) -> str | None:
    name = torch.cuda.get_device_name(device).lower()
    return next((kind for key, kind in _GPU_KINDS if key in name), None)


def cluster_for(topology: Topology, device: torch.device, *, collective: bool = False) -> Cluster:
    """The cluster the launched world forms when the user gives none: nodes x ranks-per-node.

    One node is ``local:N`` (this host's CPU ranks or visible GPUs, calibrated over the process group
    when ``collective``, which every rank must then call alike). Several nodes of GPUs of a known
    kind: its compact preset; several nodes of CPU ranks: ``local:<ranks per node>`` nodes joined by
    10 Gb Ethernet (assumed).
    """
    if topology.num_nodes == 1:
        return parse_cluster(f"local:{topology.world_size}", collective=collective)
    per_node = topology.ranks_per_node
    if per_node is None:
        raise PipelineSetupError(f"nodes run different numbers of ranks {[len(r) for r in topology.nodes]}; "
                                 "pass cluster= (a spec or Cluster) describing the devices fxpipe should plan for")
    if device.type == "cuda":
        kind = _gpu_kind(device)
        if kind is None:
            raise PipelineSetupError(f"no cluster preset for GPU {torch.cuda.get_device_name(device)!r}; pass "
                                     f"cluster= (e.g. '{topology.num_nodes}x{per_node}:a100,memory=24GB' or a "
                                     "cluster JSON file)")
        return compact_cluster(topology.num_nodes, per_node, kind)
    node = parse_cluster(f"local:{per_node}", collective=collective)
    return replace(node, name=f"{topology.num_nodes}x{per_node}:local", num_hosts=topology.num_nodes,
                   inter_host=ETHERNET_10G_P2P, inter_host_collective=ETHERNET_10G_COLLECTIVE,
                   description=f"{node.description}; nodes joined by 10 Gb Ethernet (assumed)")


def device_ranks(topology: Topology, cluster: Cluster) -> tuple[int, ...] | None:
    """The rank that plays each cluster device (device d = slot ``d % per_host`` of host ``d // per_host``),
    or None when the cluster's hosts x devices do not match the nodes x ranks launched."""
    if (cluster.num_hosts, cluster.devices_per_host) != (topology.num_nodes, topology.ranks_per_node):
        return None
    return tuple(rank for ranks in topology.nodes for rank in ranks)


def plan_on_ranks(plan: Plan, ranks: Sequence[int]) -> Plan:
    """``plan`` with every device ``d`` replaced by the rank that plays it, ``ranks[d]`` (replica order kept)."""
    stages = tuple(replace(stage, devices=tuple(ranks[d] for d in stage.devices)) for stage in plan.stages)
    return plan.with_updates(stages=stages)


def check_cluster_size(cluster: Cluster, topology: Topology) -> None:
    """Every launched rank plays one cluster device, so the two counts must agree."""
    if cluster.num_devices != topology.world_size:
        raise PipelineSetupError(f"cluster {cluster.name!r} has {cluster.num_devices} devices but the process group "
                                 f"has {topology.world_size} ranks; pass a cluster of {topology.world_size} devices "
                                 "or none (fxpipe then describes the launched nodes itself)")


def placed_plan(plan: Plan, topology: Topology, cluster: Cluster) -> Plan:
    """A planner's plan on the launched ranks: devices mapped onto the ranks of the nodes the planner
    chose (identity when there is one node or ranks are already host-major), with a note otherwise."""
    check_cluster_size(cluster, topology)
    ranks = device_ranks(topology, cluster)
    if ranks is None:
        shape = f"{topology.num_nodes} nodes x {topology.ranks_per_node or 'uneven'} ranks"
        note = (f"cluster {cluster.name!r} ({cluster.num_hosts} hosts x {cluster.devices_per_host} devices) does "
                f"not match the launch ({shape}); plan devices are ranks in order, not placed by node")
        return plan.with_updates(notes=(*plan.notes, note))
    placed = plan_on_ranks(plan, ranks)
    if ranks == tuple(range(len(ranks))):
        return placed
    return placed.with_updates(notes=(*plan.notes, f"devices 0..{len(ranks) - 1} run on ranks {list(ranks)} "
                                                    "(the ranks of each planned host's node)"))

