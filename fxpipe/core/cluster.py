"""Cluster model: hosts x devices, links between them, collective costs, presets and the spec parser.

Device and link specs and their datasheet figures live in :mod:`fxpipe.core.hardware`."""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fxpipe.core.cluster_spec import (
    COUNT_DIGITS,
    ClusterSpecError,
    base_suggestion,
    calibrated_link_fields,
    cluster_fields_from_json,
    did_you_mean,
    existing_file,
    json_field,
    measured_links,
    quantity,
    sharding_links,
    spec_error,
)
from fxpipe.core.fsdp_calls import FsdpCallCost
from fxpipe.core.hardware import (
    A100_80GB,
    CPU_OVERLAP_SLOWDOWNS,
    CPU_SPLIT_BACKWARD_OVERHEAD,
    ETHERNET_10G_COLLECTIVE,
    ETHERNET_10G_P2P,
    ETHERNET_25G_COLLECTIVE,
    ETHERNET_25G_P2P,
    GPU_DEFAULT_FIGURES,
    GPU_OVERLAP_SLOWDOWNS,
    H100_80GB,
    H200_141GB,
    IB_HDR_200G,
    IB_NDR_400G,
    LOCAL_LINK_DEFAULT,
    NVLINK_A100,
    NVLINK_H100,
    NVLINK_V100,
    PCIE_GPU_P2P,
    V100_16GB,
    Calibration,
    DeviceSpec,
    GiB,
    LinkSpec,
    cpu_device,
    gpu_preset,
    host_memory_bytes,
    measured_device,
    usable_cores,
)
from fxpipe.core.local_probe import calibration_enabled, local_probe

# ClusterSpecError and the hardware names are re-exported: callers import them from fxpipe.core.cluster.
__all__ = ["A100_80GB", "CLUSTER_FORMAT_VERSION", "H100_80GB", "H200_141GB", "V100_16GB", "Cluster",
           "ClusterSpecError", "DeviceSpec", "GiB", "LinkSpec", "compact_cluster",
           "cpu_device", "dapple_cluster", "dgx_h100_cluster", "host_memory_bytes", "local_cluster",
           "parse_cluster", "usable_cores"]

