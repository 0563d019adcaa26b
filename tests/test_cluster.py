"""Cluster presets, spec parsing, JSON round trip, link and allreduce math, local calibration."""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fxpipe.core.cluster import (
    Cluster,
    ClusterSpecError,
    GiB,
    LinkSpec,
    cpu_device,
    host_memory_bytes,
    local_cluster,
    parse_cluster,
    usable_cores,
)
from fxpipe.core.fsdp_calls import FsdpCallCost
from fxpipe.core.hardware import (
    A100_80GB,
    CPU_SPLIT_BACKWARD_OVERHEAD,
    GPU_DEFAULT_FIGURES,
    H100_80GB,
    H100_PCIE_80GB,
    H200_141GB,
    LOCAL_LINK_DEFAULT,
    NVLINK_A100,
    NVLINK_H100,
    NVLINK_V100,
    PCIE_GPU_P2P,
    V100_16GB,
    DeviceSpec,
    gpu_preset,
    measured_device,
)
from fxpipe.runtime.calibration.calibrate import local_device as REAL_LOCAL_DEVICE

CPU = torch.device("cpu")


def test_dapple_a_matches_the_papers_planner_figures() -> None:
    cluster = parse_cluster("dapple-a")
    assert (cluster.num_hosts, cluster.devices_per_host, cluster.num_devices) == (2, 8, 16)
    assert cluster.intra_host.bandwidth_bytes_per_s == 25e9
    assert cluster.inter_host.bandwidth_bytes_per_s == 1e9
    assert cluster.inter_host_collective is not None
    assert cluster.inter_host_collective.bandwidth_bytes_per_s == 3e9
    assert cluster.device.name == "V100-16GB"
    assert cluster.device.memory_bytes == 16 * GiB
    assert cluster.device.flops_per_s("float32") == 15.7e12
    assert cluster.device.flops_per_s("float16") == 125e12
    assert "3.125 GB/s" in cluster.description  # the nominal 25 Gbps figure is documented too


def test_dapple_b_and_c_scale_ethernet_by_ten_over_twenty_five() -> None:
    b, c = parse_cluster("dapple-b"), parse_cluster("dapple-c")
    assert (b.num_hosts, b.devices_per_host) == (16, 1) == (c.num_hosts, c.devices_per_host)
    assert b.inter_host.bandwidth_bytes_per_s == 1e9
    assert c.inter_host.bandwidth_bytes_per_s == pytest.approx(0.4e9)
    assert b.inter_host_collective is not None and c.inter_host_collective is not None
    assert c.inter_host_collective.bandwidth_bytes_per_s == pytest.approx(1.2e9)


def test_dgx_h100_preset_and_device_datasheets() -> None:
    cluster = parse_cluster("dgx-h100:4")
    assert (cluster.num_hosts, cluster.devices_per_host) == (4, 8)
    assert cluster.intra_host.bandwidth_bytes_per_s == 450e9
    assert cluster.inter_host.bandwidth_bytes_per_s == 50e9  # 400 Gb/s per GPU
    assert cluster.device.flops_per_s("bfloat16") == 989.5e12
    assert parse_cluster("dgx-h100").num_devices == 8
    h200 = parse_cluster("1x8:h200").device
    assert (h200.memory_bytes, h200.memory_bandwidth_bytes_per_s) == (141 * GiB, 4.8e12)
    a100 = parse_cluster("1x8:a100-80gb").device
    assert (a100.memory_bytes, a100.flops_per_s("bfloat16")) == (80 * GiB, 312e12)
    with pytest.raises(ValueError, match="bfloat16"):
        parse_cluster("dapple-a").device.flops_per_s("bfloat16")  # Volta has no bf16 units


def test_compact_v100_spec_equals_dapple_a_links() -> None:
    compact, preset = parse_cluster("2x8:v100"), parse_cluster("dapple-a")
    for field in ("num_hosts", "devices_per_host", "device", "intra_host", "inter_host", "inter_host_collective"):
        assert getattr(compact, field) == getattr(preset, field), field


