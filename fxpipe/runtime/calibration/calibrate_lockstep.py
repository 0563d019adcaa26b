"""How long ranks in lock-step wait for each other: compute between small all-reduces, against compute alone.

A tensor-parallel group (and a ZeRO-3 stage) meets its peers at every collective, a few milliseconds of compute
apart. Where ranks share cores with other work (CPU ranks on a busy host), each member is descheduled now and then;
alone it loses that time once, in lock-step every peer waits for it too. Both ranks (call on both; ``group``
holds just them) time ``LOCKSTEP_CALLS`` rounds of [matmuls for about ``LOCKSTEP_GAP_S``; an all-reduce of 8 bytes],
the same all-reduces back to back, and the same matmuls without collectives (both ranks computing, so sharing
cores counts in both). The wait fraction is what the lock-step loop takes beyond the other two, over the
compute: (loop - all-reduces - compute) / compute, averaged over the two ranks, median of a few repeats, >= 0.
:func:`fxpipe.sim.tensor_parallel_cost.tensor_parallel_times` charges a T-way group (T - 1) times it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

# A tensor-parallel stage's compute between two collectives on these CPU ranks (gpt-mini 1x2: 38 collectives in
# about 70 ms of compute per step, benchmarks/tp_fidelity_terms.md); small matmuls keep the gap close to it.
LOCKSTEP_GAP_S = 1.5e-3
LOCKSTEP_MATMUL_SIZE = 128
LOCKSTEP_CALLS = 30
LOCKSTEP_REPEATS = 3


def _loop(square: torch.Tensor, count: int, tiny: torch.Tensor | None, group: dist.ProcessGroup | None) -> float:
    """Seconds of LOCKSTEP_CALLS rounds of ``count`` matmuls, each followed by an all-reduce of ``tiny`` (None: none)."""
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(LOCKSTEP_CALLS):
        for _ in range(count):
            torch.mm(square, square)
        if tiny is not None:
            dist.all_reduce(tiny, group=group)
    return time.perf_counter() - start


def lockstep_wait(loop_s: float, allreduces_s: float, compute_s: float) -> float:
    """The wait fraction of one repeat: (loop - all-reduces - compute) / compute, never negative."""
    if compute_s <= 0:
        raise ValueError(f"the compute alone must take some time; got {compute_s} s")
    return max(0.0, (loop_s - allreduces_s - compute_s) / compute_s)


def measure_lockstep(device: torch.device, group: dist.ProcessGroup | None = None,
                     repeats: int = LOCKSTEP_REPEATS) -> dict[str, float]:
    """``{"lockstep_wait_fraction": w}`` on this pair of CPU ranks (0 on GPUs: their kernels do not share cores)."""
    if device.type != "cpu":
        return {"lockstep_wait_fraction": 0.0}
    square = torch.randn(LOCKSTEP_MATMUL_SIZE, LOCKSTEP_MATMUL_SIZE)
    tiny = torch.zeros(2)
    _loop(square, 5, tiny, group)  # warm-up: connections, caches
    start = time.perf_counter()
    for _ in range(50):
        torch.mm(square, square)
    count = max(1, round(LOCKSTEP_GAP_S / ((time.perf_counter() - start) / 50)))
    # one figure for both ranks: each must run the same number of matmuls, or the loops would not pair up
    agreed = torch.tensor([count], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    count = int(agreed.item())
    waits = []
    for _ in range(repeats):
        loop_s = _loop(square, count, tiny, group)
        allreduces_s = _loop(square, 0, tiny, group)
        compute_s = _loop(square, count, None, group)
        waits.append(lockstep_wait(loop_s, allreduces_s, compute_s))
    mine = torch.tensor([statistics.median(waits)], dtype=torch.float64)
    dist.all_reduce(mine, group=group)
    return {"lockstep_wait_fraction": float(mine.item()) / dist.get_world_size(group)}
