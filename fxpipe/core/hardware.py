"""Hardware figures: device and link specs, datasheet presets, and what this machine offers (CPU ranks)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or CPU rank): what it computes, holds and moves per second.

    ``peak_flops`` is a tuple of ``(dtype name, FLOP/s)`` pairs (a tuple keeps the spec hashable
    and its JSON deterministic): the datasheet peak, what MFU is measured against; ``kernel_launch_s`` is
    the fixed cost of one kernel/op. ``matmul_flops``: what dense matmuls achieve per dtype (published GEMM
    measurements on the GPU presets; :func:`fxpipe.core.precision.matmul_flops_per_s` costs matmuls at it);
    a dtype it lacks runs matmuls at the peak (CPU ranks: the peak is itself a measured matmul rate).
    ``default_rates``: the rates are conservative defaults, guessed below what the device does (an uncalibrated CPU
    rank, :func:`cpu_device`), not a datasheet or measured peak: plans are costed at them, but no MFU is measured
    against them (:func:`fxpipe.core.utilization.peak_flops_per_device` gives 0).
    """

    name: str
    memory_bytes: int
    peak_flops: tuple[tuple[str, float], ...]
    memory_bandwidth_bytes_per_s: float
    kernel_launch_s: float = 5e-6
    matmul_flops: tuple[tuple[str, float], ...] = ()
    default_rates: bool = False

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

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0 or self.latency_s < 0:
            raise ValueError(
                f"a link needs a positive bandwidth and a non-negative latency; got "
                f"{self.bandwidth_bytes_per_s} B/s and {self.latency_s} s"
            )

    def transfer_time(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


# ---------------------------------------------------------------------------------------------
# Device presets: NVIDIA datasheet dense (no sparsity) peak figures. float32 is the non-tensor-core
# FP32 rate; bfloat16/float16 are tensor-core rates. Memory is the nominal capacity in GiB (what
# nvidia-smi reports, within ~2%). Kernel launch ~5 us is the usual CUDA launch overhead.
#
# Achievable dense matmul rates (DeviceSpec.matmul_flops; docs/clusters.md, "Calibrated matmul rates"): no
# GEMM reaches the datasheet peak. H100 SXM / H200 (the same compute): this project's own H200 measurement,
# benchmarks/gpu_check.md (benchmarks/gemm_efficiency.py, torch 2.11.0+cu130, 2026-12-04): the median over the
# three training GEMMs (forward, input and weight gradient) of a transformer layer's four linears at hidden
# 4096 and 8192 over 4096-16384 tokens, 72 GEMMs per dtype: BF16 700.5 TFLOP/s (70.8% of 989.5; best shape
# 786, close to the 794.5 best-of-a-shape-search of S. Bekman's MAMF table), FP32 51.3 (76.6% of 67; TF32 off).
# FP16 takes the BF16 figure (same tensor-core rate). A100 SXM BF16: the MAMF table of S. Bekman's Machine
# Learning Engineering open book (github.com/stas00/ml-engineering, compute/accelerator/README.md; torch matmul,
# best of a brute-force shape search, mean of 100 runs), 271.2 TFLOP/s (86.9% of 312), a best shape's figure.
# V100 and H100 PCIe: no published figure found, so their matmuls stay at the peak (calibration measures them).
H100_MATMUL_FLOPS = (("bfloat16", 700.5e12), ("float16", 700.5e12), ("float32", 51.3e12))
A100_MATMUL_FLOPS = (("bfloat16", 271.2e12), ("float16", 271.2e12))

# Tesla V100 SXM2 datasheet: FP32 15.7 TFLOPS, tensor (FP16) 125 TFLOPS, HBM2 16 GB at 900 GB/s.
# Volta has no bfloat16 hardware, so the preset gives no bfloat16 rate (flops_per_s raises).
V100_16GB = DeviceSpec(
    name="V100-16GB",
    memory_bytes=16 * GiB,
    peak_flops=(("float16", 125e12), ("float32", 15.7e12)),
    memory_bandwidth_bytes_per_s=900e9,
)
# A100 SXM4 80GB datasheet: FP32 19.5 TFLOPS, BF16/FP16 tensor 312 TFLOPS dense, 2,039 GB/s.
A100_80GB = DeviceSpec(
    name="A100-80GB",
    memory_bytes=80 * GiB,
    peak_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)),
    memory_bandwidth_bytes_per_s=2039e9,
    matmul_flops=A100_MATMUL_FLOPS,
)
# H100 SXM5 datasheet: FP32 67 TFLOPS, BF16/FP16 tensor 1,979 TFLOPS with sparsity = 989.5 dense,
# HBM3 80 GB at 3.35 TB/s.
H100_80GB = DeviceSpec(
    name="H100-80GB",
    memory_bytes=80 * GiB,
    peak_flops=(("bfloat16", 989.5e12), ("float16", 989.5e12), ("float32", 67e12)),
    memory_bandwidth_bytes_per_s=3.35e12,
    matmul_flops=H100_MATMUL_FLOPS,
)
# H200 SXM datasheet: same compute as H100 SXM (FP32 67, BF16/FP16 989.5 dense TFLOPS),
# HBM3e 141 GB at 4.8 TB/s.
H200_141GB = DeviceSpec(
    name="H200-141GB",
    memory_bytes=141 * GiB,
    peak_flops=(("bfloat16", 989.5e12), ("float16", 989.5e12), ("float32", 67e12)),
    memory_bandwidth_bytes_per_s=4.8e12,
    matmul_flops=H100_MATMUL_FLOPS,
)

