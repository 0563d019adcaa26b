"""A lower bound on a candidate's simulated iteration that counts the pipeline's fill and drain."""

from __future__ import annotations

from collections.abc import Sequence

from fxpipe.core.row_slices import shared_rows, split_rows
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.spans import Candidate
from fxpipe.sim.stagecost import WEIGHT_GRAD_FRACTION, StageCost, action_seconds

# Off: scoring uses only the busiest-stage bound (tests/test_planner_scale.py plans with it off and on and
# compares the plans).
ENABLED = True
# Requested schedules under which scoring may simulate zero-bubble (split backward).
SPLIT_REQUESTS = ("zero_bubble", "auto")


def pipeline_lower_bound(model: CandidateCosts, candidate: Candidate, costs: Sequence[StageCost],
                         own_s: Sequence[float] | None) -> float:
    """A time no simulation of ``candidate`` beats under early backward, zero-bubble or GPipe.

    Stage s computes nothing before a micro-batch's forward crossed stages 0..s-1 (on some replica of each:
    at least its smallest slice's F), then runs M forwards and M backwards on its largest slice (``costs``);
    the backward of its last micro-batch must then cross stages s-1..0 (at least their smallest slices' B)
    before stage 0 reaches its allreduce. Every forward and backward action takes the runtime's own time
    (:func:`action_seconds`), and every hop between stages at least one message's time at each end and the
    cut's shortest transfer piece. Under split backward (zero-bubble) a stage's B is only
    ``(1 + overhead)(1 - W share)`` of its backward (stage 0's is all of it,
    :func:`fxpipe.sim.stagecost.split_backward_times`), so where the request allows zero-bubble that factor,
    where below 1, is used for every schedule. Recomputation, further messages, port queueing and sharded collectives only add. ``own_s`` (unsharded
    requests: each stage's own allreduce, or its tail after the last backward) follows the stage's last
    backward; a sharded stage's collectives may overlap its wait, so they are not added here.
    """
    if not ENABLED:
        return 0.0
    cluster, spans = model.cluster, candidate.spans
    num_microbatches = model.global_batch_size // candidate.microbatch_rows
    split = 1.0  # a B is the whole backward, unless the request may pick a split-backward schedule
    if model.schedule in SPLIT_REQUESTS:
        split = min(1.0, (1.0 + cluster.split_backward_overhead) * (1.0 - WEIGHT_GRAD_FRACTION))
    action_s = action_seconds(cluster, cluster.compute_slowdown)
    message_s = cluster.message_overhead_s * cluster.compute_slowdown
    head_s = tail_s = bound_s = 0.0
    for index, (span, cost) in enumerate(zip(spans, costs, strict=True)):
        share = 1.0 if index == 0 else split
        busy_s = num_microbatches * (cost.forward_s + 2 * action_s)
        bound_s = max(bound_s, head_s + busy_s + num_microbatches * share * cost.backward_s + tail_s,
                      head_s + busy_s + num_microbatches * cost.backward_s + (own_s[index] if own_s else 0.0))
        if index + 1 == len(spans):
            break
        smallest = [model.cost(span.first, span.stop, rows, 1, span.tensor_parallel)
                    for rows in set(split_rows(candidate.microbatch_rows, span.replicas))]
        hop_s = 2 * message_s + _shortest_piece(model, candidate, index)  # sent, carried, received
        head_s += min(small.forward_s for small in smallest) + action_s + hop_s
        tail_s += share * min(small.backward_s for small in smallest) + action_s + hop_s
    return bound_s


def _shortest_piece(model: CandidateCosts, candidate: Candidate, index: int) -> float:
    """The shortest transfer piece across the cut after stage ``index`` (as the simulator's ``_pieces`` cost
    them: between the replicas' first devices, gradients the size of activations)."""
    sender, receiver = candidate.spans[index], candidate.spans[index + 1]
    cut_bytes = model.chain.cut_bytes[sender.stop - 1]
    return min(model.cluster.link(sender.leads[i], receiver.leads[j]).transfer_time(cut_bytes.at(stop - start))
               for i, j, start, stop in shared_rows(candidate.microbatch_rows, sender.replicas, receiver.replicas))
