"""DAPPLE's analytic iteration latency (pivot stage formula) for fast screening of candidate plans.

Legend (REFERENCE.md 1.1): S stages, M micro-batches, F_s/B_s forward/backward seconds of stage s
for one micro-batch (its largest replica slice; B_s includes F_s again when the stage recomputes its
activations), AR_s its gradient allreduce, Q the pivot stage.

    L = sum_{s<=Q} F_s + (M-1)(F_Q+B_Q) + max_s(AR_s + Delta_s)   (a transfer Q: (M-1) max(F_Q, B_Q))
    Delta_s = sum_{t=s..Q} B_t (s <= Q),  -sum_{t=Q+1..s-1} B_t (s > Q)

Split backward (zero-bubble schedules): B_s is the whole split backward in the pivot (the stage is
busy with B and W of every micro-batch; what splitting costs, Cluster.split_backward_overhead, makes
it longer than the fused one), but a gradient crosses stage t in B_t - W_t only, and each stage
ends with its own last W: Delta_s = sum_{t=s..Q} (B_t - W_t) + W_s for s <= Q (mirrored for s > Q).
For equal stages this gives M (F+B) + (S-1)(F+B-W) + AR, the exact simulated time.

A sharded stage (ZeRO-1/2/3, :mod:`fxpipe.sim.sharding_cost`) has its per-micro-batch collectives in F_s and
B_s (under split backward ZeRO-2's reduce-scatter in W_s: it follows W), its reduce-scatter tail as AR_s, and its step all-gather delays its first forward: L adds the longest
wait max_s (start_s - sum of the F of the steps before s), when positive.

Every cut between stages becomes an extra stage whose F/B is the activation/gradient transfer
(:func:`fxpipe.sim.stagecost.transfer_time`) and whose AR is 0; a stage's F and B include its own time
per message (:attr:`Cluster.message_overhead_s`) and per action (:attr:`Cluster.action_overhead_s`, left
whole in B when backward is split, as the simulator charges it). The formula is exact for equal
stages without communication (it gives (M+S-1)(F+B) + AR) and approximate otherwise; the exact
simulator (:func:`fxpipe.sim.simulate.simulate`) re-ranks the best candidates.

Measured |analytic - simulated| / simulated on 200 random chains and plans (1-4 stages, random
replica counts and placement, M in 1..64, policies A and B; `python benchmarks/simulate_accuracy.py`):
mean 0.64%, median 0.00% (119 of 200 exact), p90 2.1%, worst 17.0%. Links are full duplex
(activations and gradients cross at once, as the simulator's ports), so a transfer step's
steady-phase time per micro-batch is max(F, B), not DAPPLE's F + B (with F + B: mean 0.9%, worst
39.7%, and the planner passed over VGG-19's 15:1 on dapple-c, whose 15-to-1 transfer looked like the
pivot). Policy A's communication round trips make the formula optimistic by up to ~11%; with few
micro-batches the duplex rule is optimistic too (warm-up and drain do not overlap).
tests/test_simulate.py holds these bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan
from fxpipe.sim.allreduce_overlap import last_pass_share, stage_allreduce_offsets
from fxpipe.sim.recompute_cost import selective_seconds
from fxpipe.sim.sharding_cost import plan_sharding_comms, start_delay
from fxpipe.sim.stagecost import (
    WEIGHT_GRAD_FRACTION,
    action_seconds,
    allreduce_times,
    backward_seconds,
    message_seconds,
    own_allreduce_bytes,
    replica_leads,
    split_backward_times,
    stage_cost,
    stage_split_collectives,
    step_close_time,
    transfer_time,
)

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import CostChain

# Bounds on |analytic - simulated| / simulated over the random plans of the module docstring.
ANALYTIC_MEAN_ERROR = 0.01
ANALYTIC_MEDIAN_ERROR = 0.01
ANALYTIC_WORST_ERROR = 0.20


def pivot_stage(forward_s: Sequence[float], backward_s: Sequence[float], num_microbatches: int,
                cycle_s: Sequence[float] | None = None) -> int:
    """Q = argmax_s [ sum_{t<=s}(F_t+B_t) + (M-1) C_s ]; ties go to the later stage.

    C_s (``cycle_s``) is step s's time per micro-batch in the steady phase, F_s + B_s by default.
    """
    _check_lengths(forward_s, backward_s, None, num_microbatches)
    cycles = _cycles(forward_s, backward_s, cycle_s)
    best_stage, best_value, prefix = 0, float("-inf"), 0.0
    for stage_index, (f, b, c) in enumerate(zip(forward_s, backward_s, cycles, strict=True)):
        prefix += f + b
        value = prefix + (num_microbatches - 1) * c
        if value >= best_value:
            best_stage, best_value = stage_index, value
    return best_stage


def _cycles(forward_s: Sequence[float], backward_s: Sequence[float], cycle_s: Sequence[float] | None) -> list[float]:
    if cycle_s is None:
        return [f + b for f, b in zip(forward_s, backward_s, strict=True)]
    if len(cycle_s) != len(forward_s):
        raise ValueError(f"cycle_s needs one entry per step ({len(forward_s)}), got {len(cycle_s)}")
    return list(cycle_s)


def pipeline_latency(forward_s: Sequence[float], backward_s: Sequence[float], allreduce_s: Sequence[float],
                     num_microbatches: int, group_allreduce_s: Sequence[tuple[Sequence[int], float]] = (),
                     weight_s: Sequence[float] | None = None, cycle_s: Sequence[float] | None = None) -> float:
    """L = T_warmup + T_steady + T_ending for stages given as plain numbers (transfers included as stages).

    ``group_allreduce_s`` holds ``(step indices, seconds)`` of allreduces over several stages (tied
    parameters): each starts when the last of its stages is done, so it ends at max Delta_s + seconds.
    ``weight_s`` (split backward) is the W part of each step's backward (0 for transfers). ``cycle_s``:
    each step's steady-phase time per micro-batch (default F + B; see :meth:`PipelineSteps.latency`).
    """
    _check_lengths(forward_s, backward_s, allreduce_s, num_microbatches)
    q = pivot_stage(forward_s, backward_s, num_microbatches, cycle_s)
    warmup = sum(forward_s[: q + 1])
    steady = (num_microbatches - 1) * _cycles(forward_s, backward_s, cycle_s)[q]
    weights = list(weight_s) if weight_s is not None else [0.0] * len(forward_s)
    if len(weights) != len(forward_s):
        raise ValueError(f"weight_s needs one entry per step ({len(forward_s)}), got {len(weights)}")
    crossing = [b - w for b, w in zip(backward_s, weights, strict=True)]  # what a gradient waits for
    deltas = [(sum(crossing[s: q + 1]) if s <= q else -sum(crossing[q + 1: s])) + weights[s]
              for s in range(len(forward_s))]
    ending = max(allreduce + delta for allreduce, delta in zip(allreduce_s, deltas, strict=True))
    for steps, seconds in group_allreduce_s:
        ending = max(ending, max(deltas[s] for s in steps) + seconds)
    return warmup + steady + ending


class PipelineSteps(NamedTuple):
    """The pivot model's input: F, B and allreduce per step (stages and costly transfers), tie allreduces,
    and what splitting backward needs (zero-bubble): each step's stage index (-1 for a transfer) and
    message time (left unsplit), the W share and what splitting costs."""

    forward: list[float]
    backward: list[float]
    allreduce: list[float]
    group_allreduce: list[tuple[tuple[int, ...], float]]  # (step indices, seconds)
    stage_index: list[int]
    message: list[float]
    weight_fraction: float = WEIGHT_GRAD_FRACTION
    split_overhead: float = 0.0
    step_start: tuple[float, ...] = ()  # per step: when it may start (a sharded stage's step all-gather)
    after_weight: tuple[float, ...] = ()  # per step: collectives in its message time a split backward runs after W

    def latency(self, num_microbatches: int, split_backward: bool = False) -> float:
        """:func:`pipeline_latency` of these steps; with ``split_backward``, of their B + W and W parts.

        A transfer step's activations and gradients share its link in both directions at once (full
        duplex, as the simulator's ports), so its steady-phase time per micro-batch is max(F, B), not F + B.
        """
        backward, weight = self.split_parts() if split_backward else (self.backward, None)
        cycles = [f + b if stage_index >= 0 else max(f, b)
                  for f, b, stage_index in zip(self.forward, backward, self.stage_index, strict=True)]
        latency = pipeline_latency(self.forward, backward, self.allreduce, num_microbatches, self.group_allreduce,
                                   weight, cycles)
        if not self.step_start:
            return latency
        arrivals = [sum(self.forward[:index]) for index in range(len(self.forward))]
        return latency + start_delay(self.step_start, arrivals)

    def split_parts(self) -> tuple[list[float], list[float]]:
        """Each step's split backward B + W (message time included) and its W part (0 for transfers): the
        stage's compute backward through :func:`fxpipe.sim.stagecost.split_backward_times`."""
        total, weight = [], []
        after = self.after_weight or (0.0,) * len(self.backward)
        for backward, stage_index, message, collective in zip(self.backward, self.stage_index, self.message, after,
                                                              strict=True):
            if stage_index < 0:
                total.append(backward)
                weight.append(0.0)
                continue
            input_s, weight_s = split_backward_times(backward - message, stage_index, self.weight_fraction,
                                                     self.split_overhead)
            total.append(input_s + weight_s + message)
            weight.append(weight_s + collective)  # ZeRO-2's reduce-scatter follows W (sharded_stage.after_weights)
        return total, weight