# H100 PCIe datasheet: FP32 51 TFLOPS, BF16/FP16 tensor 1,513 TFLOPS with sparsity = 756.5 dense,
# HBM2e 80 GB at 2.0 TB/s (the PCIe card runs at a lower clock and power than the SXM part).
H100_PCIE_80GB = DeviceSpec(
    name="H100-PCIe-80GB",
    memory_bytes=80 * GiB,
    peak_flops=(("bfloat16", 756.5e12), ("float16", 756.5e12), ("float32", 51e12)),
    memory_bandwidth_bytes_per_s=2.0e12,
)
# An unknown GPU when nothing measured it: well below any data-centre GPU of the last years, so a plan
# made from it does not promise too much (calibration measures the real rates).
GPU_DEFAULT_FIGURES = {"float32": 5e12, "bfloat16": 20e12, "float16": 20e12, "memory_bandwidth": 300e9,
                       "kernel_launch": 10e-6}


# Split backward's cost beyond one fused backward on uncalibrated CPU ranks (Cluster.split_backward_overhead):
# the runtime's B + W of a 2-block transformer-like stage over 256 rows of width 128, one thread, measured
# 0.25x here (gpt-mini stages: 0.29x at 4 x 64 tokens, 0.45x at 2 x 64); calibration measures this machine's.
CPU_SPLIT_BACKWARD_OVERHEAD = 0.3
# What a gradient allreduce overlapped with compute costs (Cluster.overlap_compute_slowdown, overlap_comm_slowdown),
# fractions of extra time. Uncalibrated CPU ranks: 2 gloo ranks on this project's 2-core VM measured compute
# 0-0.44 and allreduce 2.4-3.6 (fxpipe.runtime.calibration.calibrate_overlap; gloo's threads and the compute share cores).
# GPU presets: an estimate from Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated
# Distributed Deep Learning" (arXiv 2507.03114, 2025): compute overlapped with NCCL collectives ran 18.9%
# slower on average (up to 40%) on A100/H100/MI250/MI210; the collective's own slowdown is not reported there:
# 10% is our estimate (NCCL's kernels get fewer SMs and less memory bandwidth). See docs/clusters.md.
CPU_OVERLAP_SLOWDOWNS = (0.4, 2.5)
GPU_OVERLAP_SLOWDOWNS = (0.19, 0.1)
# The runtime's own time per forward or backward action (Cluster.action_overhead_s) on a cluster that has no
# figure for it, used only to judge whether fixed costs could dominate a prediction (then the plan's notes call
# it a lower bound: fxpipe.sim.fixed_costs), never added to it: one thread of this project's CPU VM measured
# 56-70 us of CPU work per action (fxpipe.runtime.calibration.calibrate_fixed, three runs). The driver's Python runs on
# the host whatever the device, so GPU presets are judged with it too.
REFERENCE_ACTION_OVERHEAD_S = 60e-6


def measured_device(name: str, memory_bytes: int, figures: dict[str, float], *,
                    default_rates: bool = False) -> DeviceSpec:
    """A DeviceSpec from measured (or default) ``figures``: the keys of ``GPU_DEFAULT_FIGURES``;
    ``default_rates``: they are conservative defaults, not measured (no MFU against them)."""
    return DeviceSpec(
        name=name,
        memory_bytes=int(memory_bytes),
        peak_flops=tuple(sorted((d, float(figures[d])) for d in ("bfloat16", "float16", "float32"))),
        memory_bandwidth_bytes_per_s=float(figures["memory_bandwidth"]),
        kernel_launch_s=float(figures["kernel_launch"]),
        default_rates=default_rates,
    )


