"""Per-stage costs on plain numbers: compute, memory, transfers and allreduce, shared by planner and simulator."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxpipe.core.block_sums import block_sums
from fxpipe.core.chain import block_units, merged_units
from fxpipe.core.cluster import Cluster, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.row_slices import shared_rows, split_rows
from fxpipe.sim.recompute_cost import SelectiveRecompute, selective_seconds
from fxpipe.sim.sharding_memory import model_state_bytes
from fxpipe.sim.tensor_parallel_cost import (
    split_backward_collectives,
    tensor_parallel_param_bytes,
    tensor_parallel_saved,
    tensor_parallel_times,
)

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import CostChain
    from fxpipe.core.plan import StagePlan

# What the allreduce ending every step carries (fxpipe.runtime.execution.driver._broadcast_loss): float64 loss sum,
# token count, preemption vote and four batch-check folds.
STEP_END_SYNC_BYTES = 7 * 8
# Bytes kept per parameter byte: weights + gradients (+ optimizer state).
OPTIMIZER_STATE_FACTORS: dict[str, float] = {"sgd": 2.0, "momentum": 3.0, "adam": 4.0, "adamw": 4.0}


def optimizer_factor(name: str) -> float:
    key = name.lower()
    if key not in OPTIMIZER_STATE_FACTORS:
        raise ValueError(f"optimizer {name!r} is unknown; choose one of {sorted(OPTIMIZER_STATE_FACTORS)}")
    return OPTIMIZER_STATE_FACTORS[key]


@dataclass(frozen=True)
class StageCost:
    """One stage replica's costs for one micro-batch slice of ``rows`` rows (the largest slice)."""

    rows: int
    forward_s: float
    backward_s: float
    param_bytes: int
    # saved for backward, one slice (the loss's too on the last stage; received values an earlier stage
    # saved too included: :func:`resaved_bytes`)
    activation_bytes: float
    input_bytes: float  # activations received for one slice (0 for stage 0 except data)
    output_bytes: float  # activations sent for one slice (0 for the last stage)
    loss_bytes: float = 0.0  # of activation_bytes, what the loss saves (last stage): kept even when recomputing
    # of activation_bytes, the model's inputs (stage 0) and targets (last stage) saved: views of the global
    # batch, for one slice and for a whole micro-batch (every replica's rows)
    batch_view_bytes: float = 0.0
    microbatch_view_bytes: float = 0.0
    # the largest block's parameter bytes: a sharded stage's largest FSDP unit (0: one block, the whole stage)
    unit_bytes: float = 0.0
    param_copy_fraction: float = 0.0  # CostChain.param_copy_fraction: bf16 compute copies of the fp32 weights


def _block_sum(chain: CostChain, first: int, stop: int, field: str) -> Affine:
    """``Affine.total`` of the field over ``chain.blocks[first:stop]``, memoised (:mod:`fxpipe.core.block_sums`)."""
    return block_sums(chain).total(first, stop, field)


def compute_times(chain: CostChain, first: int, stop: int, rows: int, slowdown: float = 1.0, *,
                  recompute: bool = False, tensor_parallel: int = 1,
                  cluster: Cluster | None = None, block_recompute: Sequence[str] = ()) -> tuple[float, float]:
    """Forward and backward seconds of blocks ``[first, stop)`` on a slice of ``rows`` batch rows.

    ``slowdown`` stretches the chain's times (:attr:`Cluster.compute_slowdown`: ranks sharing cores);
    with ``recompute`` the backward includes the forward run again (:func:`backward_seconds`). A replica that
    is a ``tensor_parallel``-way group (T > 1, ``cluster`` given for its links) takes one member's time
    (:mod:`fxpipe.sim.tensor_parallel_cost`). Per-block ``block_recompute`` choices add the forward they rerun
    (:func:`fxpipe.sim.recompute_cost.selective_figures`).
    """
    extra_s = selective_seconds(chain, first, block_recompute, rows, slowdown, tensor_parallel, cluster)
    if tensor_parallel > 1:
        assert cluster is not None, "a tensor-parallel stage's collectives need the cluster's links"
        forward_s, backward_s = tensor_parallel_times(chain, cluster, first, stop, rows, tensor_parallel, slowdown)
        return forward_s, backward_seconds(forward_s, backward_s, recompute) + extra_s
    forward_s = _block_sum(chain, first, stop, "forward_s").at(rows) * slowdown
    backward_s = _block_sum(chain, first, stop, "backward_s").at(rows) * slowdown
    return forward_s, backward_seconds(forward_s, backward_s, recompute) + extra_s


