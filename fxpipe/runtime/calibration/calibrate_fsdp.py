"""FSDP2's own host time per collective: a model of small units run sharded and whole, less its bare collectives.

Each FSDP2 unit of a ZeRO-3 step all-gathers its weights before its forward and again before its backward and
reduce-scatters its gradients after it; around each call FSDP2 copies into and out of flat buffers, allocates
and frees them and runs its hooks in Python. On CPU ranks that costs milliseconds per call, more than the
collective itself (benchmarks/sharding_fidelity.md). Both ranks (call on both; ``group`` holds just them) time
the forward and backward of ``FSDP_UNITS`` small linear layers, whole and each ``fully_shard``-ed, and the same
number of back-to-back 8-byte all-reduces (the collectives' own latency, which the links already charge); the
overhead per call is (sharded - whole - all-reduces) / calls, averaged over the two ranks, median of
``FSDP_REPEATS``, >= 0. :func:`fxpipe.sim.sharding_cost.sharding_comm` adds it to every all-gather and
reduce-scatter of a sharded stage.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

FSDP_UNITS, FSDP_WIDTH, FSDP_ROWS, FSDP_REPEATS = 8, 64, 8, 7
# per unit and step under reshard-after-forward: an all-gather in forward, one in backward, a reduce-scatter
CALLS_PER_UNIT = 3


def fsdp_call_overhead(sharded_s: float, whole_s: float, collectives_s: float, num_calls: int) -> float:
    """Seconds per call: (sharded - whole - collectives) / calls, never negative."""
    if num_calls < 1:
        raise ValueError(f"the sharded step must make collectives; got {num_calls} calls")
    return max(0.0, (sharded_s - whole_s - collectives_s) / num_calls)


def _median_s(call: Callable[[], object], group: dist.ProcessGroup | None) -> float:
    times = []
    for _ in range(FSDP_REPEATS + 2):
        dist.barrier(group=group)
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])  # the first calls allocate FSDP2's buffers


def measure_fsdp_overhead(device: torch.device, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """``{"fsdp_call_overhead": seconds}`` on this pair of ranks (0 off CPU: FSDP2's copies run on the GPU's
    streams, beside its Python; not measured there)."""
    if device.type != "cpu":
        return {"fsdp_call_overhead": 0.0}
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(*(torch.nn.Linear(FSDP_WIDTH, FSDP_WIDTH) for _ in range(FSDP_UNITS)))

    whole, sharded = build(), build()
    mesh = DeviceMesh.from_group(group if group is not None else dist.distributed_c10d._get_default_group(), "cpu")
    for layer in sharded:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(sharded, mesh=mesh)  # the root, as the runtime wraps a stage: no parameters of its own
    inputs, tiny = torch.randn(FSDP_ROWS, FSDP_WIDTH), torch.zeros(2)
    num_calls = CALLS_PER_UNIT * FSDP_UNITS

    def allreduces() -> None:
        for _ in range(num_calls):
            dist.all_reduce(tiny, group=group)

    overhead = fsdp_call_overhead(_median_s(lambda: sharded(inputs).sum().backward(), group),
                                  _median_s(lambda: whole(inputs).sum().backward(), group),
                                  _median_s(allreduces, group), num_calls)
    mine = torch.tensor([overhead], dtype=torch.float64)
    dist.all_reduce(mine, group=group)
    return {"fsdp_call_overhead": float(mine.item()) / dist.get_world_size(group)}