def test_link_overrides_and_units() -> None:
    cluster = parse_cluster("4x8:h100,intra=450GB/s,inter=50GB/s@5us")
    assert cluster.name == "4x8:h100,intra=450GB/s,inter=50GB/s@5us"
    assert cluster.intra_host == LinkSpec(450e9, 5e-6)  # latency kept from the preset
    assert cluster.inter_host == LinkSpec(50e9, 5e-6)
    assert parse_cluster("2x8:v100,inter=25Gbps").inter_host.bandwidth_bytes_per_s == 25e9 / 8
    assert parse_cluster("2x8:v100,inter=10Gb/s").inter_host.bandwidth_bytes_per_s == 10e9 / 8
    # A new inter link drops the old effective collective figure unless one is given too.
    assert parse_cluster("dapple-a,inter=2GB/s").inter_host_collective is None
    both = parse_cluster("dapple-a,collective=4GB/s@1ms,inter=2GB/s")
    assert both.inter_host_collective == LinkSpec(4e9, 1e-3)
    assert parse_cluster("1x4:cpu,memory=2GiB").device.memory_bytes == 2 * GiB


@pytest.mark.parametrize(
    ("spec", "bad_part"),
    [
        ("3x:h100", "3x:h100"),
        ("2x8:tpu", "2x8:tpu"),
        ("0x8:h100", "0x8:h100"),
        ("dapple-a,foo=1GB/s", "foo=1GB/s"),
        ("4x8:h100,intra=fast", "intra=fast"),
        ("4x8:h100,intra=10furlongs/s", "intra=10furlongs/s"),
        ("4x8:h100,inter", "inter"),
        ("missing.json", "missing.json"),
        ("dgx-h100:0", "dgx-h100:0"),
        ("", ""),
    ],
)
def test_bad_specs_quote_the_bad_part_and_show_the_grammar(spec: str, bad_part: str) -> None:
    with pytest.raises(ClusterSpecError) as info:
        parse_cluster(spec, calibrate=False)
    message = str(info.value)
    assert repr(bad_part) in message
    assert "SPEC     :=" in message and "dapple-a" in message and "dgx-h100" in message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("spec", ["dapple-a", "dapple-b", "dapple-c", "dgx-h100:2", "4x8:a100", "1x4:cpu"])
def test_json_round_trip(spec: str, tmp_path: Path) -> None:
    cluster = parse_cluster(spec)
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster
    path = tmp_path / "cluster.json"
    cluster.save(path)
    assert parse_cluster(str(path)) == cluster
    assert parse_cluster(f"{path},inter=7GB/s").inter_host.bandwidth_bytes_per_s == 7e9


def test_message_overhead_is_optional_in_json_and_checked() -> None:
    data = parse_cluster("1x4:cpu").to_json()
    assert data["message_overhead_s"] == 0.0
    data["message_overhead_s"] = 5e-4
    assert Cluster.from_json(data).message_overhead_s == 5e-4
    del data["message_overhead_s"]  # files written before the field existed
    assert Cluster.from_json(data).message_overhead_s == 0.0
    data["message_overhead_s"] = -1.0
    with pytest.raises(ClusterSpecError, match="message_overhead_s"):
        Cluster.from_json(data)
    with pytest.raises(ValueError, match="message_overhead_s must be >= 0 seconds; got -0.001"):
        replace(parse_cluster("1x4:cpu"), message_overhead_s=-1e-3)


def test_split_backward_overhead_is_optional_in_json_and_checked() -> None:
    data = parse_cluster("1x4:cpu").to_json()
    assert data["split_backward_overhead"] == CPU_SPLIT_BACKWARD_OVERHEAD  # CPU ranks: the measured-here default
    assert parse_cluster("2x8:h100").split_backward_overhead == parse_cluster("dapple-a").split_backward_overhead == 0
    data["split_backward_overhead"] = 0.5
    assert Cluster.from_json(data).split_backward_overhead == 0.5
    del data["split_backward_overhead"]  # files written before the field existed
    assert Cluster.from_json(data).split_backward_overhead == 0.0
    data["split_backward_overhead"] = -0.5
    with pytest.raises(ClusterSpecError, match="split_backward_overhead"):
        Cluster.from_json(data)


