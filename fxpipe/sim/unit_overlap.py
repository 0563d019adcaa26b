"""How much of a ZeRO-2/3 stage's per-unit collectives a micro-batch's forward and backward leave exposed, on numbers.

The runtime shards a stage one FSDP unit per chain block holding parameters and prefetches the next unit: forward,
unit u+1's all-gather is issued as unit u starts computing; backward (last unit first), the previous unit's
all-gather as a unit starts, and each unit's reduce-scatter as it ends (:mod:`fxpipe.runtime.parallel.sharded_stage`).
Legend, per micro-batch on one replica: U segments in forward order, segment u the compute from unit u's block up to
the next unit's (blocks without parameters join the unit before them; those before the first unit run alone);
f_u / b_u its forward / backward seconds; g, s one unit's all-gather / reduce-scatter (equal shares, as
:func:`fxpipe.sim.sharding_cost.unit_collectives` charges them); wall(x, comms) the wall time of x seconds of compute
beside ``comms`` run one after another, with the cluster's overlap slowdowns
(:func:`fxpipe.sim.allreduce_overlap.contended_schedule`: compute at 1/(1+c) and the link at 1/(1+a) while both run):

    forward exposed  = g + sum_{u < U-1} (wall(f_u, [g]) - f_u)
    backward exposed = g' + sum_k (wall(b_k, [s if k > 0] + [g' if k < U-1]) - b_k) + s     (k: backward order)

with g' = g where ZeRO-3 gathers again for backward (reshard after forward) and 0 where it keeps the forward's
weights or the level is ZeRO-2 (whose reduce-scatters overlap the same way). The last unit's reduce-scatter ends the
backward. With U = 1, or on a cluster where the collectives do not run beside compute, both are the whole charge.

Whether they run beside compute is the cluster's (:func:`prefetch_overlaps`): GPU devices run FSDP2's all-gathers and
reduce-scatters on their own streams; on CPU devices FSDP2 issues them with ``async_op`` false (its
``unshard_async_op`` default), so gloo blocks the caller until each ends and nothing overlaps
(``benchmarks/fsdp_prefetch_ab.py`` measured prefetch on against off on gloo ranks: no gain).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from fxpipe.core.cluster import Cluster
from fxpipe.sim.allreduce_overlap import contended_schedule
from fxpipe.sim.tensor_parallel_cost import tensor_parallel_times

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import CostChain


class UnitCompute(NamedTuple):
    """A micro-batch's compute per segment (module docstring), forward order, in seconds."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]


def prefetch_overlaps(cluster: Cluster) -> bool:
    """Whether a sharded stage's per-unit collectives run beside its compute on ``cluster``'s devices: not on CPU
    ranks (:func:`fxpipe.core.hardware.cpu_device` names them ``CPU``; FSDP2 blocks on gloo), on every other device."""
    return not cluster.device.name.upper().startswith("CPU")


def unit_compute(chain: CostChain, cluster: Cluster, first: int, stop: int, rows: float | None,
                 tensor_parallel: int = 1) -> UnitCompute | None:
    """The segments of blocks ``[first, stop)`` on a slice of ``rows`` rows (one group member's share with
    ``tensor_parallel``), at the cluster's compute stretch; ``math.inf`` rows: unbounded compute (a lower bound on
    what is exposed). None when nothing can overlap: no ``rows`` (the caller has no compute to set against the
    collectives), a cluster whose collectives block (:func:`prefetch_overlaps`) or fewer than two segments."""
    if rows is None or not prefetch_overlaps(cluster):
        return None
    forward: list[float] = []
    backward: list[float] = []
    for index in range(first, stop):
        if math.isinf(rows):
            forward_s = backward_s = math.inf
        else:
            forward_s, backward_s = tensor_parallel_times(chain, cluster, index, index + 1, rows, tensor_parallel,
                                                          cluster.compute_slowdown)
        if chain.blocks[index].param_bytes > 0:
            forward.append(forward_s)
            backward.append(backward_s)
        elif forward:  # a block without parameters runs inside the unit before it
            forward[-1] += forward_s
            backward[-1] += backward_s
    return UnitCompute(tuple(forward), tuple(backward)) if len(forward) >= 2 else None


def beside(compute_s: float, comms_s: Sequence[float], cluster: Cluster) -> float:
    """What ``compute_s`` of compute with ``comms_s`` in flight beside it (one after another) takes beyond the
    compute alone: wall(x, comms) - x of the module docstring (0 for unbounded compute)."""
    comms = [(0.0, seconds) for seconds in comms_s if seconds > 0]
    if not comms or math.isinf(compute_s):
        return 0.0
    _, end = contended_schedule(comms, compute_s, 1.0 + cluster.overlap_compute_slowdown,
                                1.0 + cluster.overlap_comm_slowdown)
    return end - compute_s


def exposed_forward(gather_s: float, compute: UnitCompute, cluster: Cluster) -> float:
    """The forward's exposed all-gather seconds (module docstring), ``gather_s`` all the stage's units' together."""
    if gather_s <= 0:
        return 0.0
    one = gather_s / len(compute.forward_s)
    return one + sum(beside(forward_s, (one,), cluster) for forward_s in compute.forward_s[:-1])


def exposed_backward(gather_s: float, scatter_s: float, compute: UnitCompute, cluster: Cluster) -> float:
    """The backward's exposed collectives (module docstring): ``gather_s`` the units' all-gathers for backward
    (0 when it keeps the forward's weights), ``scatter_s`` their reduce-scatters, all units together."""
    count = len(compute.backward_s)
    gather, scatter = gather_s / count, scatter_s / count
    exposed = gather + scatter
    for k, backward_s in enumerate(reversed(compute.backward_s)):
        exposed += beside(backward_s, (scatter if k > 0 else 0.0, gather if k < count - 1 else 0.0), cluster)
    return exposed