def message_seconds(cluster: Cluster, microbatch_rows: int, replicas: Sequence[int], stage_index: int) -> float:
    """The busiest replica's own time per micro-batch for the messages of one direction (forward or backward).

    ``replicas`` are every stage's replica counts; a replica sends one message per receiving replica
    it shares rows with and receives one per sender (:func:`shared_rows`), each costing
    :attr:`Cluster.message_overhead_s`, stretched like compute on shared cores.
    """
    if cluster.message_overhead_s <= 0:
        return 0.0
    counts = [0] * replicas[stage_index]
    if stage_index > 0:
        for _, j, _, _ in shared_rows(microbatch_rows, replicas[stage_index - 1], replicas[stage_index]):
            counts[j] += 1
    if stage_index < len(replicas) - 1:
        for i, _, _, _ in shared_rows(microbatch_rows, replicas[stage_index], replicas[stage_index + 1]):
            counts[i] += 1
    return cluster.message_overhead_s * cluster.compute_slowdown * max(counts)


def stage_cost(chain: CostChain, first: int, stop: int, microbatch_rows: int, replicas: int,
               slowdown: float = 1.0, *, tensor_parallel: int = 1, cluster: Cluster | None = None) -> StageCost:
    """Costs of blocks ``[first, stop)`` run on ``replicas`` replicas, each taking its slice of a micro-batch.

    ``slowdown`` stretches compute as in :func:`compute_times`. A replica that is a ``tensor_parallel``-way
    group (``cluster`` given for its links) costs one member: its time, parameter and saved bytes split as
    :mod:`fxpipe.sim.tensor_parallel_cost` says; received and sent values stay whole.
    """
    rows = max(split_rows(microbatch_rows, replicas))
    input_bytes = chain.input_bytes if first == 0 else chain.cut_bytes[first - 1]
    output_bytes = chain.output_bytes if stop == chain.num_blocks else chain.cut_bytes[stop - 1]
    forward_s, backward_s = compute_times(chain, first, stop, rows, slowdown, tensor_parallel=tensor_parallel,
                                          cluster=cluster)
    saved = (_block_sum(chain, first, stop, "saved_bytes") if tensor_parallel == 1
             else tensor_parallel_saved(chain, first, stop, tensor_parallel))
    return StageCost(
        rows=rows,
        forward_s=forward_s,
        backward_s=backward_s,
        param_bytes=stage_param_bytes(chain, first, stop, tensor_parallel),
        activation_bytes=(saved + resaved_bytes(chain, first, stop)).at(rows),
        input_bytes=0.0 if first == 0 else input_bytes.at(rows),
        output_bytes=0.0 if stop == chain.num_blocks else output_bytes.at(rows),
        loss_bytes=chain.loss_saved_bytes.at(rows) if stop == chain.num_blocks else 0.0,
        batch_view_bytes=_batch_views(chain, first, stop).at(rows),
        microbatch_view_bytes=_batch_views(chain, first, stop).at(microbatch_rows),
        unit_bytes=largest_unit_bytes(chain, first, stop),
        param_copy_fraction=chain.param_copy_fraction,
    )


def stage_unit_bytes(chain: CostChain, first: int, stop: int) -> list[int]:
    """Parameter bytes of each FSDP unit of a sharded stage over blocks ``[first, stop)``: the blocks' units
    (:attr:`fxpipe.core.chain.Block.units`, module paths as the runtime groups them) merged; a block without
    unit figures (a profile) is a unit of its own."""
    units = merged_units(entry for block in chain.blocks[first:stop] for entry in block_units(block))
    return [num_bytes for _, num_bytes in units if num_bytes > 0]