def test_split_backward_overhead_is_timed_with_the_runtime_split(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.autograd import split_backward
    from fxpipe.runtime.calibration import calibrate_measure

    calls: list[str] = []
    for name in ("backward_inputs", "backward_weights"):  # the runtime's own B and W are what gets timed
        original = getattr(split_backward, name)
        monkeypatch.setattr(split_backward, name, lambda *args, _f=original, _n=name: calls.append(_n) or _f(*args))
    overhead = calibrate_measure.measure_split_backward_overhead(repeats=2)
    assert overhead >= 0 and overhead != float("inf")
    assert calls == ["backward_inputs", "backward_weights"] * 4  # 2 warm-up rounds + 2 timed
    assert "split_backward_overhead" in calibrate_measure.DEVICE_KEYS


def test_bad_json_names_the_missing_key(tmp_path: Path) -> None:
    data = parse_cluster("dapple-a").to_json()
    del data["num_hosts"]
    with pytest.raises(ClusterSpecError, match="num_hosts"):
        Cluster.from_json(data)
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ClusterSpecError, match="not valid JSON"):
        parse_cluster(str(path))


def test_links_and_allreduce_math() -> None:
    cluster = parse_cluster("dapple-a")
    assert cluster.link(0, 7) is cluster.intra_host
    assert cluster.link(7, 8) is cluster.inter_host
    assert cluster.link(3, 12).transfer_time(2e9) == pytest.approx(2.0)
    weights = 1e9
    # Ring allreduce 2 W (R-1) / (R B): across hosts on the 3 GB/s collective figure, inside on NVLink.
    assert cluster.allreduce_time(weights, range(16)) == pytest.approx(2 * weights * 15 / (16 * 3e9))
    assert cluster.allreduce_time(weights, range(8)) == pytest.approx(2 * weights * 7 / (8 * 25e9))
    assert cluster.allreduce_time(weights, [5]) == 0.0
    slow = parse_cluster("2x2:h100,inter=1GB/s@1ms")
    expected = 2 * 3 * 1e-3 + 2 * weights * 3 / (4 * 1e9)
    assert slow.allreduce_time(weights, [0, 1, 2, 3]) == pytest.approx(expected)
    with pytest.raises(ValueError, match="device 16"):
        cluster.link(0, 16)


