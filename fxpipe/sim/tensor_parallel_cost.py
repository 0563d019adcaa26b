"""What a stage whose replicas are T-way tensor-parallel groups costs: one group member's time, bytes and link.

Legend: T the group size, for each block t its forward (or backward) seconds on the slice, s its
``tp.time_share``, P its parameter bytes, p its ``tp.param_bytes``, a its saved bytes, q its ``tp.saved_share``,
c its ``tp.comm_bytes`` and g its ``tp.regather_bytes`` on the slice; L the node's link for that collective (:func:`tensor_parallel_link`), l its
latency per ring step and bw its bandwidth. A block splits when it has ``tp`` and T divides ``tp.divisor``; any
other block runs whole on every member (replicated: correct, slower):

    time per direction      t ((1 - s) + s / T) + AG + RS    (backward: + AG' as well)
    AG = RS                 (T-1) l + c (T-1)/T / bw         (a ring: T-1 steps, each member moving c/T per step)
    AG'                     (T-1) l + g (T-1)/T / bw         (column inputs gathered again, sequence parallelism)
    weights (grads, state)  (P - p) + p / T
    saved activations       a ((1 - q) + q / T)

Forward has one all-gather and one reduce-scatter of the block's collective bytes (sequence parallelism),
backward the same two and the column inputs' all-gather again (their linears keep only the token share, as in
Megatron-LM); without sequence parallelism each pair is one all-reduce, which a ring runs as exactly that
reduce-scatter and all-gather, and g is 0. A split block's members meet at its collectives a little compute apart: on CPU
ranks calibration times the link as such collectives run (``Cluster.tensor_parallel_collective``). Received and
sent activations stay whole (every member holds the full slice), and a stage's gradient allreduce runs over its
replicas, once per group index, of one member's gradient bytes. Tied parameters (:attr:`CostChain.shared_params`)
are counted whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from fxpipe.core.cluster import Cluster, LinkSpec
from fxpipe.core.costgraph import Affine

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import Block, CostChain

# The group sizes the planner tries per stage (a group stays inside one host).
TENSOR_PARALLEL_DEGREES = (1, 2, 4, 8)


def splits(block: Block, tensor_parallel: int) -> bool:
    """Whether ``block`` divides over a group of ``tensor_parallel`` (else every member runs it whole)."""
    return tensor_parallel > 1 and block.tp is not None and block.tp.divisor % tensor_parallel == 0


def tensor_parallel_link(cluster: Cluster, kind: str) -> LinkSpec:
    """The link a group's ``"all_gather"`` or ``"reduce_scatter"`` runs on (a group never spans hosts): its
    collectives as calibrated between compute in lock-step (``Cluster.tensor_parallel_collective``, CPU ranks:
    there a collective after a millisecond of compute took 3-5x one after a barrier, the peers included,
    benchmarks/tp_fidelity_terms.md), else the node's allreduce figures. Not FSDP2's own measured all-gather /
    reduce-scatter links: those include FSDP2's copies in and out, and a tensor-parallel group runs plain
    collectives of the activations (on gloo a reduce-scatter is an all-reduce keeping one chunk): with FSDP2's
    figures a T=2 stage on two CPU ranks was predicted 2x slower than it ran (benchmarks/tp_fidelity.md).
    ``kind`` stays for the day a host measures them apart."""
    del kind
    return cluster.tensor_parallel_collective or cluster.collective_link((0,))


def ring_seconds(link: LinkSpec, comm_bytes: float, tensor_parallel: int) -> float:
    """A ring all-gather or reduce-scatter of ``comm_bytes`` over T members: T - 1 steps, each a latency and c/T."""
    if comm_bytes <= 0 or tensor_parallel <= 1:
        return 0.0
    steps = tensor_parallel - 1
    return steps * link.latency_s + comm_bytes * steps / tensor_parallel / link.bandwidth_bytes_per_s


def collective_seconds(cluster: Cluster, comm_bytes: float, tensor_parallel: int) -> float:
    """One direction's collectives of a block: an all-gather and a reduce-scatter (:func:`ring_seconds`)."""
    return (ring_seconds(tensor_parallel_link(cluster, "all_gather"), comm_bytes, tensor_parallel)
            + ring_seconds(tensor_parallel_link(cluster, "reduce_scatter"), comm_bytes, tensor_parallel))


def block_collective_seconds(block: Block, cluster: Cluster, rows: float, tensor_parallel: int) -> tuple[float, float]:
    """Forward and backward seconds of a splitting block's collectives on one group member (module docstring: AG +
    RS each way, and AG' in backward)."""
    assert block.tp is not None
    comm = collective_seconds(cluster, block.tp.comm_bytes.at(rows), tensor_parallel)
    regather = ring_seconds(tensor_parallel_link(cluster, "all_gather"), block.tp.regather_bytes.at(rows),
                            tensor_parallel)
    return comm, comm + regather


