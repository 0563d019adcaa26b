"""Cluster spec grammar: ClusterSpecError, quantities with units in spec strings, checked cluster JSON fields
(and the links and devices built from them)."""

from __future__ import annotations

import difflib
import math
import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from fxpipe.core.fsdp_calls import OPTIONAL_FIELDS, FsdpCallCost, fsdp_calls_from_figures
from fxpipe.core.hardware import Calibration, DeviceSpec, LinkSpec
from fxpipe.core.jsonvalues import JSONValueError, read_field

PRESET_NAMES = ("dapple-a", "dapple-b", "dapple-c", "dgx-h100[:NODES]", "local[:RANKS]")

GRAMMAR = """cluster spec grammar:
  SPEC     := BASE ("," OVERRIDE)*
  BASE     := PRESET | HOSTS "x" DEVICES ":" KIND | PATH.json
  PRESET   := dapple-a | dapple-b | dapple-c | dgx-h100[:NODES] | local[:RANKS]
  KIND     := v100 | a100 | h100 | h200 | cpu
  OVERRIDE := (intra | inter | collective) "=" BANDWIDTH ["@" LATENCY]
            | memory "=" SIZE
  BANDWIDTH: number + GB/s, MB/s, GiB/s, MiB/s, Gb/s, Gbps, Mb/s, Mbps, B/s
  LATENCY  : number + s, ms, us, ns          SIZE: number + GB, GiB, MB, MiB, B
  examples : dapple-a   4x8:h100   4x8:h100,intra=450GB/s,inter=50GB/s@5us   local:4   cluster.json"""

# Counts in specs have at most this many digits (int() of a few thousand digits is refused by Python).
COUNT_DIGITS = 6

# Decimal scales keep "5us" exactly 5e-6 (float 5 * 1e-6 is not). Bit units end in "bps" or are
# spelled with a lower-case b ("Gb/s"); "GB/s" and "gb/s" are bytes.
_D = Decimal
_BANDWIDTH_UNITS = {"b/s": _D(1), "kb/s": _D("1e3"), "mb/s": _D("1e6"), "gb/s": _D("1e9"), "tb/s": _D("1e12"),
                    "kib/s": _D(2**10), "mib/s": _D(2**20), "gib/s": _D(2**30), "bps": _D(1) / 8,
                    "kbps": _D("1e3") / 8, "mbps": _D("1e6") / 8, "gbps": _D("1e9") / 8, "tbps": _D("1e12") / 8}
_BIT_UNITS = {"Kb/s": _D("1e3") / 8, "Mb/s": _D("1e6") / 8, "Gb/s": _D("1e9") / 8, "Tb/s": _D("1e12") / 8}
_TIME_UNITS = {"s": _D(1), "ms": _D("1e-3"), "us": _D("1e-6"), "ns": _D("1e-9")}
_SIZE_UNITS = {"b": _D(1), "kb": _D("1e3"), "mb": _D("1e6"), "gb": _D("1e9"), "tb": _D("1e12"), "kib": _D(2**10),
               "mib": _D(2**20), "gib": _D(2**30), "tib": _D(2**40)}
Quantity = Literal["bandwidth", "latency", "size"]
# quantity -> (units, example, base unit)
_QUANTITIES: dict[str, tuple[dict[str, Decimal], str, str]] = {
    "bandwidth": (_BANDWIDTH_UNITS, "12GB/s", "B/s"),
    "latency": (_TIME_UNITS, "5us", "s"),
    "size": (_SIZE_UNITS, "80GB", "B"),
}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]{0,40}\.?[0-9]{1,40}(?:e[+-]?[0-9]{1,7})?)\s*([a-z/]{1,8})\s*$", re.IGNORECASE)
Bound = Literal["positive", "non-negative"]


class ClusterSpecError(ValueError):
    """A cluster spec string or cluster JSON file is malformed."""


# The names a spec's base may start with (did-you-mean suggestions for a typo).
BASE_NAMES = ("dapple-a", "dapple-b", "dapple-c", "dgx-h100", "local")


def did_you_mean(word: str, choices: Any) -> str:
    """``"; did you mean 'dapple-a'?"`` for the choice closest to ``word`` (difflib), or "" when none is close."""
    matches = difflib.get_close_matches(word.strip().lower(), sorted(choices), n=1, cutoff=0.6)
    return f"; did you mean {matches[0]!r}?" if matches else ""


def base_suggestion(base: str) -> str:
    """:func:`did_you_mean` for a spec's base among the preset names, its count kept (``locl:4`` -> ``local:4``);
    a compact spec's device kind gets its own (:func:`fxpipe.core.cluster.compact_cluster`)."""
    name, sep, count = base.strip().lower().partition(":")
    matches = difflib.get_close_matches(name, BASE_NAMES, n=1, cutoff=0.6)
    return f"; did you mean {matches[0] + sep + count!r}?" if matches else ""