def largest_unit_bytes(chain: CostChain, first: int, stop: int) -> float:
    """The largest FSDP unit's bytes among blocks ``[first, stop)`` (0.0 for fewer than two units: the stage
    is one unit)."""
    figures = block_sums(chain).units(first, stop)
    if figures is None:
        sizes = stage_unit_bytes(chain, first, stop)
        return float(max(sizes)) if len(sizes) >= 2 else 0.0
    return float(figures[0]) if figures[1] >= 2 else 0.0


def num_units(chain: CostChain, first: int, stop: int) -> int:
    """The FSDP units of a sharded stage over blocks ``[first, stop)`` (at least 1)."""
    figures = block_sums(chain).units(first, stop)
    return max(1, len(stage_unit_bytes(chain, first, stop)) if figures is None else figures[1])


def resaved_bytes(chain: CostChain, first: int, stop: int) -> Affine:
    """Bytes a stage over blocks ``[first, stop)`` saves of values an earlier stage saved as well.

    The cost chain counts a saved storage once, in the first block saving it; a stage starting after
    that block receives the value as its own tensor and saves its copy again (a ReLU's output that the
    next stage's convolution saves): :attr:`fxpipe.core.chain.Block.resaved`, each storage once, memoised.
    """
    return block_sums(chain).resaved(first, stop)


def _batch_views(chain: CostChain, first: int, stop: int) -> Affine:
    """Saved bytes of blocks ``[first, stop)`` that are slices of the global batch: inputs and targets."""
    inputs = chain.input_saved_bytes if first == 0 else Affine()
    return inputs + (chain.target_saved_bytes if stop == chain.num_blocks else Affine())


def backward_seconds(forward_s: float, backward_s: float, recompute: bool) -> float:
    """A stage's backward of one micro-batch; recomputation runs the forward again first."""
    return backward_s + forward_s if recompute else backward_s


def stage_param_bytes(chain: CostChain, first: int, stop: int, tensor_parallel: int = 1) -> int:
    """Parameter bytes a stage over blocks ``[first, stop)`` holds, its copies of tied parameters included;
    with ``tensor_parallel`` T > 1, what one group member holds (tied copies whole)."""
    if tensor_parallel > 1:
        return tensor_parallel_param_bytes(chain, first, stop, tensor_parallel) + tied_copy_bytes(chain, first, stop)
    return sum(block.param_bytes for block in chain.blocks[first:stop]) + tied_copy_bytes(chain, first, stop)


def tied_copy_bytes(chain: CostChain, first: int, stop: int) -> int:
    """Bytes of shared parameters blocks ``[first, stop)`` read but an earlier block holds: this stage's copies."""
    return sum(shared.num_bytes for shared in chain.shared_params
               if shared.blocks[0] < first and any(first <= block < stop for block in shared.blocks))


def tie_groups(chain: CostChain, stage_bounds: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, ...], int]]:
    """``(stage indices, bytes)`` per set of stages sharing parameters, for stages over blocks ``[first, stop)``.

    The runtime sums these gradients with one allreduce over every rank of those stages (and leaves
    them out of each stage's own replica allreduce); sets are in ascending order.
    """
    if not chain.shared_params:
        return []
    from fxpipe.core.chain import regroup_shared_params  # here: fxpipe.passes imports this module

    firsts = [first for first, _ in stage_bounds]
    stage_of_block = [bisect.bisect_right(firsts, block) - 1 for block in range(chain.num_blocks)]
    sizes: dict[tuple[int, ...], int] = {}
    for shared in regroup_shared_params(chain.shared_params, stage_of_block):
        sizes[shared.blocks] = sizes.get(shared.blocks, 0) + shared.num_bytes
    return sorted(sizes.items())


