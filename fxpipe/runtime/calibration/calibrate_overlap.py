"""What overlapping a gradient allreduce with compute costs on two ranks: how much the compute beside an
allreduce in flight slows down, and how much the allreduce does (:attr:`fxpipe.core.cluster.Cluster.
overlap_compute_slowdown` and ``overlap_comm_slowdown``).

Both ranks (call on both; ``group`` holds just them) time a loop of matmuls alone, an allreduce alone, then
an asynchronous allreduce launched as the loop starts, twice: once with a loop longer than the allreduce
(the allreduce runs beside compute all along: its end, found by polling between matmuls, gives the comm
slowdown) and once with an allreduce longer than the loop (the loop runs beside it all along: the compute
slowdown). Medians of a few repeats, averaged over the two ranks; a few seconds in all.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

OVERLAP_BYTES = 16 * 2**20  # a DDP-sized bucket (25 MiB by default) order of size
OVERLAP_MATMUL_SIZE = 128  # small matmuls: polling between them finds the allreduce's end within ~0.1 ms
OVERLAP_REPEATS = 3


def _matmuls(square: torch.Tensor, count: int) -> float:
    start = time.perf_counter()
    for _ in range(count):
        torch.mm(square, square)
    return time.perf_counter() - start


def _allreduce_alone(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    return time.perf_counter() - start


def _together(square: torch.Tensor, count: int, tensor: torch.Tensor, group: dist.ProcessGroup | None,
              ) -> tuple[float, float]:
    """``(compute seconds, allreduce seconds)`` of ``count`` matmuls run beside one async allreduce."""
    dist.barrier(group=group)
    start = time.perf_counter()
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None
    comm_end = -1.0
    for _ in range(count):
        torch.mm(square, square)
        if comm_end < 0 and work.is_completed():
            comm_end = time.perf_counter()
    compute_end = time.perf_counter()
    work.wait()
    if comm_end < 0:
        comm_end = time.perf_counter()
    return compute_end - start, comm_end - start


def measure_overlap(device: torch.device, group: dist.ProcessGroup | None = None,
                    repeats: int = OVERLAP_REPEATS) -> dict[str, float]:
    """``{"overlap_compute_slowdown", "overlap_comm_slowdown"}`` on this pair of CPU ranks (0 each on GPUs:
    presets carry the published estimate, docs/clusters.md)."""
    if device.type != "cpu":
        return {"overlap_compute_slowdown": 0.0, "overlap_comm_slowdown": 0.0}
    square = torch.randn(OVERLAP_MATMUL_SIZE, OVERLAP_MATMUL_SIZE)
    tensor = torch.zeros(OVERLAP_BYTES // 4)
    _allreduce_alone(tensor, group)  # warm-up: buffers and connections
    _matmuls(square, 20)
    comm_alone = statistics.median(_allreduce_alone(tensor, group) for _ in range(repeats))
    per_matmul = statistics.median(_matmuls(square, 50) / 50 for _ in range(repeats))
    # the allreduce inside a loop three times its length; then a loop a third of the allreduce
    long_count = max(1, round(3 * comm_alone / per_matmul))
    short_count = max(1, round(comm_alone / (3 * per_matmul)))
    comm_beside = statistics.median(_together(square, long_count, tensor, group)[1] for _ in range(repeats))
    compute_beside = statistics.median(_together(square, short_count, tensor, group)[0] for _ in range(repeats))
    compute_alone = statistics.median(_matmuls(square, short_count) for _ in range(repeats))
    figures = torch.tensor([compute_beside / compute_alone - 1, comm_beside / comm_alone - 1], dtype=torch.float64)
    dist.all_reduce(figures, group=group)
    compute, comm = (max(0.0, value / dist.get_world_size(group)) for value in figures.tolist())
    return {"overlap_compute_slowdown": compute, "overlap_comm_slowdown": comm}