@pytest.fixture(autouse=True)
def cpu_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``local`` means CPU ranks in these tests, also on a machine with CUDA (the GPU tests patch it back)."""
    from fxpipe.runtime.calibration import calibrate

    monkeypatch.setattr(calibrate, "local_device", lambda collective=False: torch.device("cpu"))


DEVICE_FIGURES = {"float32": 2e10, "bfloat16": 1e9, "float16": 1.5e9, "memory_bandwidth": 8e9, "kernel_launch": 7e-6,
                  "split_backward_overhead": 0.375, "action_overhead": 5e-5, "step_overhead": 2e-5}
LINK_FIGURES = {"link_bandwidth": 3e9, "link_latency": 4e-5, "allreduce_bandwidth": 1.5e9, "allreduce_latency": 6e-5,
                "message_overhead": 3e-4, "overlap_compute_slowdown": 0.25, "overlap_comm_slowdown": 1.5,
                "reduce_scatter_bandwidth": 4e8, "reduce_scatter_latency": 3e-4, "all_gather_bandwidth": 9e8,
                "all_gather_latency": 1e-4, "lockstep_latency": 7e-4, "lockstep_bandwidth": 2e8,
                "fsdp_call_overhead": 2e-3, "fsdp_all_gather_call": 1e-3, "fsdp_all_gather_per_byte": 2e-9,
                "fsdp_reduce_scatter_call": 5e-4, "fsdp_reduce_scatter_per_byte": 1e-9, "fsdp_pass_call": 4e-4,
                "fsdp_pass_per_byte": 5e-10}


def _no_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    def refuse(device: object = None) -> dict[str, float]:
        raise AssertionError("measured although the cache holds the figures")

    monkeypatch.setattr(calibrate, "measure_device", refuse)


def test_local_without_calibration_splits_host_memory() -> None:
    cluster = parse_cluster("local:3", calibrate=False)
    assert (cluster.num_hosts, cluster.devices_per_host) == (1, 3)
    assert cluster.device.memory_bytes == host_memory_bytes() // 3 > 0
    assert cluster.link(0, 2) == cluster.intra_host
    assert parse_cluster("local", calibrate=False).num_devices >= 1


def test_environment_turns_calibration_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPIPE_CALIBRATE", "0")
    _no_measuring(monkeypatch)
    assert parse_cluster("local:2").device.name == "CPU"  # defaults, nothing measured


def test_local_calibration_reads_its_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    path = calibrate.cache_path("cpu")
    assert path.parent == tmp_path and "torch" in path.name and path.name.endswith("-cpu.json")
    calibrate.write_cache(path, {"device": DEVICE_FIGURES, "link": LINK_FIGURES})
    _no_measuring(monkeypatch)
    cluster = local_cluster(2, calibrate=True)  # tests/conftest.py turns calibration off by default
    assert cluster.intra_host == LinkSpec(3e9, 4e-5)
    assert (cluster.overlap_compute_slowdown, cluster.overlap_comm_slowdown) == (0.25, 1.5)
    assert (cluster.tensor_parallel_collective, cluster.fsdp_call_overhead_s) == (LinkSpec(2e8, 7e-4), 2e-3)
    assert cluster.fsdp_calls == FsdpCallCost(1e-3, 2e-9, 5e-4, 1e-9, 4e-4, 5e-10)
    assert cluster.collective_link([0, 1]) == cluster.intra_host_collective == LinkSpec(1.5e9, 6e-5)
    assert cluster.allreduce_time(3e9, [0, 1]) == 2 * 6e-5 + 2.0  # ring: 2 latencies + W / bandwidth
    assert cluster.message_overhead_s == 3e-4
    assert cluster.collective_link([0, 1], "reduce_scatter") == cluster.reduce_scatter_collective == LinkSpec(4e8, 3e-4)
    assert cluster.collective_link([0, 1], "all_gather") == cluster.all_gather_collective == LinkSpec(9e8, 1e-4)
    assert cluster.split_backward_overhead == 0.375  # measured; uncalibrated CPU ranks get the default
    assert (cluster.action_overhead_s, cluster.step_overhead_s) == (5e-5, 2e-5)  # measured; uncalibrated: none
    assert (parse_cluster("local:2", calibrate=False).action_overhead_s, parse_cluster("2x1:cpu").step_overhead_s) == (0, 0)
    assert parse_cluster("local:2", calibrate=False).split_backward_overhead == CPU_SPLIT_BACKWARD_OVERHEAD
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster
    overridden = parse_cluster("local:2,intra=1GB/s@1ms", calibrate=True)
    assert overridden.collective_link([0, 1]) == overridden.intra_host == LinkSpec(1e9, 1e-3)
    assert cluster.device.flops_per_s("float16") == 1.5e9
    assert cluster.device.kernel_launch_s == 7e-6


@pytest.mark.parametrize("stale", [{"measured_at": 0.0}, {"measured_at": 4e9}, {"measured_at": None},
                                   {"figures": {"float32": 9.0}}])
def test_an_old_or_damaged_calibration_is_measured_again(stale: dict[str, object], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    fresh = {key: value * 2 for key, value in DEVICE_FIGURES.items()}
    monkeypatch.setattr(calibrate, "measure_device", lambda device=None: fresh)
    path = calibrate.cache_path("cpu")
    calibrate.write_cache(path, {"device": DEVICE_FIGURES, "link": LINK_FIGURES})
    assert calibrate.calibrate_here() == calibrate.Calibration(DEVICE_FIGURES, LINK_FIGURES,
                                                               "device cached; links cached")
    written = json.loads(path.read_text())
    written["sections"]["device"].update(stale)
    path.write_text(json.dumps(written))
    assert calibrate.calibrate_here().device == fresh
    rewritten = json.loads(path.read_text())["sections"]
    assert rewritten["device"]["figures"] == fresh and abs(rewritten["device"]["measured_at"] - time.time()) < 60
    assert rewritten["link"]["figures"] == LINK_FIGURES  # the fresh link section is kept
    monkeypatch.setattr(calibrate, "measure_device", lambda device=None: DEVICE_FIGURES)
    assert calibrate.calibrate_here(refresh=True).device == DEVICE_FIGURES
    path.write_text(json.dumps({**written, "version": 1}))  # another format: all of it measured again
    assert calibrate.calibrate_here() == calibrate.Calibration(DEVICE_FIGURES, None,
                                                               "device measured in this process; links not measured")


def test_only_links_are_wanted_for_a_known_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    _no_measuring(monkeypatch)
    assert calibrate.calibrate_here(need_device=False) == calibrate.Calibration(
        None, None, "device not needed; links not measured")
    assert not any(tmp_path.iterdir())


def test_no_home_folder_means_no_cache_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("FXPIPE_CACHE_DIR", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    monkeypatch.setattr(calibrate, "measure_device", lambda device=None: DEVICE_FIGURES)
    with pytest.warns(RuntimeWarning, match="no calibration cache .*set FXPIPE_CACHE_DIR"):
        cluster = local_cluster(1, calibrate=True)
    assert cluster.device.flops_per_s("float32") == DEVICE_FIGURES["float32"]  # measured, just not kept


def test_links_nothing_measured_are_defaults_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a process group nothing can time a link (fxpipe never starts processes): defaults and a note."""
    from fxpipe.runtime.calibration import calibrate

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))
    calibrate.write_cache(calibrate.cache_path("cpu"), {"device": DEVICE_FIGURES})
    _no_measuring(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"local:3 plans with default link figures \(400 MB/s, 0.2 ms latency "
                      r"between ranks\), not measured ones.*fxpipe calibrate"):  # plain figures, no LinkSpec repr
        cluster = local_cluster(3, calibrate=True)
    assert cluster.intra_host == LOCAL_LINK_DEFAULT and cluster.intra_host_collective is None
    assert cluster.device.flops_per_s("float32") == DEVICE_FIGURES["float32"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one rank needs no link: no warning
        assert local_cluster(1, calibrate=True).device.peak_flops == cluster.device.peak_flops


def test_a_failing_measurement_degrades_to_defaults_with_a_warning(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    monkeypatch.setenv("FXPIPE_CACHE_DIR", str(tmp_path))

    def broken(device: object = None) -> dict[str, float]:
        raise RuntimeError("no timer today")

    monkeypatch.setattr(calibrate, "measure_device", broken)
    with pytest.warns(RuntimeWarning, match=r"measuring this device failed \(RuntimeError: no timer today\)"):
        cluster = local_cluster(1, calibrate=True)
    assert cluster.device == cpu_device(host_memory_bytes())  # the documented defaults
    assert "defaults (measurement failed)" in cluster.description
    assert not calibrate.cache_path("cpu").exists()  # nothing wrong is cached


def test_local_ranks_share_the_usable_cores() -> None:
    cores = usable_cores()
    assert cores >= 1
    many = parse_cluster(f"local:{2 * cores}", calibrate=False)
    assert many.cores_per_host == cores and many.compute_slowdown == 2.0
    assert parse_cluster(f"local:{cores}", calibrate=False).compute_slowdown == 1.0
    assert parse_cluster("dapple-a").cores_per_host == 0 and parse_cluster("dapple-a").compute_slowdown == 1.0
    assert Cluster.from_json(json.loads(json.dumps(many.to_json()))) == many
    legacy = many.to_json()
    del legacy["cores_per_host"]  # cluster files written before the field existed still load
    assert Cluster.from_json(legacy).cores_per_host == 0
    with pytest.raises(ClusterSpecError, match="cores_per_host"):
        Cluster.from_json({**many.to_json(), "cores_per_host": -1})


# --- GPUs: torch.cuda's answers in, a DeviceSpec out (no GPU here: torch.cuda is patched)
@pytest.mark.parametrize(("name", "memory", "preset", "link"), [
    ("NVIDIA H100 80GB HBM3", 80 * GiB, H100_80GB, NVLINK_H100),
    ("NVIDIA H100 PCIe", 80 * GiB, H100_PCIE_80GB, PCIE_GPU_P2P),
    ("NVIDIA H200", 141 * GiB, H200_141GB, NVLINK_H100),
    ("NVIDIA A100-SXM4-40GB", 40 * GiB, A100_80GB, NVLINK_A100),
    ("NVIDIA A100-PCIE-40GB", 40 * GiB, A100_80GB, PCIE_GPU_P2P),
    ("Tesla V100-SXM2-32GB", 32 * GiB, V100_16GB, NVLINK_V100),
    ("Tesla V100-PCIE-16GB", 16 * GiB, V100_16GB, PCIE_GPU_P2P),
])
def test_known_gpus_map_to_their_datasheet_preset(name: str, memory: int, preset: DeviceSpec, link: LinkSpec) -> None:
    found = gpu_preset(name, memory)
    assert found is not None
    device, found_link = found
    assert (device.peak_flops, device.memory_bandwidth_bytes_per_s) == (preset.peak_flops,
                                                                        preset.memory_bandwidth_bytes_per_s)
    assert (device.name, device.memory_bytes, found_link) == (name, memory, link)  # the device's own memory


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "AMD Instinct MI300X", "NVIDIA L40S", ""])
def test_unknown_gpus_have_no_preset(name: str) -> None:
    assert gpu_preset(name, 24 * GiB) is None


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, name: str, memory: int, count: int) -> None:
    from fxpipe.runtime.calibration import calibrate

    monkeypatch.setattr(calibrate, "local_device", lambda collective=False: torch.device("cuda", 0))
    monkeypatch.setattr(calibrate, "gpu_properties", lambda device: (name, memory, count))