def allreduce_times(chain: CostChain, cluster: Cluster, stages: Sequence[tuple[int, int, Sequence[int]]],
                    tensor_parallel: Sequence[int] = ()) -> tuple[list[float], list[tuple[tuple[int, ...], float]]]:
    """Gradient sums of stages ``(first block, stop block, devices)`` as the runtime does them.

    Returns each stage's replica allreduce of its own parameters (tied ones left out) and, per set
    of stages sharing parameters (:func:`tie_groups`), the seconds of one allreduce of those bytes
    over every device of those stages; it can start once all of them are ready. A stage of
    ``tensor_parallel[s]``-way groups passes one device per replica (:func:`replica_leads`): its groups'
    members of one index sum one member's bytes, all indices at once on their own devices.
    """
    bounds = [(first, stop) for first, stop, _ in stages]
    ties = tie_groups(chain, bounds)
    own = [gradient_allreduce_time(cluster, num_bytes, devices)
           for num_bytes, (_, _, devices) in zip(own_allreduce_bytes(chain, bounds, ties, tensor_parallel), stages,
                                                 strict=True)]
    groups = [(holders, gradient_allreduce_time(cluster, num_bytes, sorted(d for s in holders for d in stages[s][2])))
              for holders, num_bytes in ties]
    return own, groups


def replica_leads(devices: Sequence[int], tensor_parallel: int) -> tuple[int, ...]:
    """One device per replica, its group's first: where its transfers and its gradient allreduce are costed."""
    return tuple(devices[::tensor_parallel])


def own_allreduce_bytes(chain: CostChain, stage_bounds: Sequence[tuple[int, int]],
                        ties: Sequence[tuple[tuple[int, ...], int]] | None = None,
                        tensor_parallel: Sequence[int] = ()) -> list[int]:
    """Bytes each stage ``[first, stop)`` sums over its own replicas: its parameters less tied ones
    (those go in one allreduce per :func:`tie_groups` set); one group member's with ``tensor_parallel``."""
    ties = tie_groups(chain, stage_bounds) if ties is None else ties
    degrees = tuple(tensor_parallel) or (1,) * len(stage_bounds)
    return [max(0, stage_param_bytes(chain, first, stop, degree)
                - sum(num_bytes for holders, num_bytes in ties if index in holders))
            for index, ((first, stop), degree) in enumerate(zip(stage_bounds, degrees, strict=True))]


def stage_memory_bytes(cost: StageCost, inflight_microbatches: int, optimizer: str = "adam",
                       recompute: bool = False, *, sharding: str = "none", replicas: int = 1,
                       num_microbatches: int | None = None, reshard_after_forward: bool | None = None,
                       selective: SelectiveRecompute | None = None) -> int:
    """Peak bytes per device: weights x optimizer factor + in-flight activations + receive buffers.

    ``sharding`` over ``replicas`` splits weights, gradients or optimizer state (:func:`model_state_bytes`;
    ``num_microbatches``: the micro-batches each replica runs per step, needed by a sharded level).

    Activations: what autograd saves (:func:`saved_bytes`) plus, when kept, each in-flight micro-batch's
    received inputs (held as the backward's leaves). Receive buffers: one activation slice in and one
    gradient slice back per in-flight micro-batch boundary (the runtime preallocates one of each).
    With ``recompute`` a stage keeps only its inputs per in-flight micro-batch, plus one micro-batch's
    activations while backward recomputes them (and, last stage, every in-flight loss's saved tensors).
    Per-block choices (``selective``) keep the received inputs and save less per micro-batch (:func:`saved_bytes`).
    """
    # a recomputed stage is one FSDP unit: its checkpoint spans the whole stage
    weights = model_state_bytes(cost.param_bytes, optimizer_factor(optimizer), sharding, replicas, num_microbatches,
                                0.0 if recompute else cost.unit_bytes, reshard_after_forward, cost.param_copy_fraction)
    held = 0.0 if recompute else inflight_microbatches * cost.input_bytes
    activations = saved_bytes(cost, inflight_microbatches, recompute, selective) + held
    buffers = cost.input_bytes + cost.output_bytes
    return int(math.ceil(weights + activations + buffers))