CLUSTER_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Cluster:
    """``num_hosts`` hosts with ``devices_per_host`` identical devices each.

    Devices are numbered host-major: device d lives on host ``d // devices_per_host``.
    ``inter_host_collective`` is the bandwidth NCCL-style collectives reach across hosts (the
    DAPPLE authors measured 3 GB/s against 1 GB/s point-to-point); it defaults to the
    point-to-point inter-host link; ``intra_host_collective`` likewise within a host (local CPU ranks:
    gloo's allreduce reached 45-60% of its send/recv bandwidth here, with its own copies and sums), by
    default the intra-host link. ``description`` records where the figures come from.

    ``cores_per_host`` is for CPU ranks that share their host's cores (0: every device computes on
    hardware of its own). When a host runs more ranks than it has cores, each rank computes at
    ``cores / ranks`` of its one-rank speed (:attr:`compute_slowdown`), a fair share: on a 2-core VM
    four one-thread processes each ran a gpt-mini forward+backward 2.2x slower than one alone.

    ``message_overhead_s`` is the device's own time per message at each end: packing and posting a
    send, posting a receive and taking its data, in the rank's process (stretched like compute when
    ranks share cores). 0 where a copy engine does the work (GPUs); gloo on this project's CPU VM
    took 0.3-0.9 ms per message after a stretch of compute.

    ``split_backward_overhead`` is what the runtime's split backward (zero-bubble schedules: B, then W)
    costs beyond one fused backward, as a fraction of it (:func:`fxpipe.sim.stagecost.split_backward_times`):
    on CPU ranks its extra autograd calls (one W pass per parameter group) and graph walks in Python
    took 0.2-0.5x the backward here; calibration measures it, presets (GPUs) have none measured: 0.

    ``overlap_compute_slowdown`` and ``overlap_comm_slowdown`` are what a gradient allreduce overlapped
    with compute costs, as fractions: compute beside an allreduce in flight takes ``1 + compute`` times as
    long, the allreduce ``1 + comm`` times (:mod:`fxpipe.sim.allreduce_overlap`). Calibration measures
    them on CPU ranks (gloo's threads take cores); GPU presets carry a published estimate (docs/clusters.md).

    ``reduce_scatter_collective``, ``all_gather_collective``: a sharded stage's collectives in a host, one ring
    pass (gloo's reduce-scatter: 1.3-1.6x its allreduce); None: half the allreduce (:mod:`fxpipe.sim.sharding_cost`).
    ``tensor_parallel_collective``: a tensor-parallel group's, posted between compute (calibrated on CPU ranks).

    ``optimizer_s_per_param_byte`` is the time of one optimizer step per byte of parameters a device
    holds, at one-rank speed (stretched like compute): measured by ``fxpipe.compile`` with its block
    costs (an AdamW step); 0 leaves the optimizer step out of the iteration (presets, analytic costs).

    ``action_overhead_s``, ``step_overhead_s``: the runtime's own time per forward or backward action beyond its
    blocks and per step beyond its actions and collectives, at one-rank speed (stretched like compute); measured
    on CPU ranks (:mod:`fxpipe.runtime.calibration.calibrate_fixed`); 0 elsewhere (:mod:`fxpipe.sim.fixed_costs`).
    """

    name: str
    num_hosts: int
    devices_per_host: int
    device: DeviceSpec
    intra_host: LinkSpec
    inter_host: LinkSpec
    inter_host_collective: LinkSpec | None = None
    description: str = ""
    cores_per_host: int = 0
    intra_host_collective: LinkSpec | None = None
    message_overhead_s: float = 0.0
    split_backward_overhead: float = 0.0
    optimizer_s_per_param_byte: float = 0.0
    overlap_compute_slowdown: float = 0.0
    overlap_comm_slowdown: float = 0.0
    reduce_scatter_collective: LinkSpec | None = None
    all_gather_collective: LinkSpec | None = None
    action_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    tensor_parallel_collective: LinkSpec | None = None  # collectives between compute in lock-step: tensor_parallel_cost
    fsdp_call_overhead_s: float = 0.0  # FSDP2's host time per collective beyond the collective: sharding_cost
    fsdp_calls: FsdpCallCost | None = None  # the same per kind and by the unit's bytes, fitted (wins over the flat)

    def __post_init__(self) -> None:
        if self.num_hosts < 1 or self.devices_per_host < 1:
            raise ValueError(f"cluster {self.name!r} needs at least 1 host and 1 device per host; "
                             f"got {self.num_hosts} hosts x {self.devices_per_host} devices")
        if self.cores_per_host < 0:
            raise ValueError(f"cluster {self.name!r}: cores_per_host must be >= 0 (0: devices do not share "
                             f"cores); got {self.cores_per_host}")
        if not self.message_overhead_s >= 0:
            raise ValueError(f"cluster {self.name!r}: message_overhead_s must be >= 0 seconds; "
                             f"got {self.message_overhead_s}")
        if not self.split_backward_overhead >= 0:
            raise ValueError(f"cluster {self.name!r}: split_backward_overhead must be >= 0 (a fraction of the "
                             f"fused backward); got {self.split_backward_overhead}")
        for field_name in ("overlap_compute_slowdown", "overlap_comm_slowdown"):
            if not getattr(self, field_name) >= 0:
                raise ValueError(f"cluster {self.name!r}: {field_name} must be >= 0 (a fraction: the extra "
                                 f"time while overlapped); got {getattr(self, field_name)}")
        for field_name in ("action_overhead_s", "step_overhead_s", "optimizer_s_per_param_byte", "fsdp_call_overhead_s"):
            if not getattr(self, field_name) >= 0:
                raise ValueError(f"cluster {self.name!r}: {field_name} must be >= 0; got {getattr(self, field_name)}")

    @property
    def compute_slowdown(self) -> float:
        """How much longer compute takes on each device because the host's ranks share too few cores (>= 1)."""
        if self.cores_per_host <= 0 or self.devices_per_host <= self.cores_per_host:
            return 1.0
        return self.devices_per_host / self.cores_per_host

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

    def collective_link(self, devices: Sequence[int], kind: str = "allreduce") -> LinkSpec:
        """The slowest link a ring collective over ``devices`` crosses; ``kind`` ``"reduce_scatter"`` or
        ``"all_gather"``: that collective's own figures within a host where measured, else the allreduce's."""
        if len({self.host_of(d) for d in devices}) <= 1:
            own = {"reduce_scatter": self.reduce_scatter_collective, "all_gather": self.all_gather_collective}
            return own.get(kind) or self.intra_host_collective or self.intra_host
        return self.inter_host_collective or self.inter_host

    def allreduce_time(self, num_bytes: float, devices: Sequence[int], link: LinkSpec | None = None) -> float:
        """Ring allreduce: 2 W (R-1) / (R * bandwidth) plus 2 (R-1) link latencies (``link``: the
        :meth:`collective_link` of ``devices`` when the caller already has it, for many sizes)."""
        replicas = len(devices)
        if replicas <= 1 or num_bytes <= 0:
            return 0.0
        link = link or self.collective_link(devices)
        steps = 2 * (replicas - 1)
        return steps * link.latency_s + 2 * num_bytes * (replicas - 1) / (replicas * link.bandwidth_bytes_per_s)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; :meth:`from_json` reads it back to an equal Cluster."""
        data = {key: value for key, value in asdict(self).items() if key != "fsdp_calls" or value is not None}
        data["device"]["peak_flops"] = {dtype: flops for dtype, flops in self.device.peak_flops}
        if self.device.matmul_flops:  # absent = matmuls at the peak: files written before keep their bytes
            data["device"]["matmul_flops"] = {dtype: flops for dtype, flops in self.device.matmul_flops}
        else:
            del data["device"]["matmul_flops"]
        if not self.device.default_rates:  # written only when set: files written before keep their bytes
            del data["device"]["default_rates"]
        return {"format_version": CLUSTER_FORMAT_VERSION, **data}

    @staticmethod
    def from_json(data: Any) -> Cluster:
        return _cluster_from_json(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @staticmethod
    def load(path: str | Path) -> Cluster:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ClusterSpecError(f"cannot read cluster file {str(path)!r} as text: {error}") from error
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as error:  # JSONDecodeError, an int of too many digits, deep nesting
            raise ClusterSpecError(f"cluster file {str(path)!r} is not valid JSON: {error}") from error
        return _cluster_from_json(data)


def _cluster_from_json(data: Any) -> Cluster:
    """A Cluster from :meth:`Cluster.to_json` output; every field is checked (ClusterSpecError names it)."""
    version = json_field(data, "format_version", int)
    if version != CLUSTER_FORMAT_VERSION:
        raise ClusterSpecError(f"cluster JSON format_version {version} is unknown; expected {CLUSTER_FORMAT_VERSION}")
    return Cluster(**cluster_fields_from_json(data))


# Compact-spec devices: name -> (device, intra link, inter p2p link, inter collective link).
_DEVICE_KINDS: dict[str, tuple[DeviceSpec, LinkSpec, LinkSpec, LinkSpec | None]] = {
    "v100": (V100_16GB, NVLINK_V100, ETHERNET_25G_P2P, ETHERNET_25G_COLLECTIVE),
    "a100": (A100_80GB, NVLINK_A100, IB_HDR_200G, None),
    "h100": (H100_80GB, NVLINK_H100, IB_NDR_400G, None),
    "h200": (H200_141GB, NVLINK_H100, IB_NDR_400G, None),
}
_DEVICE_ALIASES = {"v100-16gb": "v100", "a100-80gb": "a100", "h100-80gb": "h100", "h200-141gb": "h200"}


def _cpu_cluster(name: str, num_hosts: int, ranks_per_host: int, device: DeviceSpec, link: LinkSpec,
                 description: str, cores_per_host: int = 0, collective: LinkSpec | None = None,
                 message_overhead_s: float = 0.0, split_backward_overhead: float = CPU_SPLIT_BACKWARD_OVERHEAD,
                 overlap: tuple[float, float] = CPU_OVERLAP_SLOWDOWNS,
                 sharding_links: tuple[LinkSpec | None, LinkSpec | None] = (None, None),
                 fixed_costs: tuple[float, float] = (0.0, 0.0)) -> Cluster:
    return Cluster(name, num_hosts, ranks_per_host, device, link, link, None, description, cores_per_host,
                   collective, message_overhead_s=message_overhead_s,
                   split_backward_overhead=split_backward_overhead, overlap_compute_slowdown=overlap[0],
                   overlap_comm_slowdown=overlap[1], reduce_scatter_collective=sharding_links[0],
                   all_gather_collective=sharding_links[1], action_overhead_s=fixed_costs[0],
                   step_overhead_s=fixed_costs[1])


def _gpu_overlap(cluster: Cluster) -> Cluster:
    """A GPU cluster with the published estimate of what overlap costs (hardware.GPU_OVERLAP_SLOWDOWNS)."""
    return replace(cluster, overlap_compute_slowdown=GPU_OVERLAP_SLOWDOWNS[0],
                   overlap_comm_slowdown=GPU_OVERLAP_SLOWDOWNS[1])


def dapple_cluster(config: str) -> Cluster:
    """The DAPPLE paper's configs A, B, C (REFERENCE.md 1.6) with the authors' planner figures."""
    key = config.upper()
    nominal = "nominal 25 Gbps = 3.125 GB/s" if key != "C" else "nominal 10 Gbps = 1.25 GB/s"
    if key == "A":
        return _gpu_overlap(Cluster("dapple-a", 2, 8, V100_16GB, NVLINK_V100, ETHERNET_25G_P2P, ETHERNET_25G_COLLECTIVE,
                       f"2 servers x 8 V100; NVLink 25 GB/s p2p; Ethernet {nominal}, effective "
                       "1 GB/s p2p and 3 GB/s collectives (DAPPLE planner)"))
    if key in ("B", "C"):
        p2p, coll = (ETHERNET_25G_P2P, ETHERNET_25G_COLLECTIVE) if key == "B" else (
            ETHERNET_10G_P2P, ETHERNET_10G_COLLECTIVE)
        return _gpu_overlap(Cluster(f"dapple-{key.lower()}", 16, 1, V100_16GB, NVLINK_V100, p2p, coll,
                       f"16 servers x 1 V100; Ethernet {nominal}, effective "
                       f"{p2p.bandwidth_bytes_per_s / 1e9:g} GB/s p2p and "
                       f"{coll.bandwidth_bytes_per_s / 1e9:g} GB/s collectives"))
    raise ClusterSpecError(f"DAPPLE config {config!r} is unknown; choose A, B or C")


def compact_cluster(num_hosts: int, devices_per_host: int, kind: str, name: str = "") -> Cluster:
    """``num_hosts x devices_per_host`` devices of ``kind`` (v100, a100, h100, h200, cpu) with its default links."""
    key = _DEVICE_ALIASES.get(kind.lower(), kind.lower())
    name = name or f"{num_hosts}x{devices_per_host}:{key}"
    if key == "cpu":
        memory = host_memory_bytes() // devices_per_host
        return _cpu_cluster(name, num_hosts, devices_per_host, cpu_device(memory), LOCAL_LINK_DEFAULT,
                            "CPU ranks with conservative default figures")
    if key not in _DEVICE_KINDS:
        raise ClusterSpecError(f"device kind {kind!r} is unknown; choose one of {sorted([*_DEVICE_KINDS, 'cpu'])}"
                               + did_you_mean(kind, [*_DEVICE_KINDS, *_DEVICE_ALIASES, "cpu"]))
    device, intra, inter, collective = _DEVICE_KINDS[key]
    return _gpu_overlap(Cluster(name, num_hosts, devices_per_host, device, intra, inter, collective,
                                f"{num_hosts} hosts x {devices_per_host} {device.name}"))


def local_cluster(num_ranks: int | None = None, *, calibrate: bool | None = None, refresh: bool = False,
                  collective: bool = False) -> Cluster:
    """This machine's ranks, 1 host x ``num_ranks`` (default: all visible GPUs, else CPUs up to 8); see docs/clusters.md.

    Calibrated unless ``calibrate=False`` or ``FXPIPE_CALIBRATE=0`` (:mod:`fxpipe.runtime.calibration.calibrate`,
    cached). ``collective=True``: every rank of the process group makes this call (``fxpipe.compile``
    does), so the ranks measure together, agree, and the group's device decides CPU or GPU. Otherwise
    only this process's device is measured; links come from the cache or defaults. Never starts a process.
    """
    probe = local_probe()
    if probe is None:
        raise ClusterSpecError("the 'local' cluster is this machine as measured by fxpipe.runtime.calibration.calibrate, "
                               "which is not loaded; `import fxpipe.runtime.calibration.calibrate` first (fxpipe's CLI, "
                               "fxpipe.plan and fxpipe.compile do)")
    machine = probe(measure=calibration_enabled(calibrate), collective=collective, refresh=refresh)
    default_ranks = machine.gpu[2] if machine.gpu is not None else max(1, min(os.cpu_count() or 1, 8))
    ranks = num_ranks if num_ranks is not None else default_ranks
    if ranks < 1:
        raise ClusterSpecError(f"local cluster needs at least 1 rank; got {ranks}")
    if machine.gpu is not None:
        return _local_gpu_cluster(f"local:{ranks}", ranks, machine.gpu[0], machine.gpu[1], machine.measured)
    return _local_cpu_cluster(f"local:{ranks}", ranks, machine.measured, collective)


def _local_cpu_cluster(name: str, ranks: int, measured: Calibration | None, collective: bool) -> Cluster:
    memory = host_memory_bytes() // ranks
    if measured is None:
        return _cpu_cluster(name, 1, ranks, cpu_device(memory), LOCAL_LINK_DEFAULT,
                            "local CPU ranks, uncalibrated conservative defaults", usable_cores())
    links = measured_links(measured)
    if links is None and ranks > 1:
        how = ("the process group has one rank" if collective else "measuring links needs the ranks themselves: "
               "run under torchrun (fxpipe.compile measures over the process group) or run `fxpipe calibrate`")
        default = (f"{LOCAL_LINK_DEFAULT.bandwidth_bytes_per_s / 1e6:.0f} MB/s, {LOCAL_LINK_DEFAULT.latency_s * 1e3:g} ms "
                   "latency between ranks")
        warnings.warn(f"fxpipe: {name} plans with default link figures ({default}), not measured ones: {how}; see "
                      "docs/clusters.md", RuntimeWarning, stacklevel=3)
    link, collective_link, overhead = links or (LOCAL_LINK_DEFAULT, None, 0.0)
    split = (measured.device or {}).get("split_backward_overhead", CPU_SPLIT_BACKWARD_OVERHEAD)
    action, step = ((measured.device or {}).get(key, 0.0) for key in ("action_overhead", "step_overhead"))
    figures = measured.links or {}
    overlap = tuple(figures.get(f"overlap_{side}_slowdown", default)
                    for side, default in zip(("compute", "comm"), CPU_OVERLAP_SLOWDOWNS, strict=True))
    return replace(_cpu_cluster(name, 1, ranks, cpu_device(memory, calibrated=measured.device), link,
                                f"local CPU ranks, calibrated: {measured.source}", usable_cores(), collective_link,
                                overhead, split, (overlap[0], overlap[1]), sharding_links(figures), (action, step)),
                   **calibrated_link_fields(figures))


def _local_gpu_cluster(name: str, ranks: int, model: str, memory: int, measured: Calibration | None) -> Cluster:
    """Visible GPUs: a known model's datasheet preset (as ``4x8:h100``), else measured, else conservative defaults."""
    preset, split = gpu_preset(model, memory), 0.0  # split backward's overhead: 0 unless this GPU was measured
    if preset is not None:
        (device, link), source = preset, "datasheet preset"
    elif measured is not None and measured.device is not None:
        device, link, source = measured_device(model, memory, measured.device), PCIE_GPU_P2P, "measured"
        split = measured.device.get("split_backward_overhead", 0.0)
    else:
        warnings.warn(f"fxpipe: GPU model {model!r} has no preset and was not measured; planning with "
                      f"conservative default figures {GPU_DEFAULT_FIGURES}", RuntimeWarning, stacklevel=3)
        device = measured_device(model, memory, GPU_DEFAULT_FIGURES, default_rates=True)  # no MFU on guesses
        link, source = PCIE_GPU_P2P, "defaults"
    links = measured_links(measured)
    collective_link = None
    if links is not None and measured is not None:
        link, collective_link, _ = links  # copy engines move GPU messages: no per-message device time
        source += f"; links {measured.source}"
    return _gpu_overlap(Cluster(name, 1, ranks, device, link, link, None, f"local GPUs ({model}), {source}",
                                intra_host_collective=collective_link, split_backward_overhead=split))


