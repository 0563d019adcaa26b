"""A planner candidate turned into a Plan: its stages' per-device predicted costs, choices and predictions."""

from __future__ import annotations

from fxpipe.core.plan import Plan, Prediction, StagePlan
from fxpipe.core.recompute import check_stage_count
from fxpipe.core.sharding import stage_levels
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.refined_choices import refined_choices
from fxpipe.passes.partition.reshard_choice import keeps_weights
from fxpipe.passes.partition.selective import selective_choice
from fxpipe.passes.partition.spans import Candidate, Span
from fxpipe.sim.recompute_cost import selective_figures
from fxpipe.sim.sharding_cost import span_sharding_comm
from fxpipe.sim.stagecost import activation_peak_bytes


def build_plan(model: CandidateCosts, candidate: Candidate, *, schedule: str, warmup_policy: str,
               planner: str) -> Plan:
    """A Plan (no predictions yet) whose StagePlans carry the per-device predicted costs."""
    chain = model.chain
    rows = candidate.microbatch_rows
    num_microbatches = model.global_batch_size // rows
    check_stage_count(model.recompute, len(candidate.spans))
    if not isinstance(model.sharding, str):
        stage_levels(model.sharding, candidate.layout)  # raises unless one level per stage
    choices = refined_choices(model, candidate.spans, rows, warmup_policy, schedule)
    inflight = [model.inflight(index, len(candidate.spans), num_microbatches, warmup_policy, schedule)
                for index in range(len(candidate.spans))]
    stages = []
    for index, span in enumerate(candidate.spans):
        choices[index], block_recompute = selective_choice(model, span, rows, inflight[index], choices[index], schedule)
        reshard, memory = keeps_weights(model, span, rows, inflight[index], choices[index],
                                      any(choice != "keep" for choice in block_recompute))
        cost = model.cost(span.first, span.stop, rows, span.replicas, span.tensor_parallel)
        node_names = tuple(name for block in chain.blocks[span.first:span.stop] for name in block.node_names)
        stages.append(StagePlan(
            stage_index=index, first_block=span.first, stop_block=span.stop,
            replicas=span.replicas, devices=span.devices, node_names=node_names,
            forward_s=cost.forward_s, backward_s=cost.backward_s,
            allreduce_s=_gradient_sync_seconds(model, span, choices[index].sharding, num_microbatches, reshard),
            param_bytes=cost.param_bytes, activation_bytes=int(cost.activation_bytes),
            peak_memory_bytes=memory, recompute=choices[index].recompute,
            sharding=choices[index].sharding, reshard_after_forward=reshard,
            inflight_microbatches=inflight[index],
            activation_peak_bytes=activation_peak_bytes(
                cost, inflight[index], num_microbatches, choices[index].recompute,
                selective_figures(chain, span.first, block_recompute, cost.rows, tensor_parallel=span.tensor_parallel,
                                  cluster=model.cluster)),
            tensor_parallel=span.tensor_parallel, block_recompute=block_recompute,
        ))
    return Plan(
        global_batch_size=model.global_batch_size, num_microbatches=num_microbatches, stages=tuple(stages),
        schedule=schedule, warmup_policy=warmup_policy, planner=planner, cluster=model.cluster.name,
        num_devices=model.cluster.num_devices, num_blocks=chain.num_blocks,
        block_names=tuple(block.name for block in chain.blocks),
        allreduce_bucket_bytes=model.allreduce_bucket_bytes,
    )


def _gradient_sync_seconds(model: CandidateCosts, span: Span, sharding: str, num_microbatches: int,
                           reshard: bool | None = None) -> float:
    """A stage's ``allreduce_s``: its gradient allreduce, or when sharded every collective of its step, whole
    (:meth:`ShardingComm.step_seconds`; tied parameters aside; a ZeRO-3 stage keeping its weights gathers in forward only)."""
    if sharding == "none":
        return model.allreduce(span.first, span.stop, span.leads, span.tensor_parallel)
    param_bytes = model.cost(span.first, span.stop, 1, 1, span.tensor_parallel).param_bytes
    if reshard is False:
        return span_sharding_comm(model.chain, model.cluster, span.first, span.stop, sharding, span.leads, param_bytes,
                                  model.schedule, None, span.tensor_parallel, False, param_bytes
                                  ).step_seconds(num_microbatches)
    return model.stage_comm(span.first, span.stop, span.leads, sharding, param_bytes,
                            span.tensor_parallel).step_seconds(num_microbatches)


def with_prediction(plan: Plan, iteration_time_s: float, bubble_fraction: float, analytic_s: float,
                    dp_iteration_time_s: float) -> Plan:
    return plan.with_updates(predicted=Prediction(
        iteration_time_s=iteration_time_s,
        throughput_samples_per_s=plan.global_batch_size / iteration_time_s if iteration_time_s > 0 else 0.0,
        bubble_fraction=bubble_fraction, analytic_iteration_time_s=analytic_s,
        dp_iteration_time_s=dp_iteration_time_s,
    ))