def saved_bytes(cost: StageCost, inflight_microbatches: int, recompute: bool = False,
                selective: SelectiveRecompute | None = None) -> float:
    """Bytes autograd saves at the peak, counted per slice: every in-flight micro-batch's activations, or
    with ``recompute`` their inputs (and the loss's saved tensors, outside the recomputed forward) plus one
    micro-batch's activations rebuilt in backward; with per-block choices (``selective``) each in-flight
    micro-batch keeps its activations less what they recompute, plus the largest recomputed part once."""
    if selective is not None:
        return inflight_microbatches * (cost.activation_bytes - selective.saved_bytes) + selective.transient_bytes
    if recompute:
        kept = cost.input_bytes + cost.loss_bytes
        return inflight_microbatches * kept + cost.activation_bytes - cost.loss_bytes
    return inflight_microbatches * cost.activation_bytes


def activation_peak_bytes(cost: StageCost, inflight_microbatches: int, num_microbatches: int,
                          recompute: bool = False, selective: SelectiveRecompute | None = None) -> int:
    """Peak bytes autograd saves for backward on one device: what a measured step records
    (``pipe.measure = True``, ``StepStats.peak_activation_bytes``).

    :func:`saved_bytes`, except that the model inputs stage 0 saves (token ids an embedding saves) and
    the targets the loss saves are slices of the global batch every rank holds: autograd keeps the whole
    batch's storage alive, all ``num_microbatches`` micro-batches of it, not one slice per micro-batch.
    """
    saved = saved_bytes(cost, inflight_microbatches, recompute, selective)
    if cost.batch_view_bytes > 0:
        slices = 1 if recompute else inflight_microbatches
        saved += num_microbatches * cost.microbatch_view_bytes - slices * cost.batch_view_bytes
    return int(math.ceil(max(saved, 0.0)))


