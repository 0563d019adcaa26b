"""Cluster model: hosts x devices, device specs, links between devices, and collective costs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU rank): what it computes, holds and moves per second.

    ``peak_flops`` is a tuple of ``(dtype name, FLOP/s)`` pairs (a tuple keeps the spec hashable
    and its JSON deterministic); ``kernel_launch_s`` is the fixed cost of one kernel/op.
    """

    name: str
    memory_bytes: int
    peak_flops: tuple[tuple[str, float], ...]
    memory_bandwidth_bytes_per_s: float
    kernel_launch_s: float = 5e-6

    def flops_per_s(self, dtype: str = "float32") -> float:
        table = dict(self.peak_flops)
        if dtype not in table:
            raise ValueError(
                f"device {self.name!r} has no peak FLOP/s for dtype {dtype!r}; known: {sorted(table)}"
            )
        return table[dtype]


@dataclass(frozen=True)
class LinkSpec:
    """A point-to-point link: time(bytes) = latency_s + bytes / bandwidth_bytes_per_s."""

    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def transfer_time(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Cluster:
    """``num_hosts`` hosts with ``devices_per_host`` identical devices each.

    Devices are numbered host-major: device d lives on host ``d // devices_per_host``.
    ``inter_host_collective`` is the bandwidth NCCL-style collectives reach across hosts (the
    DAPPLE authors measured 3 GB/s against 1 GB/s point-to-point); it defaults to the
    point-to-point inter-host link.
    """

    name: str
    num_hosts: int
    devices_per_host: int
    device: DeviceSpec
    intra_host: LinkSpec
    inter_host: LinkSpec
    inter_host_collective: LinkSpec | None = None

    def __post_init__(self) -> None:
        if self.num_hosts < 1 or self.devices_per_host < 1:
            raise ValueError(
                f"cluster {self.name!r} needs at least 1 host and 1 device per host; "
                f"got {self.num_hosts} hosts x {self.devices_per_host} devices"
            )

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def host_of(self, device: int) -> int:
        if not 0 <= device < self.num_devices:
            raise ValueError(f"device {device} is not in cluster {self.name!r} (0..{self.num_devices - 1})")
        return device // self.devices_per_host

    def link(self, src: int, dst: int) -> LinkSpec:
        """The point-to-point link between two devices (intra-host when they share a host)."""
        return self.intra_host if self.host_of(src) == self.host_of(dst) else self.inter_host

    def collective_link(self, devices: Sequence[int]) -> LinkSpec:
        """The slowest link a ring collective over ``devices`` crosses."""
        if len({self.host_of(d) for d in devices}) <= 1:
            return self.intra_host
        return self.inter_host_collective or self.inter_host

    def allreduce_time(self, num_bytes: float, devices: Sequence[int]) -> float:
        """Ring allreduce: 2 W (R-1) / (R * bandwidth) plus 2 (R-1) link latencies."""
        replicas = len(devices)
        if replicas <= 1 or num_bytes <= 0:
            return 0.0
        link = self.collective_link(devices)
        steps = 2 * (replicas - 1)
        return steps * link.latency_s + 2 * num_bytes * (replicas - 1) / (replicas * link.bandwidth_bytes_per_s)