def pipeline_steps(stages: Sequence[tuple[float, float, float]], hops: Sequence[float],
                   ties: Sequence[tuple[tuple[int, ...], float]],
                   weight_fraction: float = WEIGHT_GRAD_FRACTION, split_overhead: float = 0.0,
                   messages: Sequence[float] | None = None, starts: Sequence[float] | None = None,
                   collectives: Sequence[float] | None = None,
                   tensor_parallel: Sequence[tuple[float, float]] | None = None) -> PipelineSteps:
    """The pivot model's steps from per-stage ``(F, B, own allreduce)``, the transfer time of each cut
    (``hops[s]`` between stages s and s+1) and tie allreduces over stage indices.

    Steps in order: stage 0, cut 0, stage 1, ...; a cut that costs nothing adds no step (it would
    only tie the pivot choice). Tie groups are given step indices. Each stage's B and W under split
    backward are :func:`fxpipe.sim.stagecost.split_backward_times` of its B with ``weight_fraction``
    and ``split_overhead`` (:attr:`Cluster.split_backward_overhead`); ``messages[s]`` is the message
    time stage s's F and B include (:func:`message_seconds`), which splitting leaves as it is (and a sharded
    stage's per-micro-batch collectives in B). ``starts[s]``: when stage s may start its first forward
    (:mod:`fxpipe.sim.sharding_cost`); the latency adds the longest wait for it (:func:`start_delay`).
    ``collectives[s]``: the part of ``messages[s]`` that is a sharded stage's per-micro-batch reduce-scatter,
    which under split backward runs after W (in W's share: off the gradient's path through the stage).
    ``tensor_parallel[s]``: the tensor-parallel group's collectives in stage s's B, (those B runs, those W runs)
    (:func:`fxpipe.sim.tensor_parallel_cost.split_backward_collectives`): splitting leaves each whole in its pass
    (stage 0, which runs its backward whole in B: both in B).
    """
    steps = PipelineSteps([], [], [], [], [], [], weight_fraction, split_overhead)
    step_start: list[float] = []
    after_weight: list[float] = []
    step_of_stage = []
    for index, (forward, backward, allreduce) in enumerate(stages):
        if index and hops[index - 1] > 0:
            steps.forward.append(hops[index - 1])
            steps.backward.append(hops[index - 1])
            steps.allreduce.append(0.0)
            steps.stage_index.append(-1)
            steps.message.append(0.0)
            step_start.append(0.0)
            after_weight.append(0.0)
        step_of_stage.append(len(steps.forward))
        step_start.append(starts[index] if starts is not None else 0.0)
        in_b, in_w = tensor_parallel[index] if tensor_parallel is not None else (0.0, 0.0)
        after_weight.append((collectives[index] if collectives is not None else 0.0) + (in_w if index else 0.0))
        steps.forward.append(forward)
        steps.backward.append(backward)
        steps.allreduce.append(allreduce)
        steps.stage_index.append(index)
        steps.message.append((messages[index] if messages is not None else 0.0) + in_b + in_w)
    steps.group_allreduce.extend((tuple(step_of_stage[s] for s in group), seconds) for group, seconds in ties)
    if any(after_weight):
        steps = steps._replace(after_weight=tuple(after_weight))
    return steps._replace(step_start=tuple(step_start)) if any(step_start) else steps


