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


def peak_flops_per_device(device: DeviceSpec, precision: str) -> float:
    """The datasheet peak MFU is measured against: the device's rate for the precision's dtype (fp32: float32);
    0 when the device lists no rate for it."""
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
