"""Planner candidates on plain numbers: memoised stage costs, pivot-model latency, memory checks, Plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, Prediction, StagePlan
from fxpipe.core.recompute import RecomputeSetting, check_stage_count, choose_recompute, parse_recompute
from fxpipe.core.schedule import SCHEDULES, warmup_forwards
from fxpipe.passes.partition.latency import PipelineSteps, pipeline_steps
from fxpipe.sim.allreduce_overlap import last_pass_share, stage_allreduce_offsets
from fxpipe.sim.stagecost import (
    WEIGHT_GRAD_FRACTION,
    StageCost,
    activation_peak_bytes,
    allreduce_times,
    backward_seconds,
    gradient_allreduce_time,
    message_seconds,
    own_allreduce_bytes,
    stage_cost,
    stage_memory_bytes,
    transfer_time,
)


@dataclass(frozen=True)
class Span:
    """One stage of a candidate: blocks ``[first, stop)`` on ``devices`` (one replica per device)."""

    first: int
    stop: int
    devices: tuple[int, ...]


def spans_from_stops(stops: Sequence[int], devices: Sequence[tuple[int, ...]]) -> list[Span]:
    """Stages over blocks ``[stops[s-1], stops[s])`` (the first from 0) on ``devices[s]``."""
    return [Span(stops[s - 1] if s else 0, stop, devices[s]) for s, stop in enumerate(stops)]


@dataclass(frozen=True, order=True)
class Candidate:
    """A complete plan in planner terms, ordered by its pivot-model latency."""

    latency_s: float
    microbatch_rows: int
    spans: tuple[Span, ...] = field(compare=False)

    @property
    def layout(self) -> tuple[int, ...]:
        return tuple(len(span.devices) for span in self.spans)

    @property
    def num_devices(self) -> int:
        return sum(len(span.devices) for span in self.spans)

    def identity(self) -> tuple[object, ...]:
        return (self.microbatch_rows, tuple((s.first, s.stop, s.devices) for s in self.spans))


class CandidateCosts:
    """Stage costs, transfers and allreduces of one (chain, cluster, batch) with memoisation.

    All numbers come from :mod:`fxpipe.sim.stagecost`; this class only caches them and combines them
    into the pivot model, so the search evaluates many candidates quickly.
    """

    def __init__(self, chain: CostChain, cluster: Cluster, global_batch_size: int,
                 optimizer: str, memory_limit_bytes: int, *, schedule: str = "early_backward",
                 recompute: RecomputeSetting = "auto", allreduce_bucket_bytes: int = 0) -> None:
        self.chain = chain
        self.allreduce_bucket_bytes = allreduce_bucket_bytes  # recorded in the plans
        # tails as under a fused backward for every schedule: a screen and a lower bound (zero-bubble's
        # buckets fill over the shorter last W, so its tails are no shorter: fxpipe.sim.allreduce_overlap).
        # When overlap costs something a longer window can cost more than it hides: split schedules then
        # take the shortest tail over the windows a stage can have (whole backward, W's share, none).
        self.overlap_bytes = allreduce_bucket_bytes
        costly = cluster.overlap_compute_slowdown > 0 or cluster.overlap_comm_slowdown > 0
        self.window_shares = (1.0,) if schedule not in ("zero_bubble", "auto") or not costly else (
            1.0, last_pass_share(1, True, WEIGHT_GRAD_FRACTION, cluster.split_backward_overhead), 0.0)
        self.recompute = parse_recompute(recompute)
        self.schedule = schedule
        self.cluster = cluster
        self.global_batch_size = global_batch_size
        self.optimizer = optimizer
        self.memory_limit_bytes = memory_limit_bytes
        self.cost = lru_cache(maxsize=None)(self._cost)
        self._hop = lru_cache(maxsize=None)(self._transfer)
        self.hop = lru_cache(maxsize=None)(self._canonical_hop)
        self._relabelled = lru_cache(maxsize=None)(self._relabel)  # by device sets alone (cuts move, devices stay)
        self.allreduce = lru_cache(maxsize=None)(self._allreduce)
        self.allreduce_tail = lru_cache(maxsize=None)(self._allreduce_tail)
        self.stage_step = lru_cache(maxsize=None)(self._stage_step)
        # (candidate identity, schedule, warm-up policy) -> simulated (iteration s, bubble fraction), for scoring
        self.simulated: dict[tuple[object, ...], tuple[float, float]] = {}

    def _cost(self, first: int, stop: int, rows: int, replicas: int) -> StageCost:
        return stage_cost(self.chain, first, stop, rows, replicas, self.cluster.compute_slowdown)

    def _canonical_hop(self, cut: int, rows: int, src: tuple[int, ...], dst: tuple[int, ...]) -> float:
        """Transfer time across cut ``cut``; devices are relabelled host-major in order of appearance
        (the time depends only on which replicas share a host), so equivalent placements share a cache entry."""
        return self._hop(self.chain.cut_bytes[cut], rows, *self._relabelled(src, dst))

    def _relabel(self, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        per_host = self.cluster.devices_per_host
        hosts: dict[int, int] = {}
        filled: dict[int, int] = {}
        labels: dict[int, int] = {}
        for device in (*src, *dst):
            if device not in labels:
                host = hosts.setdefault(device // per_host, len(hosts))
                labels[device] = host * per_host + filled.get(host, 0)
                filled[host] = filled.get(host, 0) + 1
        return tuple(labels[d] for d in src), tuple(labels[d] for d in dst)

    def _transfer(self, cut_bytes: Affine, rows: int, src: tuple[int, ...], dst: tuple[int, ...]) -> float:
        relabelled = Cluster(self.cluster.name, len(set(d // self.cluster.devices_per_host for d in src + dst)),
                             self.cluster.devices_per_host, self.cluster.device, self.cluster.intra_host,
                             self.cluster.inter_host, self.cluster.inter_host_collective)
        return transfer_time(relabelled, cut_bytes, rows, src, dst)

    def _stage_step(self, first: int, stop: int, rows: int, devices: tuple[int, ...],
                    recompute: bool) -> tuple[float, float, float]:
        """(F, B, own allreduce or its tail after backward) of a stage when messages cost nothing
        (:func:`message_seconds` is 0.0) and no parameter is shared with another stage."""
        cost = self.cost(first, stop, rows, len(devices))
        if self.overlap_bytes:
            per_host = self.cluster.devices_per_host
            own = self.allreduce_tail(first, stop, len(devices), len({d // per_host for d in devices}) == 1, rows,
                                      self.cost(first, stop, 1, 1).param_bytes)
        else:
            own = self.allreduce(first, stop, devices)
        return cost.forward_s, backward_seconds(cost.forward_s, cost.backward_s, recompute), own

    def _allreduce(self, first: int, stop: int, devices: tuple[int, ...]) -> float:
        return gradient_allreduce_time(self.cluster, self.cost(first, stop, 1, 1).param_bytes, devices)

    def _allreduce_tail(self, first: int, stop: int, replicas: int, one_host: bool, rows: int, own_bytes: int
                        ) -> float:
        """The tail for any ``replicas`` devices on one host or not: a ring allreduce's time depends on
        nothing else (:meth:`Cluster.collective_link`), so equivalent placements share a cache entry."""
        per_host = self.cluster.devices_per_host
        devices = tuple(range(replicas)) if one_host else (per_host, *range(replicas - 1))
        slice_rows = self.cost(first, stop, rows, replicas).rows
        return min(stage_allreduce_offsets(self.chain, self.cluster, first, stop, devices, slice_rows, own_bytes,
                                           self.overlap_bytes, share)[1] for share in self.window_shares)

    def allreduce_tails(self, spans: Sequence[Span], rows: int) -> list[float]:
        """Each stage's own allreduce time left after its last backward, buckets overlapping it."""
        if not self.chain.shared_params:
            own_bytes = [self.cost(span.first, span.stop, 1, 1).param_bytes for span in spans]
        else:
            own_bytes = own_allreduce_bytes(self.chain, [(span.first, span.stop) for span in spans])
        per_host = self.cluster.devices_per_host
        return [self.allreduce_tail(span.first, span.stop, len(span.devices),
                                    len({device // per_host for device in span.devices}) == 1, rows, num_bytes)
                for span, num_bytes in zip(spans, own_bytes, strict=True)]

    def stage_allreduces(self, spans: Sequence[Span]) -> tuple[list[float], list[tuple[tuple[int, ...], float]]]:
        """Each stage's own gradient allreduce and the tie groups' allreduces (:func:`allreduce_times`)."""
        if not self.chain.shared_params:  # the common case, memoised per span
            return [self.allreduce(span.first, span.stop, span.devices) for span in spans], []
        return allreduce_times(self.chain, self.cluster, [(span.first, span.stop, span.devices) for span in spans])

    def steps(self, spans: Sequence[Span], rows: int) -> PipelineSteps:
        """Forward, backward and allreduce time of every pipeline step (stages and transfers), tie allreduces."""
        if not self.chain.shared_params and self.cluster.message_overhead_s <= 0:
            # the common case: a stage's step depends on its own span only (no ties, no per-message time)
            hops = [self.hop(before.stop - 1, rows, before.devices, after.devices)
                    for before, after in zip(spans, spans[1:], strict=False)]
            recomputing = self.recomputes(spans, rows, "A")  # the search's memory check uses policy A too
            return pipeline_steps([self.stage_step(span.first, span.stop, rows, span.devices, recompute)
                                   for span, recompute in zip(spans, recomputing, strict=True)], hops, [],
                                  split_overhead=self.cluster.split_backward_overhead)
        own, ties = self.stage_allreduces(spans)
        if self.overlap_bytes:
            own = self.allreduce_tails(spans, rows)
        replicas = [len(span.devices) for span in spans]
        recomputes = self.recomputes(spans, rows, "A")  # the search's memory check uses policy A too
        stages, messages = [], []
        for index, span in enumerate(spans):
            cost = self.cost(span.first, span.stop, rows, len(span.devices))
            message_s = message_seconds(self.cluster, rows, replicas, index)
            backward_s = backward_seconds(cost.forward_s, cost.backward_s, recomputes[index])
            stages.append((cost.forward_s + message_s, backward_s + message_s, own[index]))
            messages.append(message_s)
        hops = [self.hop(before.stop - 1, rows, before.devices, after.devices)
                for before, after in zip(spans, spans[1:], strict=False)]
        return pipeline_steps(stages, hops, ties, split_overhead=self.cluster.split_backward_overhead,
                              messages=messages)

    def latency(self, spans: Sequence[Span], rows: int) -> float:
        return self.steps(spans, rows).latency(self.global_batch_size // rows, self.schedule == "zero_bubble")

    def inflight(self, stage_index: int, num_stages: int, num_microbatches: int, warmup_policy: str,
                 schedule: str | None = None) -> int:
        """K_s: micro-batches stage ``stage_index`` holds at once (all of them under GPipe; zero-bubble
        holds what early backward holds). ``schedule`` defaults to the model's ("auto" counts as early backward)."""
        kind = SCHEDULES.get(schedule or self.schedule)
        if kind is not None and kind.all_in_flight:
            return num_microbatches
        return warmup_forwards(stage_index, num_stages, num_microbatches, warmup_policy)

    def memory(self, spans: Sequence[Span], rows: int, warmup_policy: str, schedule: str | None = None) -> list[int]:
        """Peak bytes per device of every stage under ``schedule`` (default: the model's), recomputing where chosen."""
        return [memory for _, memory in self.stage_choices(spans, rows, warmup_policy, schedule)]

    def recomputes(self, spans: Sequence[Span], rows: int, warmup_policy: str,
                   schedule: str | None = None) -> tuple[bool, ...]:
        """Which stages recompute their activations in backward (:func:`choose_recompute`)."""
        if self.recompute == "never" or (schedule or self.schedule) == "zero_bubble":  # nothing to work out
            return (False,) * len(spans)
        return tuple(recompute for recompute, _ in self.stage_choices(spans, rows, warmup_policy, schedule))

    def stage_choices(self, spans: Sequence[Span], rows: int, warmup_policy: str,
                      schedule: str | None = None) -> list[tuple[bool, int]]:
        """``(recompute, peak bytes per device)`` of every stage.

        A per-stage setting is for plans of its length (the request fixes the stage count); the search
        also scores partial and other-length candidates, which it then drops, as under ``"auto"``.
        """
        num_microbatches = self.global_batch_size // rows
        setting = self.recompute
        if isinstance(setting, tuple) and len(setting) != len(spans):
            setting = "auto"
        if (schedule or self.schedule) == "zero_bubble":  # split backward cannot rerun a checkpointed forward
            setting = "never"
        choices = []
        for index, span in enumerate(spans):
            cost = self.cost(span.first, span.stop, rows, len(span.devices))
            inflight = self.inflight(index, len(spans), num_microbatches, warmup_policy, schedule)
            keep = stage_memory_bytes(cost, inflight, self.optimizer)
            if choose_recompute(setting, index, len(spans), keep, self.memory_limit_bytes):
                choices.append((True, stage_memory_bytes(cost, inflight, self.optimizer, recompute=True)))
            else:
                choices.append((False, keep))
        return choices

    def fits(self, spans: Sequence[Span], rows: int, warmup_policy: str = "A", schedule: str | None = None) -> bool:
        return max(self.memory(spans, rows, warmup_policy, schedule)) <= self.memory_limit_bytes

    def candidate(self, spans: Sequence[Span], rows: int) -> Candidate:
        return Candidate(self.latency(spans, rows), rows, tuple(spans))


def build_plan(model: CandidateCosts, candidate: Candidate, *, schedule: str, warmup_policy: str,
               planner: str) -> Plan:
    """A Plan (no predictions yet) whose StagePlans carry the per-device predicted costs."""
    chain = model.chain
    rows = candidate.microbatch_rows
    num_microbatches = model.global_batch_size // rows
    check_stage_count(model.recompute, len(candidate.spans))
    choices = model.stage_choices(candidate.spans, rows, warmup_policy, schedule)
    inflight = [model.inflight(index, len(candidate.spans), num_microbatches, warmup_policy, schedule)
                for index in range(len(candidate.spans))]
    stages = []
    for index, span in enumerate(candidate.spans):
        cost = model.cost(span.first, span.stop, rows, len(span.devices))
        node_names = tuple(name for block in chain.blocks[span.first:span.stop] for name in block.node_names)
        stages.append(StagePlan(
            stage_index=index, first_block=span.first, stop_block=span.stop,
            replicas=len(span.devices), devices=span.devices, node_names=node_names,
            forward_s=cost.forward_s, backward_s=cost.backward_s,
            allreduce_s=model.allreduce(span.first, span.stop, span.devices),
            param_bytes=cost.param_bytes, activation_bytes=int(cost.activation_bytes),
            peak_memory_bytes=choices[index][1], recompute=choices[index][0],
            inflight_microbatches=inflight[index],
            activation_peak_bytes=activation_peak_bytes(cost, inflight[index], num_microbatches, choices[index][0]),
        ))
    return Plan(
        global_batch_size=model.global_batch_size, num_microbatches=num_microbatches, stages=tuple(stages),
        schedule=schedule, warmup_policy=warmup_policy, planner=planner, cluster=model.cluster.name,
        num_devices=model.cluster.num_devices, num_blocks=chain.num_blocks,
        block_names=tuple(block.name for block in chain.blocks),
        allreduce_bucket_bytes=model.allreduce_bucket_bytes,
    )


def with_prediction(plan: Plan, iteration_time_s: float, bubble_fraction: float, analytic_s: float,
                    dp_iteration_time_s: float) -> Plan:
    return plan.with_updates(predicted=Prediction(
        iteration_time_s=iteration_time_s,
        throughput_samples_per_s=plan.global_batch_size / iteration_time_s if iteration_time_s > 0 else 0.0,
        bubble_fraction=bubble_fraction, analytic_iteration_time_s=analytic_s,
        dp_iteration_time_s=dp_iteration_time_s,
    ))