def dgx_h100_cluster(num_nodes: int = 1) -> Cluster:
    """DGX H100 nodes: 8 H100 each, NVLink 450 GB/s each way, 400 Gb/s InfiniBand per GPU."""
    return compact_cluster(num_nodes, 8, "h100", name=f"dgx-h100:{num_nodes}")


def _parse_base(spec: str, base: str, calibrate: bool | None, collective: bool = False) -> Cluster:
    key = base.strip().lower()
    if key in ("dapple-a", "dapple-b", "dapple-c"):
        return dapple_cluster(key[-1])
    preset_count = re.fullmatch(rf"(dgx-h100|local)(?::([0-9]{{1,{COUNT_DIGITS}}}))?", key)
    if preset_count:
        count = int(preset_count.group(2)) if preset_count.group(2) else None
        if count == 0:
            raise spec_error(spec, base, "needs a count of at least 1")
        if preset_count.group(1) == "dgx-h100":
            return dgx_h100_cluster(count or 1)
        return local_cluster(count, calibrate=calibrate, collective=collective)
    compact = re.fullmatch(rf"([0-9]{{1,{COUNT_DIGITS}}})x([0-9]{{1,{COUNT_DIGITS}}}):([a-z0-9-]+)", key)
    if compact:
        hosts, devices = int(compact.group(1)), int(compact.group(2))
        if hosts < 1 or devices < 1:
            raise spec_error(spec, base, "needs at least 1 host and 1 device per host")
        try:
            return compact_cluster(hosts, devices, compact.group(3))
        except ClusterSpecError as error:
            raise spec_error(spec, base, str(error)) from None
    path = existing_file(base.strip())
    if path is not None:
        return Cluster.load(path)
    if key.endswith(".json"):
        raise spec_error(spec, base, "looks like a JSON file path but no such file exists")
    raise spec_error(spec, base, "is not a preset, a HOSTSxDEVICES:KIND spec or a JSON file "
                                 f"(counts have at most {COUNT_DIGITS} digits){base_suggestion(base)}")