def test_local_on_cuda_describes_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpus(monkeypatch, "NVIDIA H100 80GB HBM3", 85520809984, 4)
    cluster = parse_cluster("local", calibrate=False)
    assert (cluster.num_hosts, cluster.devices_per_host) == (1, 4)  # default: every visible GPU
    assert cluster.device.flops_per_s("bfloat16") == 989.5e12 and cluster.device.memory_bytes == 85520809984
    assert cluster.intra_host == NVLINK_H100 and cluster.cores_per_host == 0 and cluster.message_overhead_s == 0
    assert "local GPUs (NVIDIA H100 80GB HBM3), datasheet preset" == cluster.description
    assert parse_cluster("local:2", calibrate=False).num_devices == 2


def test_an_unknown_gpu_is_measured_or_gets_conservative_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    _fake_gpus(monkeypatch, "NVIDIA GeForce RTX 4090", 24 * GiB, 2)
    figures = {"float32": 80e12, "bfloat16": 160e12, "float16": 160e12, "memory_bandwidth": 9e11,
               "kernel_launch": 4e-6, "split_backward_overhead": 0.125}
    seen: list[tuple[torch.device, bool, bool]] = []

    def measured(device: torch.device, *, collective: bool = False, refresh: bool = False,
                 need_device: bool = True) -> Any:
        seen.append((device, collective, need_device))
        return calibrate.Calibration(figures if need_device else None, LINK_FIGURES,
                                     "over the nccl process group of 2 rank(s): device measured, links measured")

    monkeypatch.setattr(calibrate, "calibrate", measured)
    cluster = local_cluster(2, calibrate=True, collective=True)
    assert seen == [(torch.device("cuda", 0), True, True)]
    assert cluster.device == measured_device("NVIDIA GeForce RTX 4090", 24 * GiB, figures)
    assert cluster.split_backward_overhead == 0.125  # measured on this GPU
    assert cluster.action_overhead_s == cluster.step_overhead_s == 0  # GPUs plan as before: no fixed-cost figures
    assert cluster.intra_host == LinkSpec(3e9, 4e-5) and cluster.intra_host_collective == LinkSpec(1.5e9, 6e-5)
    with pytest.warns(RuntimeWarning, match="'NVIDIA GeForce RTX 4090' has no preset and was not measured"):
        guessed = local_cluster(2, calibrate=False)
    # the defaults are guesses, not a peak: the plan is costed at them but shows no MFU (DeviceSpec.default_rates)
    assert guessed.device == replace(measured_device("NVIDIA GeForce RTX 4090", 24 * GiB, GPU_DEFAULT_FIGURES),
                                     default_rates=True)
    assert not cluster.device.default_rates  # measured rates: MFU against them
    assert guessed.intra_host == PCIE_GPU_P2P
    _fake_gpus(monkeypatch, "NVIDIA H200", 141 * GiB, 8)  # a known model: only its links are measured
    known = local_cluster(calibrate=True, collective=True)
    assert seen[-1] == (torch.device("cuda", 0), True, False)
    assert known.device.flops_per_s("bfloat16") == 989.5e12 and known.num_devices == 8
    assert known.intra_host == LinkSpec(3e9, 4e-5) and known.message_overhead_s == 0
    assert known.split_backward_overhead == guessed.split_backward_overhead == 0  # not measured on these GPUs
    assert known.description == ("local GPUs (NVIDIA H200), datasheet preset; links over the nccl process group "
                                 "of 2 rank(s): device measured, links measured")