def stage_times(plan: Plan, chain: CostChain, cluster: Cluster) -> PipelineSteps:
    """The plan's pivot-model steps: stages with their message time, costly transfers between them.

    A stage's allreduce leaves out parameters it shares with other stages; those are one allreduce
    over all their stages' devices (:func:`fxpipe.sim.stagecost.allreduce_times`), as the runtime does.
    With ``plan.allreduce_bucket_bytes`` a stage's AR is only the tail its buckets leave after the
    last backward (:mod:`fxpipe.sim.allreduce_overlap`).
    """
    degrees = [s.tensor_parallel for s in plan.stages]
    leads = [replica_leads(s.devices, s.tensor_parallel) for s in plan.stages]
    bounds = [(s.first_block, s.stop_block, lead) for s, lead in zip(plan.stages, leads, strict=True)]
    _, ties = allreduce_times(chain, cluster, bounds, degrees)
    own_bytes = own_allreduce_bytes(chain, [(s.first_block, s.stop_block) for s in plan.stages], tensor_parallel=degrees)
    comms = plan_sharding_comms(plan, chain, cluster)
    replicas = [s.replicas for s in plan.stages]
    stages, messages, splits = [], [], []
    for stage in plan.stages:
        cost = stage_cost(chain, stage.first_block, stage.stop_block, plan.microbatch_size, stage.replicas,
                          cluster.compute_slowdown, tensor_parallel=stage.tensor_parallel, cluster=cluster)
        message_s = message_seconds(cluster, plan.microbatch_size, replicas, stage.stage_index)
        backward_s = backward_seconds(cost.forward_s, cost.backward_s, stage.recompute) + selective_seconds(
            chain, stage.first_block, stage.block_recompute, cost.rows, cluster.compute_slowdown, stage.tensor_parallel,
            cluster)
        _, tail = stage_allreduce_offsets(chain, cluster, stage.first_block, stage.stop_block, leads[stage.stage_index],
                                          cost.rows, own_bytes[stage.stage_index], plan.allreduce_bucket_bytes,
                                          last_pass_share(stage.stage_index, plan.schedule == "zero_bubble",
                                                          WEIGHT_GRAD_FRACTION, cluster.split_backward_overhead),
                                          stage.tensor_parallel)
        comm = comms[stage.stage_index]
        if stage.sharding != "none":
            tail = comm.tail_s
        fixed_s = message_s + action_seconds(cluster, cluster.compute_slowdown)
        stages.append((cost.forward_s + fixed_s + comm.forward_s, backward_s + fixed_s + comm.backward_s, tail))
        messages.append(fixed_s + comm.backward_s)
        splits.append(stage_split_collectives(chain, cluster, stage, cost.rows))
    hops = [transfer_time(cluster, chain.cut_bytes[before.stop_block - 1], plan.microbatch_size, before_leads,
                          after_leads) for before, before_leads, after_leads in zip(plan.stages, leads, leads[1:],
                                                                                     strict=False)]
    return pipeline_steps(stages, hops, ties, split_overhead=cluster.split_backward_overhead, messages=messages,
                          starts=[comm.start_s for comm in comms], collectives=[comm.backward_s for comm in comms],
                          tensor_parallel=splits)


def analytic_iteration_time(plan: Plan, chain: CostChain, cluster: Cluster) -> float:
    """DAPPLE's latency estimate of one iteration of ``plan`` (the same for early backward and GPipe;
    zero-bubble's gradients cross each stage in B alone), with the allreduce and fixed cost that end every step."""
    return (stage_times(plan, chain, cluster).latency(plan.num_microbatches, plan.schedule == "zero_bubble")
            + step_close_time(cluster, plan.all_devices()))


def _check_lengths(forward_s: Sequence[float], backward_s: Sequence[float],
                   allreduce_s: Sequence[float] | None, num_microbatches: int) -> None:
    lengths = {len(forward_s), len(backward_s)} | ({len(allreduce_s)} if allreduce_s is not None else set())
    if len(lengths) != 1 or not forward_s:
        raise ValueError(f"forward_s, backward_s (and allreduce_s) need one entry per stage, >= 1 stage; "
                         f"got lengths {len(forward_s)}, {len(backward_s)}"
                         + (f", {len(allreduce_s)}" if allreduce_s is not None else ""))
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