def cpu_device(memory_bytes: int, *, calibrated: dict[str, float] | None = None) -> DeviceSpec:
    """One CPU rank (one thread). Without ``calibrated`` figures: conservative defaults (``default_rates``: no MFU
    is measured against them; they sat 10x below this machine's float32 matmul rate, and `fxpipe demo` showed
    MFU 274% against them).

    The defaults sit at or below what one thread measured here (``fxpipe.runtime.calibration.calibrate``
    on a shared 2-core x86 VM with torch 2.13: 15-41 GFLOP/s float32 matmul, 0.4-1.4 GFLOP/s
    bfloat16/float16 matmul without AMX, 2-5 GB/s copy, 12-15 us per tiny eager op), so plans
    made without calibration do not promise too much.
    """
    figures = {"float32": 10e9, "bfloat16": 0.3e9, "float16": 0.3e9,
               "memory_bandwidth": 2e9, "kernel_launch": 20e-6}
    figures.update(calibrated or {})
    return measured_device("CPU" if calibrated is None else "CPU(calibrated)", memory_bytes, figures,
                           default_rates=calibrated is None)


def host_memory_bytes() -> int:
    """Physical memory of this machine, from the OS (0 when the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


# ---------------------------------------------------------------------------------------------
# Link figures. 25 Gbps Ethernet is 3.125 GB/s nominal; the DAPPLE authors' planner used the
# effective 1 GB/s point-to-point and 3 GB/s for NCCL collectives across servers, and 25 GB/s
# for NVLink point-to-point inside a V100 server (REFERENCE.md 1.1). 10 Gbps Ethernet scales the
# effective figures by 10/25. The paper's planner has no latency term, so these links have none.
NVLINK_V100 = LinkSpec(25e9)
ETHERNET_25G_NOMINAL = LinkSpec(25e9 / 8)
ETHERNET_25G_P2P = LinkSpec(1e9)
ETHERNET_25G_COLLECTIVE = LinkSpec(3e9)
ETHERNET_10G_P2P = LinkSpec(1e9 * 10 / 25)
ETHERNET_10G_COLLECTIVE = LinkSpec(3e9 * 10 / 25)
# DGX A100: NVLink3 600 GB/s per GPU (300 GB/s each way), one 200 Gb/s HDR InfiniBand NIC per GPU.
# DGX H100/H200: NVLink4 900 GB/s per GPU (450 GB/s each way), one 400 Gb/s NDR NIC per GPU.
# Latencies are order-of-magnitude NCCL small-message figures (a few us on NVLink, ~10 us on IB).
NVLINK_A100 = LinkSpec(300e9, 5e-6)
NVLINK_H100 = LinkSpec(450e9, 5e-6)
IB_HDR_200G = LinkSpec(200e9 / 8, 10e-6)
IB_NDR_400G = LinkSpec(400e9 / 8, 10e-6)
# Loopback gloo between CPU ranks without calibration: conservative (measured here: 0.45-2.2 GB/s,
# 115-140 us one-way for 8 bytes).
LOCAL_LINK_DEFAULT = LinkSpec(0.4e9, 200e-6)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else max(1, os.cpu_count() or 1)


# Effective GPU-to-GPU copies over PCIe 4.0 x16 (32 GB/s nominal each way): GPUs without NVLink.
PCIE_GPU_P2P = LinkSpec(20e9, 10e-6)
# GPU model names as torch.cuda.get_device_properties reports them ("NVIDIA H100 80GB HBM3",
# "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-40GB", "Tesla V100-SXM2-32GB", "NVIDIA H200"): first match wins.
# SXM parts sit on NVLink boards; PCIe cards talk over PCIe unless bridged (calibration measures that).
_GPU_MODELS: tuple[tuple[str, DeviceSpec, LinkSpec], ...] = (
    (r"h200", H200_141GB, NVLINK_H100),
    (r"h100.*pcie", H100_PCIE_80GB, PCIE_GPU_P2P),
    (r"h100", H100_80GB, NVLINK_H100),
    (r"a100.*pcie", A100_80GB, PCIE_GPU_P2P),
    (r"a100", A100_80GB, NVLINK_A100),
    (r"v100.*pcie", V100_16GB, PCIE_GPU_P2P),
    (r"v100", V100_16GB, NVLINK_V100),
)


def gpu_preset(name: str, total_memory_bytes: int) -> tuple[DeviceSpec, LinkSpec] | None:
    """The datasheet DeviceSpec and GPU-to-GPU link of a known GPU model, or None for an unknown one.

    ``name`` and ``total_memory_bytes`` are what ``torch.cuda.get_device_properties`` reports; the
    spec keeps the datasheet rates but takes the device's own name and memory (a 40 GB A100, a 32 GB V100).
    """
    for pattern, spec, link in _GPU_MODELS:
        if re.search(pattern, name.lower()):
            return replace(spec, name=name, memory_bytes=int(total_memory_bytes)), link
    return None


@dataclass(frozen=True)
class Calibration:
    """Measured (or cached) figures; ``None`` where nothing was measured and defaults apply.

    ``device``: keys of ``DEVICE_KEYS``; ``links``: keys of ``LINK_KEYS`` (fxpipe.runtime.calibration.calibrate_measure
    measures them); ``source`` says where each came from, for the cluster's description.
    """

    device: dict[str, float] | None
    links: dict[str, float] | None
    source: str