def transfer_time(
    cluster: Cluster,
    bytes_per_row: Affine,
    microbatch_rows: int,
    src_devices: Sequence[int],
    dst_devices: Sequence[int],
) -> float:
    """Time to move one micro-batch's values across a cut between two replica groups.

    Each sender hands each receiver the rows they share (:func:`shared_rows`). Transfers from one
    device run one after another; the slowest device (as sender or receiver) sets the time.
    """
    devices = (*src_devices, *dst_devices)
    if devices:  # every device in the cluster (host_of raises otherwise), then hosts by division: per pair it adds up
        cluster.host_of(min(devices)), cluster.host_of(max(devices))
    per_host = cluster.devices_per_host
    busy: dict[tuple[str, int], float] = {}
    seconds_of: dict[tuple[bool, int], float] = {}  # (one host, rows) -> seconds: pairs repeat both
    for sender, receiver, start, stop in shared_rows(microbatch_rows, len(src_devices), len(dst_devices)):
        src, dst = src_devices[sender], dst_devices[receiver]
        if src == dst:
            continue
        key = (src // per_host == dst // per_host, stop - start)
        seconds = seconds_of.get(key)
        if seconds is None:
            link = cluster.intra_host if key[0] else cluster.inter_host  # Cluster.link
            seconds = seconds_of[key] = link.transfer_time(bytes_per_row.at(key[1]))
        busy[("send", src)] = busy.get(("send", src), 0.0) + seconds
        busy[("recv", dst)] = busy.get(("recv", dst), 0.0) + seconds
    return max(busy.values(), default=0.0)


def gradient_allreduce_time(cluster: Cluster, num_bytes: float, devices: Sequence[int],
                            link: LinkSpec | None = None) -> float:
    """A gradient allreduce as the runtime runs it: the gradients copied into one flat buffer, the ring
    allreduce over ``devices`` (:meth:`Cluster.allreduce_time`, slowest link or ``link``), the sums
    copied back; each copy reads and writes the bytes once at the device's memory bandwidth. 0 for
    one replica (nothing is copied or summed)."""
    ring = cluster.allreduce_time(num_bytes, devices, link)
    if ring <= 0 or cluster.device.memory_bandwidth_bytes_per_s <= 0:
        return ring
    return ring + 2 * 2 * num_bytes / cluster.device.memory_bandwidth_bytes_per_s


def step_end_sync_time(cluster: Cluster, devices: Sequence[int]) -> float:
    """The allreduce over every rank that ends each step (the loss sum, with the preemption vote and
    batch check folded in: :data:`STEP_END_SYNC_BYTES`); 0 on one device."""
    return cluster.allreduce_time(STEP_END_SYNC_BYTES, devices)


def action_seconds(cluster: Cluster, slowdown: float) -> float:
    """The runtime's own time per forward or backward action of a micro-batch slice beyond its blocks
    (:attr:`Cluster.action_overhead_s`), stretched like compute by ``slowdown``; a split backward's W has
    none of its own (its extra calls are in :attr:`Cluster.split_backward_overhead`)."""
    return cluster.action_overhead_s * slowdown


def step_close_time(cluster: Cluster, devices: Sequence[int], slowdown: float | None = None) -> float:
    """What every step takes after its last gradient allreduce, before the optimizer: the closing sync
    (:func:`step_end_sync_time`) and the runtime's fixed per-step cost (:attr:`Cluster.step_overhead_s`,
    stretched like compute by ``slowdown``, default the cluster's core sharing)."""
    stretch = cluster.compute_slowdown if slowdown is None else slowdown
    return step_end_sync_time(cluster, devices) + cluster.step_overhead_s * stretch


# Share of a stage's backward that computes parameter gradients (W) when backward is split (zero-bubble
# schedules): a linear layer's backward is two matmuls of the same size, one for the input gradient and
# one for the weight gradient, so half is the default until a measured figure is given.
WEIGHT_GRAD_FRACTION = 0.5


def stage_split_collectives(chain: CostChain, cluster: Cluster, stage: StagePlan, rows: float) -> tuple[float, float]:
    """A planned stage's :func:`split_backward_collectives` on a slice of ``rows`` rows, with its recompute choices."""
    return split_backward_collectives(chain, cluster, stage.first_block, stage.stop_block, rows, stage.tensor_parallel,
                                      stage.recompute, stage.block_recompute)


def split_backward_times(backward_s: float, stage_index: int, weight_fraction: float,
                         overhead: float = 0.0, collectives: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """``(B, W)`` seconds of a stage whose backward of ``backward_s`` is split into input and weight gradients.

    ``collectives``: the seconds of ``backward_s`` that are a tensor-parallel group's collectives, (those B runs,
    those W runs) (:func:`fxpipe.sim.tensor_parallel_cost.split_backward_collectives`); each stays whole in its
    pass. The rest is compute: ``overhead`` (:attr:`Cluster.split_backward_overhead`) is what splitting costs on
    top, as a fraction of it, and B and W share the result in the ``weight_fraction`` proportion. Stage 0 sends no
    gradient upstream, so the runtime runs its whole (fused) backward in B and W is empty.
    """
    if not 0.0 <= weight_fraction <= 1.0:
        raise ValueError(f"weight_fraction must be in [0, 1] (the share of backward spent on parameter "
                         f"gradients), got {weight_fraction}")
    if not overhead >= 0.0:
        raise ValueError(f"split backward overhead must be >= 0 (a fraction of the fused backward), got {overhead}")
    in_b, in_w = collectives
    if not (in_b >= 0.0 and in_w >= 0.0 and in_b + in_w <= backward_s * (1 + 1e-9) + 1e-15):
        raise ValueError(f"a backward of {backward_s} s cannot hold collectives of {in_b} s (B) and {in_w} s (W)")
    if stage_index == 0:
        return backward_s, 0.0
    split_s = max(0.0, backward_s - in_b - in_w) * (1.0 + overhead)
    return split_s * (1.0 - weight_fraction) + in_b, split_s * weight_fraction + in_w
