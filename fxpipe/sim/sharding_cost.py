"""A sharded stage's communication per step (ZeRO-1/2/3 over its replica group), on plain numbers.

The one place that says when a stage's reduce-scatters and all-gathers run and how long they take; the
simulator (:mod:`fxpipe.sim.simulate`), the pivot model (:mod:`fxpipe.passes.partition.latency`) and the
planner's candidates all charge these terms. Legend: W the weight bytes the stage holds (tied copies
included), G the gradient bytes it sums over its replicas (tied ones left out: they keep their own tie
allreduce), RS(x) and AG(x) a ring reduce-scatter and all-gather of x bytes over the stage's devices,
M micro-batches:

    level        before first forward   each forward   each backward     after last backward
    none         -                      -              -                 AR(G), bucketed (allreduce_overlap)
    (each of AG and RS runs once per FSDP unit, on its share of the bytes: one unit per chain block holding parameters)
    optimizer    AG(W)                  -              P                 RS(G) - P
    gradients    AG(W)                  -              RS(G)             -
    parameters   -                      AG(W)          AG(W) + RS(G)     -

P is FSDP2's host time of every unit's forward and backward without a collective (``FsdpCallCost.pass_seconds``,
calibrated on CPU ranks, 0 elsewhere): ZeRO-1 runs its hooks and accumulates unsynced gradients every micro-batch,
and the last one's are already in the reduce-scatter's per-call figure. Under split backward (zero-bubble) "each
backward" is each W, which the reduce-scatter follows at runtime
(:meth:`fxpipe.runtime.parallel.sharded_stage.ShardedStage.after_weights`); ZeRO-3 never runs split.

Each of RS and AG moves (r-1)/r of the bytes per device, half a ring allreduce (:meth:`Cluster.allreduce_time`),
with half its copies into and out of the flat buffer, plus FSDP2's own host time per call
(:attr:`Cluster.fsdp_calls`: its buffers and hooks, per kind and by the unit's bytes, calibrated on CPU ranks;
none on presets), on its own link: within a host, the figures calibration
measured for that collective (:attr:`Cluster.reduce_scatter_collective`, :attr:`Cluster.all_gather_collective`;
gloo's reduce-scatter takes longer than a whole allreduce), else the allreduce's, where RS(x) + AG(x) is
exactly :func:`fxpipe.sim.stagecost.gradient_allreduce_time` of x. The per-micro-batch collectives of
``gradients``/``parameters`` are charged as what FSDP2's prefetch leaves exposed beside each unit's compute
(:mod:`fxpipe.sim.unit_overlap`) where the cluster's devices overlap them (GPUs), whole on CPU ranks (FSDP2 blocks
on gloo). The step's all-gather of ``optimizer``/``gradients`` (the weights updated by the last step's shards)
delays the stage's first forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from fxpipe.core.cluster import Cluster, LinkSpec
from fxpipe.core.fsdp_calls import call_seconds
from fxpipe.core.interleaved_schedules import SPLIT_BACKWARD_SCHEDULES
from fxpipe.core.plan import Plan
from fxpipe.core.row_slices import split_rows
from fxpipe.core.sharding import check_level
from fxpipe.sim.stagecost import (
    gradient_allreduce_time,
    num_units,
    own_allreduce_bytes,
    replica_leads,
    stage_param_bytes,
)
from fxpipe.sim.unit_overlap import UnitCompute, exposed_backward, exposed_forward, unit_compute

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import CostChain



class ShardingComm(NamedTuple):
    """A stage's sharding collectives in seconds: before its first forward of the step, added to every
    forward and every backward of a micro-batch, and after its last backward (replacing the allreduce)."""

    start_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    tail_s: float = 0.0

    def step_seconds(self, num_microbatches: int) -> float:
        """Every collective of one step, one after another."""
        return self.start_s + num_microbatches * (self.forward_s + self.backward_s) + self.tail_s


NO_SHARDING = ShardingComm()


def half_collective_time(cluster: Cluster, num_bytes: float, devices: Sequence[int],
                         link: LinkSpec | None = None) -> float:
    """A ring reduce-scatter or all-gather of ``num_bytes`` over ``devices``: half a gradient allreduce on
    ``link`` (the collective's own, :meth:`Cluster.collective_link` with its kind; default the allreduce's)."""
    return gradient_allreduce_time(cluster, num_bytes, devices, link) / 2.0


def sharding_comm(cluster: Cluster, sharding: str, devices: Sequence[int], weight_bytes: float,
                  gradient_bytes: float, num_units: int = 1, reshard_after_forward: bool | None = None,
                  param_copy_fraction: float = 0.0, compute: UnitCompute | None = None) -> ShardingComm:
    """The module docstring's table for one stage; :data:`NO_SHARDING` for ``"none"`` (its allreduce is
    :mod:`fxpipe.sim.allreduce_overlap`'s) and for one device. ``num_units``: the stage's FSDP units, each
    gathered and reduced by its own collective of its share of the bytes (taken as equal shares: the bytes
    move once either way, and each collective pays its own latency). A ZeRO-3 stage whose plan keeps the
    weights from forward to backward (``reshard_after_forward`` false) gathers them in the forward only.
    ``param_copy_fraction``: bf16-params gathers bf16 copies, that fraction of the fp32 ``weight_bytes``.
    ``compute``: a micro-batch's compute per unit, to overlap the per-micro-batch collectives with
    (:mod:`fxpipe.sim.unit_overlap`: what they leave exposed); None charges them whole."""
    check_level(sharding)
    if sharding == "none" or len(devices) <= 1:
        return NO_SHARDING
    gathered = weight_bytes * (param_copy_fraction or 1.0)  # bf16-params gathers bf16 copies
    gather = unit_collectives(cluster, gathered, devices, num_units, "all_gather")
    scatter = unit_collectives(cluster, gradient_bytes, devices, num_units, "reduce_scatter")
    if sharding == "optimizer":  # each micro-batch's hooks; the last one's are in the reduce-scatter's figure
        passes = unit_passes(cluster, gradient_bytes, num_units)
        return ShardingComm(start_s=gather, backward_s=passes, tail_s=max(0.0, scatter - passes))
    if sharding == "gradients":
        return ShardingComm(start_s=gather, backward_s=scatter if compute is None else
                            exposed_backward(0.0, scatter, compute, cluster))
    again = 0.0 if reshard_after_forward is False else gather  # ZeRO-3 gathers again for backward unless kept
    if compute is None:
        return ShardingComm(forward_s=gather, backward_s=again + scatter)
    return ShardingComm(forward_s=exposed_forward(gather, compute, cluster),
                        backward_s=exposed_backward(again, scatter, compute, cluster))


def unit_collectives(cluster: Cluster, num_bytes: float, devices: Sequence[int], num_units: int, kind: str) -> float:
    """One ``kind`` collective per FSDP unit over ``devices``, each of its share of ``num_bytes`` on the kind's
    link, plus FSDP2's host time around the call (:func:`fxpipe.core.fsdp_calls.call_seconds`: per kind and by
    the unit's bytes where calibration fitted it, else the cluster's flat figure); 0 when nothing moves."""
    if num_bytes <= 0:
        return 0.0
    units = max(1, num_units)
    link = cluster.collective_link(devices, kind)
    host_s = call_seconds(cluster.fsdp_calls, cluster.fsdp_call_overhead_s, kind, num_bytes / units)
    return units * (half_collective_time(cluster, num_bytes / units, devices, link) + host_s)


def unit_passes(cluster: Cluster, num_bytes: float, num_units: int) -> float:
    """FSDP2's host time of one micro-batch's forward and backward without a collective, over the units sharing
    ``num_bytes`` (:meth:`fxpipe.core.fsdp_calls.FsdpCallCost.pass_seconds` per unit); 0 without a fit (flat per-call
    figures and presets charge calls only) or bytes."""
    if num_bytes <= 0 or cluster.fsdp_calls is None:
        return 0.0
    units = max(1, num_units)
    return units * cluster.fsdp_calls.pass_seconds(num_bytes / units)


def start_delay(step_start_s: Sequence[float], arrival_s: Sequence[float]) -> float:
    """How much the pipeline's fill is delayed by stages waiting for their step's all-gather: stage s
    starts its first forward at its all-gather's end or when its first input arrives (``arrival_s[s]``,
    the forwards and transfers before it), whichever is later; the pivot model adds the largest wait."""
    return max((max(0.0, start - arrival) for start, arrival in zip(step_start_s, arrival_s, strict=True)),
               default=0.0)


def plan_sharding_comms(plan: Plan, chain: CostChain, cluster: Cluster) -> list[ShardingComm]:
    """:func:`sharding_comm` of every stage of ``plan`` (its weights held, its own gradient bytes); a stage of
    tensor-parallel groups shards one member's bytes over its replicas (one device per replica)."""
    if all(stage.sharding == "none" for stage in plan.stages):
        return [NO_SHARDING] * plan.num_stages
    bounds = [(stage.first_block, stage.stop_block) for stage in plan.stages]
    degrees = [stage.tensor_parallel for stage in plan.stages]
    own = own_allreduce_bytes(chain, bounds, tensor_parallel=degrees)
    return [span_sharding_comm(chain, cluster, first, stop, stage.sharding,
                               replica_leads(stage.devices, stage.tensor_parallel), own_bytes, plan.schedule,
                               plan.microbatch_size, stage.tensor_parallel, stage.reshard_after_forward)
            for stage, (first, stop), own_bytes in zip(plan.stages, bounds, own, strict=True)]