def spec_error(spec: str, part: str, why: str) -> ClusterSpecError:
    """An error quoting the whole spec and the bad part, followed by the grammar and the presets."""
    return ClusterSpecError(f"bad cluster spec {spec!r:.200}: {part!r:.200} {why}\n{GRAMMAR}\n"
                            f"presets: {', '.join(PRESET_NAMES)}")


def quantity(spec: str, part: str, text: str, what: Quantity) -> float:
    """``text`` ("450GB/s", "5us", "80GB") in base units (B/s, s, B); finite, and positive unless a latency."""
    units, example, base = _QUANTITIES[what]
    match = _NUMBER_UNIT.match(text)
    if not match:
        raise spec_error(spec, part, f"needs a {what} like {example} (a number >= 0, then a unit)")
    number, unit = Decimal(match.group(1)), match.group(2)
    scale = (_BIT_UNITS.get(unit) if what == "bandwidth" else None) or units.get(unit.lower())
    if scale is None:
        raise spec_error(spec, part, f"has an unknown {what} unit {unit!r}; units: {', '.join(units)}")
    try:
        value = float(number * scale)
    except ArithmeticError:  # decimal.Overflow beyond Decimal's exponent range
        value = math.inf
    if not math.isfinite(value):
        raise spec_error(spec, part, f"is too large; give a {what} like {example}")
    if what != "latency" and not value > 0:
        raise spec_error(spec, part, f"must be positive (it is {value:g} {base}); give a {what} like {example}")
    return value


def check_bound(value: float, path: str, bound: Bound | None) -> None:
    """Raise ClusterSpecError when a cluster JSON figure at ``path`` is not ``bound``."""
    if (bound == "positive" and not value > 0) or (bound == "non-negative" and not value >= 0):
        raise ClusterSpecError(f"cluster JSON: {path} {value!r} must be {bound}")


def json_field(data: Any, key: str, hint: Any, where: str = "", bound: Bound | None = None) -> Any:
    """``data[key]`` of a cluster JSON object, checked against the type ``hint`` and ``bound``."""
    try:
        value = read_field(data, key, hint, where)
    except JSONValueError as error:
        raise ClusterSpecError(f"cluster JSON: {error}") from None
    check_bound(value, f"{where}.{key}" if where else key, bound)
    return value


def link_from_json(data: Any, where: str) -> LinkSpec:
    """A link of a cluster JSON file, every field checked (ClusterSpecError names ``where``)."""
    return LinkSpec(
        bandwidth_bytes_per_s=json_field(data, "bandwidth_bytes_per_s", float, where, "positive"),
        latency_s=json_field(data, "latency_s", float, where, "non-negative"),
    )


def optional_link(data: Any, key: str) -> LinkSpec | None:
    """The link at ``key`` of a cluster's JSON; None when the key is absent or null."""
    return link_from_json(data[key], key) if data.get(key) is not None else None


def optional_seconds(data: Any, key: str) -> float:
    """A non-negative figure at ``key`` of a cluster's JSON; 0 when absent (not measured)."""
    return float(json_field(data, key, float, "", "non-negative")) if key in data else 0.0


def optional_fsdp_calls(data: Any) -> FsdpCallCost | None:
    """FSDP2's per-kind host time fit at ``fsdp_calls`` of a cluster's JSON (non-negative seconds figures,
    ClusterSpecError naming a missing or wrong one; the pass figures, newer, may be absent: 0); None when the key
    is absent or null."""
    if data.get("fsdp_calls") is None:
        return None
    fit = json_field(data, "fsdp_calls", dict)
    extra = sorted(set(fit) - set(FsdpCallCost().to_json()))
    if extra:
        raise ClusterSpecError(f"cluster JSON: fsdp_calls has unknown keys {extra}; it holds "
                               f"{sorted(FsdpCallCost().to_json())}")
    return FsdpCallCost(**{name: float(json_field(fit, name, float, "fsdp_calls", "non-negative"))
                           for name in FsdpCallCost().to_json() if name in fit or name not in OPTIONAL_FIELDS})


def device_from_json(data: Any) -> DeviceSpec:
    """The device of a cluster JSON file, every field checked."""
    flops = json_field(data, "peak_flops", dict[str, float], "device")
    matmul = json_field(data, "matmul_flops", dict[str, float], "device") if "matmul_flops" in data else {}
    for key, table in (("peak_flops", flops), ("matmul_flops", matmul)):
        for dtype, rate in table.items():
            check_bound(rate, f"device.{key}[{dtype!r}]", "positive")
    return DeviceSpec(
        name=json_field(data, "name", str, "device"),
        memory_bytes=json_field(data, "memory_bytes", int, "device", "non-negative"),
        peak_flops=tuple(sorted(flops.items())),
        memory_bandwidth_bytes_per_s=json_field(data, "memory_bandwidth_bytes_per_s", float, "device", "positive"),
        kernel_launch_s=json_field(data, "kernel_launch_s", float, "device", "non-negative"),
        matmul_flops=tuple(sorted(matmul.items())),
        default_rates=json_field(data, "default_rates", bool, "device") if "default_rates" in data else False,
    )


