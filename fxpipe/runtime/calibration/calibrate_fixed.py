"""The runtime's fixed costs on this device: its own driver stepping a one-op stage, timed at two micro-batch counts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.program import SplitProgram, StageProgram, ValueSpec

# Steps of FIXED_MICROBATCHES[0] and [1] micro-batches alternate (FIXED_WARMUP, then FIXED_REPEATS timed
# each); the rows are the same in both, split into as many slices as micro-batches.
FIXED_MICROBATCHES = (1, 8)
FIXED_ROWS = 8
FIXED_WARMUP, FIXED_REPEATS = 3, 30


class _Scale(torch.nn.Module):
    """One multiply by one weight: a stage whose own compute is a few dispatches, next to the driver's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x * self.weight,)


def _squared_error_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).sum()


def _driver(num_microbatches: int, device: torch.device) -> Any:
    """A world-of-one PipelineDriver over a one-stage plan of :class:`_Scale` (no process group needed)."""
    from fxpipe.runtime.execution.driver import PipelineDriver  # here: the driver imports most of the runtime
    from fxpipe.runtime.transport.comm import DistContext

    module = fx.symbolic_trace(_Scale())
    rows = FIXED_ROWS // num_microbatches
    values = {"x": ValueSpec("x", (rows, 1), torch.float32, True, True, False),
              "y": ValueSpec("y", (rows, 1), torch.float32, True, True, True)}
    stage = StageProgram(0, module, ("x",), ("y",), (("weight", "weight"),))
    program = SplitProgram((stage,), ("x",), "y", {"x": -1, "y": 0}, {"x": (0,), "y": ()}, values, ())
    plan = Plan(FIXED_ROWS, num_microbatches, (StagePlan(0, 0, 1, 1, (0,)),), num_devices=1, num_blocks=1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # check_batch="off": the batch check would compare over the job's process group (calibration runs inside
    # one, a rank at a time); after a job's first steps it folds into the closing allreduce anyway
    return PipelineDriver(program, plan, _squared_error_sum, context=DistContext(0, 1, backend, device),
                          loss_reduction="sum", check_batch="off")


def measure_fixed_costs(device: torch.device | None = None, repeats: int = FIXED_REPEATS) -> dict[str, float]:
    """``action_overhead`` and ``step_overhead``: seconds per forward or backward action and per step that the
    runtime's driver spends beyond the stage's own work (:attr:`fxpipe.core.cluster.Cluster.action_overhead_s`).

    Two world-of-one drivers (:func:`_driver`, the runtime's own ``PipelineDriver``: batch check, slicing,
    the stage call, the loss, autograd, the loss read) step the same rows in 1 and 8 micro-batches, alternating;
    the medians' difference over 7 more micro-batches is the cost of one more forward and backward, halved per
    action; what one micro-batch's step takes beyond that is the per-step cost (at least 0). On a CPU the clock
    is the process's CPU time (work, whatever share of a core it got: compile scales it by the job's
    wall/CPU stretch, as the blocks); on a GPU the wall clock between synchronisations. The step's
    closing allreduce is not here (a world of one has none): the cost model charges it from the link.
    """
    device = device or torch.device("cpu")
    few, many = FIXED_MICROBATCHES
    drivers = {count: _driver(count, device) for count in FIXED_MICROBATCHES}
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(FIXED_ROWS, 1, generator=generator).to(device),)
    targets = torch.randn(FIXED_ROWS, 1, generator=generator).to(device)
    clock, sync = _clock(device)
    times: dict[int, list[float]] = {count: [] for count in FIXED_MICROBATCHES}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for index in range(FIXED_WARMUP + repeats):
            for count, driver in drivers.items():
                sync()
                start = clock()
                driver.step(inputs, targets)
                sync()
                if index >= FIXED_WARMUP:
                    times[count].append(clock() - start)
    medians = {count: statistics.median(samples) for count, samples in times.items()}
    per_microbatch = max(0.0, (medians[many] - medians[few]) / (many - few))
    return {"action_overhead": per_microbatch / 2, "step_overhead": max(0.0, medians[few] - few * per_microbatch)}


def _clock(device: torch.device) -> tuple[Callable[[], float], Callable[[], None]]:
    """(clock, synchronise): CPU seconds of this process on a CPU; wall seconds and a CUDA sync on a GPU."""
    if device.type == "cuda":
        return time.perf_counter, lambda: torch.cuda.synchronize(device)
    return time.process_time, lambda: None