def span_sharding_comm(chain: CostChain, cluster: Cluster, first: int, stop: int, sharding: str, devices: Sequence[int],
                       gradient_bytes: float, schedule: str, rows: float | None, tensor_parallel: int = 1,
                       reshard_after_forward: bool | None = None, weight_bytes: float | None = None) -> ShardingComm:
    """:func:`sharding_comm` of a stage over blocks ``[first, stop)`` on ``devices`` (one per replica) under
    ``schedule``, on micro-batches of ``rows`` rows (:func:`stage_compute`), its units' collectives overlapping
    their compute; ``weight_bytes`` default: what the stage holds (:func:`stage_param_bytes`)."""
    weights = stage_param_bytes(chain, first, stop, tensor_parallel) if weight_bytes is None else weight_bytes
    return sharding_comm(cluster, sharding, devices, weights, gradient_bytes, num_units(chain, first, stop),
                         reshard_after_forward, chain.param_copy_fraction,
                         stage_compute(chain, cluster, first, stop, sharding, schedule, rows, len(devices),
                                       tensor_parallel))


def stage_compute(chain: CostChain, cluster: Cluster, first: int, stop: int, sharding: str, schedule: str,
                  rows: float | None, replicas: int, tensor_parallel: int = 1) -> UnitCompute | None:
    """:func:`fxpipe.sim.unit_overlap.unit_compute` of a stage at ``sharding`` under ``schedule`` on the largest of its
    ``replicas`` slices of a micro-batch of ``rows`` rows (``float("inf")``: unbounded compute, the least exposed
    time; None: no compute given, the collectives whole): None where nothing overlaps per micro-batch (ZeRO-0/1, and
    ZeRO-2 under a split backward, whose reduce-scatter follows W whole at runtime)."""
    if sharding in ("none", "optimizer") or (sharding == "gradients" and schedule in SPLIT_BACKWARD_SCHEDULES):
        return None
    largest = rows if rows is None or math.isinf(rows) else max(split_rows(int(rows), replicas))
    return unit_compute(chain, cluster, first, stop, largest, tensor_parallel)
