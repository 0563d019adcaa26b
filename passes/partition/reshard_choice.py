"""Whether a ZeRO-3 stage frees its gathered weights after forward (``reshard_after_forward``), chosen by memory and time.

Keeping a stage's weights gathered from each forward to its backward saves the backward's all-gathers (one per
FSDP unit per micro-batch) but holds the whole stage's weights, and under pipelining across every in-flight
micro-batch, that is for the whole step: the memory of ZeRO-2 (:mod:`fxpipe.sim.sharding_memory`). So under
``sharding="auto"`` a ZeRO-3 stage that could keep them would run ZeRO-2 instead (the same memory, one all-gather
a step instead of one per micro-batch): the choice matters where the level is forced to ``"parameters"``. The
stage keeps them (False) where that fits the device and is faster (:func:`fxpipe.sim.sharding_cost.sharding_comm`
with the unit overlap); else it frees them (True). A recomputing stage frees them: its checkpoints gather again.
"""

from __future__ import annotations

from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.spans import Span, StageChoice
from fxpipe.sim.sharding_cost import span_sharding_comm
from fxpipe.sim.stagecost import stage_memory_bytes


def keeps_weights(model: CandidateCosts, span: Span, rows: int, inflight: int, choice: StageChoice,
                  per_block: bool) -> tuple[bool | None, int]:
    """``(reshard_after_forward, peak bytes)`` of a stage the planner chose ``choice`` for on micro-batches of
    ``rows`` rows (``per_block``: it recomputes some blocks): None and the choice's memory for any stage but a
    ZeRO-3 one on several replicas; else False and the kept memory where keeping fits and is faster, True otherwise."""
    if choice.sharding != "parameters" or span.replicas <= 1:
        return None, choice.memory
    if choice.recompute or per_block:
        return True, choice.memory
    cost = model.cost(span.first, span.stop, rows, span.replicas, span.tensor_parallel)
    num_microbatches = model.global_batch_size // rows
    kept = stage_memory_bytes(cost, inflight, model.optimizer, sharding="parameters", replicas=span.replicas,
                              num_microbatches=num_microbatches, reshard_after_forward=False)
    if kept > model.memory_limit_bytes:
        return True, choice.memory
    seconds = [_stage_seconds(model, span, rows, cost.param_bytes, reshard) for reshard in (True, False)]
    return (False, kept) if seconds[1] < seconds[0] * (1 - 1e-12) else (True, choice.memory)


def _stage_seconds(model: CandidateCosts, span: Span, rows: int, param_bytes: int, reshard: bool) -> float:
    """One micro-batch's ZeRO-3 collectives left exposed beside its compute (forward + backward)."""
    comm = span_sharding_comm(model.chain, model.cluster, span.first, span.stop, "parameters", span.leads, param_bytes,
                              model.schedule, rows, span.tensor_parallel, reshard, param_bytes)
    return comm.forward_s + comm.backward_s
