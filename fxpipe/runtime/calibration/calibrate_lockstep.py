"""A tensor-parallel group's collectives as they run between compute in lock-step: all-reduces timed after matmuls.

A tensor-parallel group (and a ZeRO-3 stage) meets its peers at every collective, a millisecond or so of compute
apart. On CPU ranks such a collective costs far more than the same collective after a barrier: on the 2-core VM
of benchmarks/tp_fidelity_terms.md a 128 KiB all-reduce took 1.7-2.2 ms inside a gpt-mini ``1x2`` step against
0.24-0.53 ms back to back, and most of that time passed after both members had entered it: inside gloo, which
runs each collective on its worker and transport threads, more than in the peers' lateness. So both ranks (call on
both; ``group`` holds just them) time ``LOCKSTEP_CALLS`` all-reduces each posted after about ``LOCKSTEP_GAP_S`` of
matmuls, no barrier, of two sizes in alternating rounds; each rank's mean per size, averaged over the two
ranks, is fitted as a two-rank ring (:func:`fxpipe.runtime.calibration.ring_fit.ring_fit`).
:func:`fxpipe.sim.tensor_parallel_cost.tensor_parallel_link` charges a group's collectives on that link.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from fxpipe.runtime.calibration.ring_fit import ring_fit

# A tensor-parallel stage's compute between two collectives on these CPU ranks (gpt-mini 1x2: 38 collectives in
# about 70 ms of compute per step, benchmarks/tp_fidelity_terms.md); small matmuls keep the gap close to it.
LOCKSTEP_GAP_S = 1.5e-3
LOCKSTEP_MATMUL_SIZE = 128
LOCKSTEP_CALLS = 20
# 18 rounds (2.3 s on the 2-core VM): the 128 KiB call's fitted time over six calibrations in a row spread 1.23x
# (1.89-2.33 ms), against 1.89x (1.43-2.70 ms) with 6 rounds, 0.8 s (2026-12-04, interleaved in one world)
LOCKSTEP_ROUNDS = 18
# The two sizes: the per-call latency, and a tensor-parallel activation's order of size (gpt-mini's micro-batch
# of 4 x 64 tokens x 128 channels in float32 is 128 KiB).
LOCKSTEP_SMALL_BYTES = 8
LOCKSTEP_LARGE_BYTES = 2**17


def timed_after_compute(compute: Callable[[], object], collective: Callable[[], object], calls: int) -> list[float]:
    """Seconds of each of ``calls`` ``collective()`` calls, each right after ``compute()`` (not timed)."""
    times = []
    for _ in range(calls):
        compute()
        start = time.perf_counter()
        collective()
        times.append(time.perf_counter() - start)
    return times


def lockstep_matmuls(square: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """Matmuls of ``square`` for about LOCKSTEP_GAP_S, the same number on both ranks (the larger estimate)."""
    for _ in range(20):  # warm-up
        torch.mm(square, square)
    start = time.perf_counter()
    for _ in range(50):
        torch.mm(square, square)
    count = torch.tensor([max(1, round(LOCKSTEP_GAP_S / ((time.perf_counter() - start) / 50)))], dtype=torch.float64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count.item())


def measure_lockstep(device: torch.device, group: dist.ProcessGroup | None = None,
                     rounds: int = LOCKSTEP_ROUNDS) -> dict[str, float]:
    """``{"lockstep_latency": s, "lockstep_bandwidth": B/s}`` on this pair of CPU ranks; ``{}`` on GPUs (their
    kernels run apart from the host threads, and the allreduce link stands)."""
    if device.type != "cpu":
        return {}
    square = torch.randn(LOCKSTEP_MATMUL_SIZE, LOCKSTEP_MATMUL_SIZE)
    count = lockstep_matmuls(square, group)
    buffers = {size: torch.zeros(max(1, size // 4)) for size in (LOCKSTEP_SMALL_BYTES, LOCKSTEP_LARGE_BYTES)}

    def compute() -> None:
        for _ in range(count):
            torch.mm(square, square)

    times: dict[int, list[float]] = {size: [] for size in buffers}
    dist.barrier(group=group)
    warm_up = functools.partial(dist.all_reduce, buffers[LOCKSTEP_SMALL_BYTES], group=group)
    timed_after_compute(compute, warm_up, 3)  # connections, caches
    for _ in range(rounds):  # alternating: both sizes see the same moments of the host's load
        for size, buffer in buffers.items():
            times[size] += timed_after_compute(compute, functools.partial(dist.all_reduce, buffer, group=group),
                                               LOCKSTEP_CALLS)
    # means, not medians: a step pays the sum of its collectives, and on CPU ranks they switch between a fast and
    # a slow regime for several calls at a time (0.6-4.8 ms for the same 128 KiB call, medians seconds apart)
    means = torch.tensor([statistics.fmean(times[size]) for size in buffers], dtype=torch.float64)
    dist.all_reduce(means, group=group)
    small_s, large_s = (float(value) / dist.get_world_size(group) for value in means)
    latency, bandwidth = ring_fit(2, (LOCKSTEP_SMALL_BYTES, small_s), (LOCKSTEP_LARGE_BYTES, large_s), passes=2)
    return {"lockstep_latency": latency, "lockstep_bandwidth": bandwidth}
