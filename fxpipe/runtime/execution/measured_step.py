"""A pipeline driver's measured steps: a timeline of every action, saved-activation bytes, and every rank's StepStats."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.distributed as dist

from fxpipe.core import schedule as schedules
from fxpipe.runtime.autograd.measure import ActionTimer, MeasureMode, SavedActivationMeter, StepStats
from fxpipe.runtime.execution.stage import StageRunner
from fxpipe.runtime.execution.step_state import StepState
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.transport.comm import DistContext


class MeasuredDriver(Protocol):
    """What a measured step reads and sets of fxpipe.runtime.execution.driver.PipelineDriver."""

    measure: MeasureMode
    saved_meter: SavedActivationMeter | None
    last_stats: StepStats | None
    runner: StageRunner
    rank: int
    stage_index: int
    context: DistContext

    def run_actions(self, state: StepState, stash: dict[int, torch.Tensor | None] | None,
                    handlers: Mapping[schedules.Op, Callable[[StepState, int], None]],
                    timer: ActionTimer | None) -> None: ...


def measured_step(driver: MeasuredDriver, state: StepState, stash: dict[int, torch.Tensor | None] | None,
                  handlers: Mapping[schedules.Op, Callable[[StepState, int], None]]) -> None:
    """``driver``'s step with a timeline of every action and, under ``MeasureMode.FULL``, exact saved-activation
    bytes; the StepStats go to ``driver.last_stats``."""
    meter: SavedActivationMeter | None = None
    if driver.measure is MeasureMode.FULL:
        if driver.saved_meter is None:
            driver.saved_meter = SavedActivationMeter.for_parameters(p for _, p in driver.runner.parameters())
        meter = driver.saved_meter
        meter.reset_peak()
    timer = ActionTimer(driver.rank, driver.stage_index, synchronize=driver.context.device.type == "cuda")
    driver.runner.meter = meter  # a recomputing stage adds the forward it rebuilds in each backward
    try:
        with meter.measure() if meter is not None else contextlib.nullcontext():
            driver.run_actions(state, stash, handlers, timer)
    finally:
        driver.runner.meter = None
    step_time = timer.start()
    driver.last_stats = StepStats(driver.rank, driver.stage_index, step_time,
                                  meter.peak_bytes if meter is not None else None, tuple(timer.events))


def gather_step_stats(driver: MeasuredDriver) -> list[StepStats]:
    """Every rank's StepStats of the last measured step, by rank (a collective: call on all ranks)."""
    if driver.last_stats is None:
        raise PipelineSetupError("no measured step yet; set pipe.measure = True (or 'timeline') before step()")
    gathered: list[StepStats | None] = [None] * driver.context.world_size
    dist.all_gather_object(gathered, driver.last_stats)
    return [stats for stats in gathered if stats is not None]
