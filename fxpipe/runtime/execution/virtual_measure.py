"""A virtual-stage rank's measured steps (``pipe.measure``): a timeline of every chunk's actions, saved-activation bytes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

import torch

from fxpipe.runtime.autograd.measure import ActionTimer, MeasureMode, SavedActivationMeter, StepStats
from fxpipe.runtime.execution.stage import StageRunner
from fxpipe.runtime.transport.comm import DistContext


class MeasuredChunks(Protocol):
    """What a measured step reads and sets of fxpipe.runtime.execution.virtual_driver.VirtualDriver."""

    measure: MeasureMode
    saved_meter: SavedActivationMeter | None
    last_stats: StepStats | None
    rank: int
    stage_index: int
    context: DistContext

    @property
    def runners(self) -> Mapping[int, StageRunner]: ...

    @property
    def named(self) -> Sequence[tuple[str, torch.nn.Parameter]]: ...


@contextlib.contextmanager
def measured_actions(driver: MeasuredChunks) -> Iterator[ActionTimer | None]:
    """Around a step's actions: the timer the driver's ``run_actions`` records each compute action with (None when not
    measuring), each event under its chunk's index; under ``MeasureMode.FULL`` the exact saved-activation peak of all
    the rank's chunks together (one meter over every chunk's parameters). The StepStats go to ``driver.last_stats``,
    as the one-stage driver's measured step does (fxpipe.runtime.execution.measured_step)."""
    if driver.measure is MeasureMode.OFF:
        yield None
        return
    meter: SavedActivationMeter | None = None
    if driver.measure is MeasureMode.FULL:
        if driver.saved_meter is None:
            driver.saved_meter = SavedActivationMeter.for_parameters(p for _, p in driver.named)
        meter = driver.saved_meter
        meter.reset_peak()
    timer = ActionTimer(driver.rank, driver.stage_index, synchronize=driver.context.device.type == "cuda")
    for runner in driver.runners.values():  # a recomputing chunk adds the forward it rebuilds in each backward
        runner.meter = meter
    try:
        with meter.measure() if meter is not None else contextlib.nullcontext():
            yield timer
    finally:
        for runner in driver.runners.values():
            runner.meter = None
    driver.last_stats = StepStats(driver.rank, driver.stage_index, timer.start(),
                                  meter.peak_bytes if meter is not None else None, tuple(timer.events))
