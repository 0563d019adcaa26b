"""Gradient allreduce overlapped with the last backward: bucket readiness and the tail after backward, on numbers.

Legend: the stage's blocks run backward last to first; block k's gradients are final once the last
micro-batch's backward has gone through it. Buckets fill in that order (a bucket closes once it
holds ``bucket_bytes``) and are all-reduced one after another on one channel, each as soon as it is
full and the previous one is done (the runtime launches them in this order on every replica):

    ready_i = backward seconds up to the bucket's last block;  end_i = max(end_{i-1}, ready_i) + AR(bytes_i)

Offsets are relative to the end of the backward: the first bucket starts ``ready_0 - B`` (<= 0),
the tail ``end_last - B`` is what the iteration still waits for. Without buckets the whole
allreduce starts after the backward (tail = AR of all bytes), as DAPPLE's formula charges it. Under
split backward (zero-bubble) the last gradients land in the last W, and buckets fill over W's share
of each block's backward (:func:`last_pass_share`).

Overlap is not free (:attr:`Cluster.overlap_compute_slowdown`, :attr:`Cluster.overlap_comm_slowdown`,
``c`` and ``a``): while a bucket's allreduce is in flight beside the pass, the pass computes at
``1 / (1 + c)`` of its speed and the allreduce moves at ``1 / (1 + a)`` of its own (NCCL's kernels take
SMs and memory bandwidth; gloo's threads take CPU cores). Either alone runs at full speed. The pass then
ends ``stretch`` later (:func:`overlap_offsets`); both offsets stay relative to the end of the
uncontended pass, so the tail ``end`` counts the stretch too (what the pivot model and the planner charge).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from fxpipe.core.cluster import Cluster, LinkSpec
from fxpipe.sim.stagecost import gradient_allreduce_time, split_backward_times
from fxpipe.sim.tensor_parallel_cost import member_param_bytes, tensor_parallel_times

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import CostChain

# DDP's default bucket size (torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25).
DEFAULT_BUCKET_BYTES = 25 * 2**20


def last_pass_share(stage_index: int, split_backward: bool, weight_fraction: float, overhead: float) -> float:
    """The share of a stage's fused backward that its last gradient-producing pass takes, per block: 1 (the
    backward), or under split backward (zero-bubble) W's share (:func:`fxpipe.sim.stagecost.split_backward_times`):
    the runtime arms the buckets at the last W, whose gradients land there; B's gradients (norm scales,
    stage 0's whole backward) are ready as it starts. Stage 0's W is empty: its buckets all launch at once."""
    if not split_backward:
        return 1.0
    return split_backward_times(1.0, stage_index, weight_fraction, overhead)[1]


class Overlap(NamedTuple):
    """A stage's bucketed allreduce against its last gradient pass, in seconds from the end of that pass
    run alone: the first bucket's start (<= 0), the last one's end (the tail, stretch included) and how
    much longer the pass takes beside the buckets (``stretch``; 0 when overlap costs nothing)."""

    start: float
    end: float
    stretch: float = 0.0


def bucket_offsets(backward_s: Sequence[float], param_bytes: Sequence[float], bucket_bytes: int,
                   allreduce_s: Callable[[float], float], compute_slowdown: float = 0.0,
                   comm_slowdown: float = 0.0) -> tuple[float, float]:
    """``(start, end)`` of a stage's bucketed allreduce relative to the end of its last backward run alone.

    ``backward_s``/``param_bytes`` are per block in forward order; ``allreduce_s(bytes)`` is one
    allreduce over the stage's replicas. ``bucket_bytes == 0``: one allreduce after backward.
    The slowdowns are what overlap costs (:func:`overlap_offsets`).
    """
    overlap = overlap_offsets(backward_s, param_bytes, bucket_bytes, allreduce_s, compute_slowdown, comm_slowdown)
    return overlap.start, overlap.end


def overlap_offsets(backward_s: Sequence[float], param_bytes: Sequence[float], bucket_bytes: int,
                    allreduce_s: Callable[[float], float], compute_slowdown: float = 0.0,
                    comm_slowdown: float = 0.0) -> Overlap:
    """:func:`bucket_offsets` with the pass's stretch: an exact two-party fluid schedule (module docstring)."""
    total_bytes = sum(param_bytes)
    if total_bytes <= 0 or allreduce_s(total_bytes) <= 0:
        return Overlap(0.0, 0.0)
    if bucket_bytes <= 0:
        return Overlap(0.0, allreduce_s(total_bytes))
    buckets = bucket_readiness(backward_s, param_bytes, bucket_bytes)
    if compute_slowdown <= 0 and comm_slowdown <= 0:
        total_s = sum(backward_s)
        end = float("-inf")
        for ready, num_bytes in buckets:
            end = max(end, ready) + allreduce_s(num_bytes)
        return Overlap(buckets[0][0] - total_s, end - total_s)
    pass_s = buckets[-1][0]  # the last bucket closes with the pass
    pass_end, end = contended_schedule([(ready, allreduce_s(num_bytes)) for ready, num_bytes in buckets],
                                       pass_s, 1.0 + compute_slowdown, 1.0 + comm_slowdown)
    return Overlap(buckets[0][0] - pass_s, end - pass_s, pass_end - pass_s)


