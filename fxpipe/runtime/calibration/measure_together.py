"""Run a measurement on every rank of a group at the same moment and gather what each rank found."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

# Side of the matmul a rank repeats while it waits for the others (about a millisecond on one CPU core).
BUSY_MATRIX = 96

Result = TypeVar("Result")

if TYPE_CHECKING:
    from fxpipe.runtime.faults.guard import SetupGroup


def measured_together(measure: Callable[[], Result], group: dist.ProcessGroup | None = None) -> list[Result]:
    """Every rank's ``measure()`` result, in rank order; the ranks start together and none idles until all end.

    A collective over ``group`` (a world of one, or no process group, just calls ``measure``). The
    results must be picklable (``all_gather_object``).
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return [measure()]
    dist.barrier(group=group)  # start together: each rank's figures cover the same load
    mine = measure()
    busy_until_all_done(group)
    gathered: list[Result | None] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    return gathered  # type: ignore[return-value]  # every slot was filled by all_gather_object


def busy_until_all_done(group: dist.ProcessGroup | None) -> None:
    """Keep this rank's core busy (small matmuls) until every rank has finished measuring.

    A rank that finished early and sat idle in a collective would hand its core to the ranks still
    measuring, which then time their work faster than any training step runs it (every rank
    computes at once there): with 4 ranks on 2 cores, the last ranks' figures came out too fast.
    """
    done = dist.barrier(group=group, async_op=True)
    assert done is not None
    left = torch.ones(BUSY_MATRIX, BUSY_MATRIX)
    while not done.is_completed():
        torch.mm(left, left)
    done.wait()


def job_collective(num_devices: int, device: torch.device | None,
                   group: SetupGroup = None) -> tuple[int, float, float] | None:
    """``(ranks, latency s, bandwidth B/s)`` of an allreduce over every rank of the job on the default
    process group (:func:`fxpipe.runtime.calibration.calibrate_measure.measure_job_collective`), the same on every
    rank; None for one rank, no ``device``, or a cluster of ``num_devices`` that is not the launched ranks.
    A collective: call it on every rank alike (``group`` carries the setup phase's failures)."""
    from fxpipe.runtime.calibration.calibrate_measure import measure_job_collective
    from fxpipe.runtime.faults.guard import setup_phase

    num_ranks = dist.get_world_size() if dist.is_initialized() else 1
    if device is None or num_ranks < 2 or num_devices != num_ranks:
        return None
    with setup_phase("measuring the allreduce over all ranks", group):
        latency_s, bandwidth = measure_job_collective(device)
    return num_ranks, latency_s, bandwidth