def measured_links(measured: Calibration | None) -> tuple[LinkSpec, LinkSpec, float] | None:
    """(point-to-point link, collective link, message overhead) from measured figures, None when not measured."""
    if measured is None or measured.links is None:
        return None
    links = measured.links
    return (LinkSpec(links["link_bandwidth"], links["link_latency"]),
            LinkSpec(links["allreduce_bandwidth"], links["allreduce_latency"]), links["message_overhead"])


def sharding_links(figures: dict[str, float]) -> tuple[LinkSpec | None, LinkSpec | None]:
    """(reduce-scatter, all-gather) links from calibrated link figures; None where not measured."""
    return tuple(LinkSpec(figures[f"{kind}_bandwidth"], figures[f"{kind}_latency"])  # type: ignore[return-value]
                 if f"{kind}_bandwidth" in figures else None for kind in ("reduce_scatter", "all_gather"))


def lockstep_link(figures: dict[str, float]) -> LinkSpec | None:
    """A tensor-parallel group's collectives between compute in lock-step, from calibrated link figures
    (:mod:`fxpipe.runtime.calibration.calibrate_lockstep`); None where not measured (GPUs, older caches).

    Never faster than the allreduce link timed back to back: the same bytes cross the same link (a noisy fit, the
    large all-reduces timed no slower than the small ones, would otherwise give a near-infinite bandwidth)."""
    if "lockstep_bandwidth" not in figures:
        return None
    bandwidth, latency = figures["lockstep_bandwidth"], figures["lockstep_latency"]
    if "allreduce_bandwidth" in figures:
        bandwidth = min(bandwidth, figures["allreduce_bandwidth"])
        latency = max(latency, figures["allreduce_latency"])
    return LinkSpec(bandwidth, latency)


def calibrated_link_fields(figures: dict[str, float]) -> dict[str, Any]:
    """The ``Cluster`` fields a local cluster takes from calibrated link figures beyond its links: the
    tensor-parallel group's lock-step link and FSDP2's host time per call (flat, and the per-kind fit)."""
    return {"tensor_parallel_collective": lockstep_link(figures),
            "fsdp_call_overhead_s": figures.get("fsdp_call_overhead", 0.0),
            "fsdp_calls": fsdp_calls_from_figures(figures)}


def existing_file(text: str) -> Path | None:
    """The file ``text`` names (``~`` expanded), or None when there is no such file."""
    try:
        path = Path(text).expanduser()
        return path if path.is_file() else None
    except (OSError, RuntimeError, ValueError):  # too long for the file system, unknown ~user, NUL byte
        return None


def cluster_fields_from_json(data: Any) -> dict[str, Any]:
    """The keyword arguments of ``Cluster`` from its JSON (after the format check), every field checked."""
    return dict(
        device=device_from_json(json_field(data, "device", dict)),
        name=json_field(data, "name", str),
        num_hosts=json_field(data, "num_hosts", int, "", "positive"),
        devices_per_host=json_field(data, "devices_per_host", int, "", "positive"),
        intra_host=link_from_json(json_field(data, "intra_host", dict), "intra_host"),
        inter_host=link_from_json(json_field(data, "inter_host", dict), "inter_host"),
        inter_host_collective=optional_link(data, "inter_host_collective"),
        description=json_field(data, "description", str) if "description" in data else "",
        cores_per_host=json_field(data, "cores_per_host", int, "", "non-negative") if "cores_per_host" in data else 0,
        intra_host_collective=optional_link(data, "intra_host_collective"),
        message_overhead_s=optional_seconds(data, "message_overhead_s"),
        split_backward_overhead=optional_seconds(data, "split_backward_overhead"),
        optimizer_s_per_param_byte=optional_seconds(data, "optimizer_s_per_param_byte"),
        overlap_compute_slowdown=optional_seconds(data, "overlap_compute_slowdown"),
        overlap_comm_slowdown=optional_seconds(data, "overlap_comm_slowdown"),
        reduce_scatter_collective=optional_link(data, "reduce_scatter_collective"),
        all_gather_collective=optional_link(data, "all_gather_collective"),
        action_overhead_s=optional_seconds(data, "action_overhead_s"),
        step_overhead_s=optional_seconds(data, "step_overhead_s"),
        tensor_parallel_collective=optional_link(data, "tensor_parallel_collective"),
        fsdp_call_overhead_s=optional_seconds(data, "fsdp_call_overhead_s"),
        fsdp_calls=optional_fsdp_calls(data),
    )