def contended_schedule(buckets: Sequence[tuple[float, float]], pass_s: float, compute_stretch: float,
                       comm_stretch: float) -> tuple[float, float]:
    """``(when the pass ends, when the last bucket ends)``, wall seconds from the pass's start.

    ``buckets`` are ``(compute seconds into the pass when full, allreduce seconds alone)`` in launch
    order, run one after another. While both run, compute takes ``compute_stretch`` and the allreduce
    ``comm_stretch`` times as long; alone, each its own time.
    """
    now = done = 0.0  # wall clock; seconds of the pass computed (as if alone)
    pass_end = 0.0 if pass_s <= 0 else -1.0
    for ready, left in buckets:
        if done < ready:  # the pass alone until the bucket is full
            now, done = now + ready - done, ready
            if done >= pass_s:
                pass_end = now
        if done < pass_s and left > 0:  # both until the first of them ends
            compute_wall, comm_wall = (pass_s - done) * compute_stretch, left * comm_stretch
            if comm_wall < compute_wall:
                now, done, left = now + comm_wall, done + comm_wall / compute_stretch, 0.0
            else:
                now, done, left = now + compute_wall, pass_s, left - compute_wall / comm_stretch
                pass_end = now
        now += left  # the allreduce alone
    if pass_end < 0:  # no bucket was left to overlap the pass's end
        pass_end = now + pass_s - done
    return pass_end, max(now, pass_end)


def bucket_readiness(backward_s: Sequence[float], param_bytes: Sequence[float], bucket_bytes: int,
                     ) -> list[tuple[float, float]]:
    """``(seconds into the last backward when the bucket is full, bytes)`` per bucket, in launch order.

    Blocks are given in forward order; a bucket closes once it holds ``bucket_bytes`` (as
    :func:`fxpipe.runtime.gradients.buckets.make_buckets` does with parameters).
    """
    buckets: list[tuple[float, float]] = []
    elapsed = filled = 0.0
    for seconds, num_bytes in zip(reversed(backward_s), reversed(param_bytes), strict=True):
        elapsed += seconds
        filled += num_bytes
        if filled >= bucket_bytes:
            buckets.append((elapsed, filled))
            filled = 0.0
    if filled > 0:
        buckets.append((elapsed, filled))
    return buckets


def stage_allreduce_offsets(chain: CostChain, cluster: Cluster, first: int, stop: int, devices: Sequence[int],
                            rows: int, own_bytes: float, bucket_bytes: int, window_share: float = 1.0,
                            tensor_parallel: int = 1, link: LinkSpec | None = None) -> tuple[float, float]:
    """``(start, end)`` of :func:`stage_allreduce_overlap`: the tail ``end`` counts the pass's stretch."""
    overlap = stage_allreduce_overlap(chain, cluster, first, stop, devices, rows, own_bytes, bucket_bytes,
                                      window_share, tensor_parallel, link)
    return overlap.start, overlap.end


def stage_allreduce_overlap(chain: CostChain, cluster: Cluster, first: int, stop: int, devices: Sequence[int],
                            rows: int, own_bytes: float, bucket_bytes: int, window_share: float = 1.0,
                            tensor_parallel: int = 1, link: LinkSpec | None = None) -> Overlap:
    """:func:`overlap_offsets` of blocks ``[first, stop)`` on ``devices`` for a slice of ``rows`` rows,
    with the cluster's overlap slowdowns.

    ``own_bytes`` is what the stage's replica allreduce carries (tied parameters left out, see
    :func:`fxpipe.stagecost.allreduce_times`); block bytes are scaled to add up to it. The buckets fill
    over ``window_share`` of each block's backward (:func:`last_pass_share`). A stage of ``tensor_parallel``-way
    groups fills them over one member's backward of each block with its bytes (``devices``: one per replica).
    """
    blocks = chain.blocks[first:stop]
    if tensor_parallel > 1:
        backward = [tensor_parallel_times(chain, cluster, index, index + 1, rows, tensor_parallel,
                                          cluster.compute_slowdown)[1] * window_share for index in range(first, stop)]
        block_bytes = [member_param_bytes(block, tensor_parallel) for block in blocks]
    else:
        backward = [block.backward_s.at(rows) * cluster.compute_slowdown * window_share for block in blocks]
        block_bytes = [float(block.param_bytes) for block in blocks]
    held = sum(block_bytes)
    scale = own_bytes / held if held > 0 else 0.0
    link = link or cluster.collective_link(devices)  # once for every bucket size (``link``: the caller has it)
    return overlap_offsets(backward, [num_bytes * scale for num_bytes in block_bytes], bucket_bytes,
                           lambda num_bytes: gradient_allreduce_time(cluster, num_bytes, devices, link),
                           cluster.overlap_compute_slowdown, cluster.overlap_comm_slowdown)
