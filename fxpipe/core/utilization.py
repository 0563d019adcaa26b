"""Model FLOPs utilization (MFU) and tokens/s per device of a plan, predicted or measured, as Megatron counts them."""

from __future__ import annotations

from typing import Protocol

from fxpipe.core.hardware import DeviceSpec
from fxpipe.core.precision import autocast_dtype_name


class _Predicted(Protocol):
    """The figures of :class:`fxpipe.core.plan.Prediction` these functions read (plan.py imports this module)."""

    @property
    def iteration_time_s(self) -> float: ...
    @property
    def model_flops_per_sample(self) -> float: ...
    @property
    def tokens_per_sample(self) -> int: ...
    @property
    def peak_flops_per_device(self) -> float: ...


class Plan(Protocol):
    """What of a :class:`fxpipe.core.plan.Plan` these functions read."""

    @property
    def predicted(self) -> _Predicted | None: ...
    @property
    def global_batch_size(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def cluster(self) -> str: ...


def peak_flops_per_device(device: DeviceSpec, precision: str) -> float:
    """The datasheet peak MFU is measured against: the device's rate for the precision's dtype (fp32: float32);
    0 when the device lists no rate for it, or only conservative defaults (``DeviceSpec.default_rates``: an
    uncalibrated CPU rank, whose guessed rates are no peak)."""
    if device.default_rates:
        return 0.0
    return dict(device.peak_flops).get(autocast_dtype_name(precision) or "float32", 0.0)


def model_flops_utilization(plan: Plan, iteration_time_s: float | None = None) -> float | None:
    """Model FLOPs per second over (devices the plan runs on x datasheet peak per device).

    Model FLOPs are ``predicted.model_flops_per_sample`` x the global batch per iteration (3 x the forward
    matmul FLOPs, recomputation not counted). ``iteration_time_s``: a measured iteration (default: the
    predicted one). None when the plan lacks any of the figures (a profile file's plan, an older file).
    """
    predicted = plan.predicted
    if predicted is None or predicted.model_flops_per_sample <= 0 or predicted.peak_flops_per_device <= 0:
        return None
    seconds = predicted.iteration_time_s if iteration_time_s is None else iteration_time_s
    if seconds <= 0:
        return None
    flops_per_s = predicted.model_flops_per_sample * plan.global_batch_size / seconds
    return flops_per_s / (plan.world_size * predicted.peak_flops_per_device)


def tokens_per_s_per_device(plan: Plan, iteration_time_s: float | None = None) -> float | None:
    """Tokens per second per device (rows x sequence length over the iteration and the devices the plan runs on);
    None unless the plan is a language model's (``predicted.tokens_per_sample``)."""
    predicted = plan.predicted
    if predicted is None or predicted.tokens_per_sample <= 0:
        return None
    seconds = predicted.iteration_time_s if iteration_time_s is None else iteration_time_s
    if seconds <= 0:
        return None
    return predicted.tokens_per_sample * plan.global_batch_size / seconds / plan.world_size


def utilization_warning(plan: Plan, iteration_time_s: float) -> str:
    """A warning when a measured iteration's MFU is above 100%, which no device reaches, or ``""``.

    Such a figure means the peak rate it is measured against is too low: a ``local`` cluster's peak comes
    from the calibration cache, which ``fxpipe calibrate`` measures again; a preset's from its datasheet.
    """
    mfu = model_flops_utilization(plan, iteration_time_s)
    predicted = plan.predicted
    if mfu is None or mfu <= 1.0 or predicted is None:
        return ""
    name = plan.cluster or "the plan's cluster"
    peak = predicted.peak_flops_per_device
    fix = ("its peak comes from this machine's calibration cache (docs/clusters.md): run `fxpipe calibrate` on a "
           "quiet machine to measure it again, then plan again" if name.startswith("local")
           else f"check {name}'s device peak_flops, or plan on a cluster spec with the device's real peak")
    return (f"warning: a measured step ran at MFU {mfu:.0%}, above 100%, against a peak of {peak / 1e9:,.1f} "
            f"GFLOP/s per device on {name}: that peak is too low for these devices, so MFU figures of this plan "
            f"are wrong; {fix}")


def utilization_text(plan: Plan, iteration_time_s: float | None = None) -> str:
    """``"MFU 41.2%, 2,345 tokens/s/device"`` (what is known of it), or ``""``."""
    parts = []
    mfu = model_flops_utilization(plan, iteration_time_s)
    if mfu is not None:
        parts.append(f"MFU {mfu:.1%}")
    tokens = tokens_per_s_per_device(plan, iteration_time_s)
    if tokens is not None:
        parts.append(f"{tokens:,.0f} tokens/s/device")
    return ", ".join(parts)