def split_backward_collectives(chain: CostChain, cluster: Cluster, first: int, stop: int, rows: float,
                               tensor_parallel: int, recompute: bool = False,
                               block_recompute: Sequence[str] = ()) -> tuple[float, float]:
    """A group member's collective seconds in one backward over blocks ``[first, stop)``, as a split backward
    (zero-bubble) runs them: ``(in B, in W)``; ``(0, 0)`` for T = 1.

    B computes the input gradients, and with them each splitting block's AG + RS (an all-reduce without sequence
    parallelism) and the collectives of every forward it reruns (the stage's ``recompute``, a block's "block"
    choice: :func:`fxpipe.sim.recompute_cost.member_saving`). W computes the weight gradients, for which a
    sequence-parallel column linear gathers its input again (AG': passes/tensor_parallel_ops.py, ``_SequenceColumns``
    skips it in B). Together they are the collectives in :func:`tensor_parallel_times`' backward plus the reruns'."""
    in_b = in_w = 0.0
    if tensor_parallel <= 1:
        return in_b, in_w
    for offset, block in enumerate(chain.blocks[first:stop]):
        if not splits(block, tensor_parallel):
            continue
        forward, backward = block_collective_seconds(block, cluster, rows, tensor_parallel)
        reruns = int(recompute) + int(offset < len(block_recompute) and block_recompute[offset] == "block")
        in_b += forward * (1 + reruns)  # the backward's AG + RS are the forward's pair: block_collective_seconds
        in_w += backward - forward
    return in_b, in_w


def tensor_parallel_times(chain: CostChain, cluster: Cluster, first: int, stop: int, rows: float, tensor_parallel: int,
                          slowdown: float = 1.0) -> tuple[float, float]:
    """Forward and backward seconds of one group member over blocks ``[first, stop)`` on ``rows`` rows (module
    docstring); ``slowdown`` stretches compute, not the collectives."""
    forward_s = backward_s = 0.0
    for block in chain.blocks[first:stop]:
        forward, backward = block.forward_s.at(rows) * slowdown, block.backward_s.at(rows) * slowdown
        if splits(block, tensor_parallel):
            assert block.tp is not None
            kept = (1.0 - block.tp.time_share) + block.tp.time_share / tensor_parallel
            forward_comm, backward_comm = block_collective_seconds(block, cluster, rows, tensor_parallel)
            forward, backward = forward * kept + forward_comm, backward * kept + backward_comm
        forward_s += forward
        backward_s += backward
    return forward_s, backward_s


def member_param_bytes(block: Block, tensor_parallel: int) -> float:
    """Parameter bytes one group member holds of ``block``: (P - p) + p / T where it splits, else P."""
    if not splits(block, tensor_parallel):
        return float(block.param_bytes)
    assert block.tp is not None
    return (block.param_bytes - block.tp.param_bytes) + block.tp.param_bytes / tensor_parallel


def tensor_parallel_param_bytes(chain: CostChain, first: int, stop: int, tensor_parallel: int) -> int:
    """Parameter bytes one group member holds of blocks ``[first, stop)`` (tied copies left out: the caller's)."""
    return math.ceil(sum(member_param_bytes(block, tensor_parallel) for block in chain.blocks[first:stop]))


def tensor_parallel_saved(chain: CostChain, first: int, stop: int, tensor_parallel: int) -> Affine:
    """Bytes one group member saves for backward over blocks ``[first, stop)``, per slice (an Affine of rows)."""
    total = Affine()
    for block in chain.blocks[first:stop]:
        if splits(block, tensor_parallel):
            assert block.tp is not None
            total = total + block.saved_bytes.scaled((1.0 - block.tp.saved_share)
                                                     + block.tp.saved_share / tensor_parallel)
        else:
            total = total + block.saved_bytes
    return total


def tensor_parallel_degrees(chain: CostChain, devices_per_host: int) -> tuple[int, ...]:
    """The group sizes worth trying on ``chain``: 1, and each T of :data:`TENSOR_PARALLEL_DEGREES` within a host
    that splits at least one block (a T splitting nothing only adds devices that do the same work)."""
    return tuple(degree for degree in TENSOR_PARALLEL_DEGREES if degree == 1 or (
        degree <= devices_per_host and any(splits(block, degree) for block in chain.blocks)))


def tied_degree_conflict(chain: CostChain, stages: Sequence[tuple[int, int, int]]) -> str:
    """Why stages ``(first, stop, T)`` cannot run: a tied parameter held by stages of different T (the runtime
    sums a tied weight shard by shard, so its holders need one T); ``""`` when none is."""
    for shared in chain.shared_params:
        holders = [(index, degree) for index, (first, stop, degree) in enumerate(stages)
                   if any(first <= block < stop for block in shared.blocks)]
        if len({degree for _, degree in holders}) > 1:
            return (f"tied parameter {shared.name!r} is held by stages {[index for index, _ in holders]} of "
                    f"tensor-parallel degrees {[degree for _, degree in holders]}; its holders need one T")
    return ""