def test_device_kind_and_gpu_properties_read_torch_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate

    properties = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: properties)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    cuda = torch.device("cuda", 0)
    assert calibrate.device_kind(cuda) == "cuda-nvidia-h100-80gb-hbm3" and calibrate.device_kind(CPU) == "cpu"
    assert calibrate.gpu_properties(cuda) == ("NVIDIA H100 80GB HBM3", 80 * GiB, 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert REAL_LOCAL_DEVICE() == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert REAL_LOCAL_DEVICE() == torch.device("cuda", 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_local_on_a_real_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.calibration import calibrate
    from fxpipe.runtime.calibration.calibrate_measure import measure_device

    monkeypatch.setattr(calibrate, "local_device", REAL_LOCAL_DEVICE)
    cluster = local_cluster(calibrate=False)
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert cluster.num_devices == torch.cuda.device_count() and cluster.device.memory_bytes == properties.total_memory
    figures = measure_device(torch.device("cuda", torch.cuda.current_device()))
    assert all(value > 0 and math.isfinite(value) for value in figures.values())


def test_local_cluster_without_the_runtime_probe_names_the_import(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.core import local_probe

    monkeypatch.setattr(local_probe, "_LOCAL_PROBE", [])
    with pytest.raises(ClusterSpecError, match="import fxpipe.runtime.calibration.calibrate"):
        parse_cluster("local:2", calibrate=False)


def test_achievable_matmul_rates_travel_in_cluster_json_and_stay_absent_without_them() -> None:
    assert "matmul_flops" not in parse_cluster("dapple-a").to_json()["device"]  # files written before: same bytes
    data = parse_cluster("dgx-h100:1").to_json()
    assert data["device"]["matmul_flops"]["bfloat16"] == 700.5e12  # datasheet peak beside it
    assert data["device"]["peak_flops"]["bfloat16"] == 989.5e12
    data["device"]["matmul_flops"]["bfloat16"] = 700e12  # a lent device's own measurement replaces it
    assert dict(Cluster.from_json(data).device.matmul_flops)["bfloat16"] == 700e12
    data["device"]["matmul_flops"]["bfloat16"] = -1.0
    with pytest.raises(ClusterSpecError, match=r"matmul_flops\['bfloat16'\]"):
        Cluster.from_json(data)


def test_cpu_peak_rates_are_timed_in_this_processs_cpu_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peak is what the device does when it runs: on CPU, other processes sharing the core must not lower it (a
    wall-clock rate timed during a test suite once cached a float32 peak 10x low: the demo showed MFU above 100%)."""
    from fxpipe.runtime.calibration import calibrate_measure

    assert calibrate_measure.peak_clock(torch.device("cpu")) is time.process_time
    assert calibrate_measure.peak_clock(torch.device("meta")) is time.perf_counter  # a GPU's: the wall clock
    ticks = iter(range(100))
    calls, elapsed = calibrate_measure._rate(lambda: None, 3.0, clock=lambda: float(next(ticks)))
    assert (calls, elapsed) == (3, 3.0)  # counted on the clock given: 3 calls of one tick each
    used: list[object] = []

    def recording(work: Any, seconds: float, sync: Any = None, clock: Any = time.perf_counter) -> tuple[int, float]:
        used.append(clock)
        return 10, 1.0

    monkeypatch.setattr(calibrate_measure, "_rate", recording)
    assert calibrate_measure.measure_matmul_flops(torch.float32, size=4) == 2.0 * 4**3 * 10
    assert calibrate_measure.measure_memory_bandwidth(num_bytes=64) == 2.0 * 64 * 10
    assert used == [time.process_time, time.process_time]