def _apply_override(spec: str, cluster: Cluster, part: str) -> Cluster:
    key, sep, value = part.partition("=")
    key = key.strip().lower()
    if not sep or not value.strip():
        raise spec_error(spec, part, "is not KEY=VALUE")
    if key == "memory":
        memory = int(quantity(spec, part, value, "size"))
        return replace(cluster, device=replace(cluster.device, memory_bytes=memory))
    fields = {"intra": "intra_host", "inter": "inter_host", "collective": "inter_host_collective"}
    if key not in fields:
        raise spec_error(spec, part, f"has an unknown key {key!r}; keys: intra, inter, collective, memory"
                                     f"{did_you_mean(key, [*fields, 'memory'])}")
    bandwidth_text, _, latency_text = value.partition("@")
    current = getattr(cluster, fields[key]) or cluster.inter_host
    link = LinkSpec(
        quantity(spec, part, bandwidth_text, "bandwidth"),
        quantity(spec, part, latency_text, "latency") if latency_text else current.latency_s,
    )
    if key == "intra":  # a new intra link replaces the calibrated collective figure too (local:N)
        updated = replace(cluster, intra_host=link, intra_host_collective=None)
    elif key == "inter":
        updated = replace(cluster, inter_host=link)
    else:
        updated = replace(cluster, inter_host_collective=link)
    if key == "inter" and cluster.inter_host_collective is not None and "collective=" not in spec.lower():
        updated = replace(updated, inter_host_collective=None)  # a new inter link replaces the old effective pair
    return updated


def parse_cluster(spec: str, *, calibrate: bool | None = None, collective: bool = False) -> Cluster:
    """A Cluster from a preset name, a compact ``HOSTSxDEVICES:KIND`` spec or a JSON file, plus overrides.

    ``calibrate`` and ``collective`` only matter for ``local`` (see :func:`local_cluster`): False (or
    ``FXPIPE_CALIBRATE=0`` when it is None) skips the measurement and uses conservative defaults;
    ``collective=True`` when every rank of the process group makes this call, to measure together.
    Malformed specs raise :class:`ClusterSpecError` quoting the bad part and the grammar.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise spec_error(str(spec), str(spec), "is empty")
    base, *overrides = spec.split(",")
    cluster = _parse_base(spec, base, calibrate, collective)
    for part in overrides:
        cluster = _apply_override(spec, cluster, part)
    if overrides:
        cluster = replace(cluster, name=spec.strip())
    return cluster
