"""Planner candidates on plain numbers: memoised stage costs, pivot-model latency, memory checks, Plans."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.costgraph import Affine
from fxpipe.core.recompute import RecomputeSetting, choose_recompute, parse_recompute
from fxpipe.core.schedule import SCHEDULES, warmup_forwards
from fxpipe.core.sharding import SHARDING_LEVELS, ShardingRequest, check_request, schedule_levels
from fxpipe.passes.partition.latency import PipelineSteps, pipeline_steps
from fxpipe.passes.partition.selective import recompute_memory
from fxpipe.passes.partition.spans import Candidate, Span, StageChoice
from fxpipe.sim.allreduce_overlap import last_pass_share, stage_allreduce_offsets
from fxpipe.sim.sharding_cost import NO_SHARDING, ShardingComm, span_sharding_comm
from fxpipe.sim.sharding_memory import model_state_bytes
from fxpipe.sim.stagecost import (
    WEIGHT_GRAD_FRACTION,
    StageCost,
    action_seconds,
    allreduce_times,
    backward_seconds,
    gradient_allreduce_time,
    message_seconds,
    optimizer_factor,
    own_allreduce_bytes,
    stage_cost,
    stage_memory_bytes,
    transfer_time,
)
from fxpipe.sim.tensor_parallel_cost import split_backward_collectives


class CandidateCosts:
    """Stage costs, transfers and allreduces of one (chain, cluster, batch) with memoisation.

    All numbers come from :mod:`fxpipe.sim.stagecost`; this class only caches them and combines them
    into the pivot model, so the search evaluates many candidates quickly.
    """

    def __init__(self, chain: CostChain, cluster: Cluster, global_batch_size: int,
                 optimizer: str, memory_limit_bytes: int, *, schedule: str = "early_backward",
                 recompute: RecomputeSetting = "auto", allreduce_bucket_bytes: int = 0,
                 sharding: ShardingRequest = "none") -> None:
        self.chain = chain
        self.sharding = check_request(sharding)
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
        self.split_collectives = lru_cache(maxsize=None)(self._split_collectives)
        self.inflights = lru_cache(maxsize=None)(self._inflights)  # K_s of every stage at once
        self.stage_choice = lru_cache(maxsize=None)(self._stage_choice)
        self.comm = lru_cache(maxsize=None)(self._comm)
        self._sharded_choice = lru_cache(maxsize=None)(self._choose_sharded)
        # (spans, rows, warm-up policy, schedule, recompute setting) -> choices: the search asks twice per candidate
        self._sharded_memo: dict[tuple[object, ...], tuple[StageChoice, ...]] = {}
        # (candidate identity, schedule, warm-up policy) -> simulated (iteration s, bubble fraction), for scoring
        self.simulated: dict[tuple[object, ...], tuple[float, float]] = {}

    def _cost(self, first: int, stop: int, rows: int, replicas: int, tensor_parallel: int = 1) -> StageCost:
        return stage_cost(self.chain, first, stop, rows, replicas, self.cluster.compute_slowdown,
                          tensor_parallel=tensor_parallel, cluster=self.cluster)

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
                    recompute: bool, sharding: str = "none", tensor_parallel: int = 1) -> tuple[float, float, float]:
        """(F, B, own allreduce or its tail after backward) of a stage when messages cost nothing
        (:func:`message_seconds` is 0.0) and no parameter is shared with another stage; a sharded stage's
        collectives (:func:`sharding_comm`) go into F and B, and its tail replaces the allreduce. ``devices``:
        one per replica (:attr:`Span.leads`), each a ``tensor_parallel``-way group."""
        cost = self.cost(first, stop, rows, len(devices), tensor_parallel)
        if sharding != "none" and len(devices) > 1:
            comm = self.stage_comm(first, stop, devices, sharding, cost.param_bytes, tensor_parallel, rows)
            return (cost.forward_s + comm.forward_s,
                    backward_seconds(cost.forward_s, cost.backward_s, recompute) + comm.backward_s, comm.tail_s)
        if self.overlap_bytes:
            per_host = self.cluster.devices_per_host
            own = self.allreduce_tail(first, stop, len(devices), len({d // per_host for d in devices}) == 1, rows,
                                      self.cost(first, stop, 1, 1, tensor_parallel).param_bytes, tensor_parallel)
        else:
            own = self.allreduce(first, stop, devices, tensor_parallel)
        return cost.forward_s, backward_seconds(cost.forward_s, cost.backward_s, recompute), own

    def _split_collectives(self, first: int, stop: int, rows: int, replicas: int, tensor_parallel: int,
                           recompute: bool) -> tuple[float, float]:
        """A stage's tensor-parallel collectives in B and in W under split backward on its slice of a micro-batch of
        ``rows`` (:func:`split_backward_collectives`); (0, 0) for T = 1."""
        if tensor_parallel <= 1:
            return 0.0, 0.0
        slice_rows = self.cost(first, stop, rows, replicas, tensor_parallel).rows
        return split_backward_collectives(self.chain, self.cluster, first, stop, slice_rows, tensor_parallel, recompute)

    def tensor_parallel_splits(self, spans: Sequence[Span], rows: int,
                               recomputing: Sequence[bool]) -> list[tuple[float, float]] | None:
        """Each stage's :meth:`split_collectives` (None when no stage is a tensor-parallel group)."""
        if all(span.tensor_parallel <= 1 for span in spans):
            return None
        return [self.split_collectives(span.first, span.stop, rows, span.replicas, span.tensor_parallel, recompute)
                for span, recompute in zip(spans, recomputing, strict=True)]

    def least_comm_seconds(self, span: Span, num_microbatches: int) -> float:
        """The least time any sharded level the request allows spends in a stage's collectives in one step
        (infinite when none is allowed: one replica, or ``"none"``)."""
        if self.sharding == "none" or span.replicas <= 1:
            return float("inf")
        levels = schedule_levels((self.sharding,) if self.sharding in SHARDING_LEVELS else SHARDING_LEVELS, self.schedule)
        # tied parameters may be summed by their tie allreduce instead: count none of them (a lower bound)
        gradient_bytes = max(0, self.cost(span.first, span.stop, 1, 1, span.tensor_parallel).param_bytes
                             - sum(shared.num_bytes for shared in self.chain.shared_params))
        return min((self.stage_comm(span.first, span.stop, span.leads, level, gradient_bytes, span.tensor_parallel,
                                    float("inf")).step_seconds(num_microbatches) for level in levels if level != "none"),
                   default=float("inf"))  # unbounded compute: the least exposed collectives

    def least_state_bytes(self, first: int, stop: int, replicas: int, unsharded_bytes: float,
                          num_microbatches: int, tensor_parallel: int = 1) -> float:
        """The fewest bytes per device a stage's weights, gradients and optimizer state can take under the
        request, with ``num_microbatches`` per step: ``unsharded_bytes`` (P x the optimizer's factor) unless a
        level the request allows takes fewer."""
        if self.sharding == "none" or replicas <= 1:
            return unsharded_bytes
        levels = schedule_levels((self.sharding,) if self.sharding in SHARDING_LEVELS else SHARDING_LEVELS, self.schedule)
        cost = self.cost(first, stop, 1, 1, tensor_parallel)
        factor = optimizer_factor(self.optimizer)
        return min(model_state_bytes(cost.param_bytes, factor, level, replicas, num_microbatches, unit)
                   for level in levels for unit in (0.0, cost.unit_bytes))  # one unit when recomputing

    def stage_comm(self, first: int, stop: int, devices: Sequence[int], sharding: str, gradient_bytes: int,
                   tensor_parallel: int = 1, rows: float | None = None) -> ShardingComm:
        """:func:`sharding_comm` of a stage, cached for any devices on one host or not (as allreduce tails);
        ``devices`` one per replica (:attr:`Span.leads`); ``rows`` a micro-batch's (:func:`stage_compute`)."""
        if sharding == "none" or len(devices) <= 1:
            return NO_SHARDING
        per_host = self.cluster.devices_per_host
        return self.comm(first, stop, len(devices), len({d // per_host for d in devices}) == 1, sharding,
                         gradient_bytes, tensor_parallel, rows)

    def _comm(self, first: int, stop: int, replicas: int, one_host: bool, sharding: str, gradient_bytes: int,
              tensor_parallel: int = 1, rows: float | None = None) -> ShardingComm:
        per_host = self.cluster.devices_per_host
        devices = tuple(range(replicas)) if one_host else (per_host, *range(replicas - 1))
        return span_sharding_comm(self.chain, self.cluster, first, stop, sharding, devices, gradient_bytes, self.schedule,
                                  rows, tensor_parallel, None, self.cost(first, stop, 1, 1, tensor_parallel).param_bytes)

    def _allreduce(self, first: int, stop: int, devices: tuple[int, ...], tensor_parallel: int = 1) -> float:
        """A stage's gradient allreduce over ``devices``, one per replica, of one group member's bytes."""
        return gradient_allreduce_time(self.cluster, self.cost(first, stop, 1, 1, tensor_parallel).param_bytes,
                                       devices)

    def _allreduce_tail(self, first: int, stop: int, replicas: int, one_host: bool, rows: int, own_bytes: int,
                        tensor_parallel: int = 1) -> float:
        """The tail for any ``replicas`` devices on one host or not: a ring allreduce's time depends on
        nothing else (:meth:`Cluster.collective_link`), so equivalent placements share a cache entry."""
        per_host = self.cluster.devices_per_host
        devices = tuple(range(replicas)) if one_host else (per_host, *range(replicas - 1))
        slice_rows = self.cost(first, stop, rows, replicas).rows
        link = self.cluster.collective_link(devices[:2])  # as of ``devices``: its first two share a host or not
        return min(stage_allreduce_offsets(self.chain, self.cluster, first, stop, devices, slice_rows, own_bytes,
                                           self.overlap_bytes, share, tensor_parallel, link)[1]
                   for share in self.window_shares)

    def allreduce_tails(self, spans: Sequence[Span], rows: int, own_bytes: Sequence[int] | None = None) -> list[float]:
        """Each stage's own allreduce time left after its last backward, buckets overlapping it (``own_bytes``:
        each stage's :func:`own_allreduce_bytes` when the caller has them)."""
        if own_bytes is not None:
            pass
        elif not self.chain.shared_params:
            own_bytes = [self.cost(span.first, span.stop, 1, 1, span.tensor_parallel).param_bytes for span in spans]
        else:
            own_bytes = own_allreduce_bytes(self.chain, [(span.first, span.stop) for span in spans],
                                            tensor_parallel=[span.tensor_parallel for span in spans])
        per_host = self.cluster.devices_per_host
        return [self.allreduce_tail(span.first, span.stop, span.replicas,
                                    len({device // per_host for device in span.leads}) == 1, rows, num_bytes,
                                    span.tensor_parallel)
                for span, num_bytes in zip(spans, own_bytes, strict=True)]

    def stage_allreduces(self, spans: Sequence[Span]) -> tuple[list[float], list[tuple[tuple[int, ...], float]]]:
        """Each stage's own gradient allreduce and the tie groups' allreduces (:func:`allreduce_times`)."""
        if not self.chain.shared_params:  # the common case, memoised per span
            return [self.allreduce(span.first, span.stop, span.leads, span.tensor_parallel) for span in spans], []
        return allreduce_times(self.chain, self.cluster, [(span.first, span.stop, span.leads) for span in spans],
                               [span.tensor_parallel for span in spans])

    def steps(self, spans: Sequence[Span], rows: int, choices: Sequence[StageChoice] | None = None) -> PipelineSteps:
        """Forward, backward and allreduce time of every pipeline step (stages and transfers), tie allreduces."""
        if not self.chain.shared_params and self.cluster.message_overhead_s <= 0 and self.cluster.action_overhead_s <= 0:
            # the common case: a stage's step depends on its own span only (no ties, no per-message or action time)
            hops = [self.hop(before.stop - 1, rows, before.leads, after.leads)
                    for before, after in zip(spans, spans[1:], strict=False)]
            if self.sharding == "none" and choices is None:
                recomputing = self.recomputes(spans, rows, "A")  # the search's memory check uses policy A too
                return pipeline_steps([self.stage_step(span.first, span.stop, rows, span.leads, recompute, "none",
                                                       span.tensor_parallel)
                                       for span, recompute in zip(spans, recomputing, strict=True)], hops, [],
                                      split_overhead=self.cluster.split_backward_overhead,
                                      tensor_parallel=self.tensor_parallel_splits(spans, rows, recomputing))
            choices = choices or self.stage_choices(spans, rows, "A")
            comms = [self.stage_comm(span.first, span.stop, span.leads, choice.sharding,
                                     self.cost(span.first, span.stop, 1, 1, span.tensor_parallel).param_bytes,
                                     span.tensor_parallel, rows)
                     for span, choice in zip(spans, choices, strict=True)]
            return pipeline_steps([self.stage_step(span.first, span.stop, rows, span.leads, choice.recompute,
                                                   choice.sharding, span.tensor_parallel)
                                   for span, choice in zip(spans, choices, strict=True)],
                                  hops, [], split_overhead=self.cluster.split_backward_overhead,
                                  messages=[comm.backward_s for comm in comms], starts=[comm.start_s for comm in comms],
                                  collectives=[comm.backward_s for comm in comms],
                                  tensor_parallel=self.tensor_parallel_splits(spans, rows,
                                                                              [c.recompute for c in choices]))
        return self._shared_steps(spans, rows, choices)

    def _shared_steps(self, spans: Sequence[Span], rows: int, choices: Sequence[StageChoice] | None) -> PipelineSteps:
        """:meth:`steps` with tied parameters or a time per message or action (each stage's own bytes and messages;
        the action time goes with the message time: whole in B under split backward)."""
        choices = choices or self.stage_choices(spans, rows, "A")  # the search's memory check uses policy A too
        sharded = any(choice.sharding != "none" and span.replicas > 1 for span, choice in zip(spans, choices,
                                                                                             strict=True))
        own_bytes = (own_allreduce_bytes(self.chain, [(span.first, span.stop) for span in spans],
                                         tensor_parallel=[span.tensor_parallel for span in spans])
                     if sharded else [0] * len(spans))
        own, ties = self.stage_allreduces(spans)
        if self.overlap_bytes:
            own = self.allreduce_tails(spans, rows, own_bytes if sharded else None)
        replicas = [span.replicas for span in spans]
        stages, messages, starts, collectives = [], [], [], []
        for index, span in enumerate(spans):
            cost = self.cost(span.first, span.stop, rows, span.replicas, span.tensor_parallel)
            message_s = (message_seconds(self.cluster, rows, replicas, index)
                         + action_seconds(self.cluster, self.cluster.compute_slowdown))
            backward_s = backward_seconds(cost.forward_s, cost.backward_s, choices[index].recompute)
            comm = self.stage_comm(span.first, span.stop, span.leads, choices[index].sharding, own_bytes[index],
                                   span.tensor_parallel, rows)
            tail = comm.tail_s if choices[index].sharding != "none" and span.replicas > 1 else own[index]
            stages.append((cost.forward_s + message_s + comm.forward_s, backward_s + message_s + comm.backward_s,
                           tail))
            messages.append(message_s + comm.backward_s)
            collectives.append(comm.backward_s)
            starts.append(comm.start_s)
        hops = [self.hop(before.stop - 1, rows, before.leads, after.leads)
                for before, after in zip(spans, spans[1:], strict=False)]
        return pipeline_steps(stages, hops, ties, split_overhead=self.cluster.split_backward_overhead,
                              messages=messages, starts=starts, collectives=collectives,
                              tensor_parallel=self.tensor_parallel_splits(spans, rows, [c.recompute for c in choices]))

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

    def _inflights(self, num_stages: int, num_microbatches: int, warmup_policy: str, schedule: str | None
                   ) -> tuple[int, ...]:
        return tuple(self.inflight(index, num_stages, num_microbatches, warmup_policy, schedule)
                     for index in range(num_stages))

    def memory(self, spans: Sequence[Span], rows: int, warmup_policy: str, schedule: str | None = None) -> list[int]:
        """Peak bytes per device of every stage under ``schedule`` (default: the model's), recomputing where chosen."""
        return [choice.memory for choice in self.stage_choices(spans, rows, warmup_policy, schedule)]

    def recomputes(self, spans: Sequence[Span], rows: int, warmup_policy: str,
                   schedule: str | None = None) -> tuple[bool, ...]:
        """Which stages recompute their activations in backward (:func:`choose_recompute`)."""
        if self.recompute == "never" or (schedule or self.schedule) == "zero_bubble":  # nothing to work out
            return (False,) * len(spans)
        return tuple(choice.recompute for choice in self.stage_choices(spans, rows, warmup_policy, schedule))

    def stage_choices(self, spans: Sequence[Span], rows: int, warmup_policy: str,
                      schedule: str | None = None) -> list[StageChoice]:
        """Recompute, peak bytes per device and sharding level of every stage.

        A per-stage setting (recompute or sharding) is for plans of its length (the request fixes the
        stage count); the search also scores partial and other-length candidates, which it then drops,
        as under ``"auto"``.
        """
        num_microbatches = self.global_batch_size // rows
        setting = self.resolved_recompute(len(spans), schedule)
        if self.sharding != "none":
            return self._sharded_choices(spans, rows, warmup_policy, schedule, setting)
        inflights = self.inflights(len(spans), num_microbatches, warmup_policy, schedule)
        modes = self.stage_modes(setting, len(spans))
        return [self.stage_choice(span.first, span.stop, rows, span.replicas, span.tensor_parallel, inflights[index],
                                  modes[index]) for index, span in enumerate(spans)]

    def resolved_recompute(self, num_stages: int, schedule: str | None = None) -> RecomputeSetting:
        """The recompute setting for candidates of ``num_stages`` stages under ``schedule`` (default: the model's)."""
        if (schedule or self.schedule) == "zero_bubble":  # split backward cannot rerun a checkpointed forward
            return "never"
        setting = self.recompute
        return "auto" if isinstance(setting, tuple) and len(setting) != num_stages else setting

    @staticmethod
    def stage_modes(setting: RecomputeSetting, num_stages: int) -> tuple[str, ...]:
        """Each stage's own recompute mode under a resolved ``setting`` (a per-stage one: "always" or "never")."""
        if isinstance(setting, str):
            return (setting,) * num_stages
        return tuple("always" if recompute else "never" for recompute in setting)

    def _stage_choice(self, first: int, stop: int, rows: int, replicas: int, tensor_parallel: int, inflight: int,
                      setting: str) -> StageChoice:
        """One unsharded stage's :meth:`stage_choices` entry, which depends on nothing else (memoised; ``setting``:
        the stage's own mode), so moving one cut re-derives only the two stages it bounds."""
        cost = self.cost(first, stop, rows, replicas, tensor_parallel)
        keep = stage_memory_bytes(cost, inflight, self.optimizer)
        if choose_recompute(setting, 0, 1, keep, self.memory_limit_bytes):
            return StageChoice(True, recompute_memory(self.chain, first, stop, cost, inflight, self.optimizer, True,
                                                      "none", 1, 1, tensor_parallel, self.memory_limit_bytes))
        return StageChoice(False, keep)

    def _sharded_choices(self, spans: Sequence[Span], rows: int, warmup_policy: str, schedule: str | None,
                         recompute: RecomputeSetting) -> list[StageChoice]:
        """:meth:`stage_choices` under a sharding request: each stage's levels and recompute choices to try
        (one when forced), the fastest that fits (:meth:`_choose_sharded`)."""
        key = (tuple(spans), rows, warmup_policy, schedule, recompute)
        if key in self._sharded_memo:
            return list(self._sharded_memo[key])
        num_microbatches = self.global_batch_size // rows
        request = self.sharding
        if not isinstance(request, str) and len(request) != len(spans):
            request = "auto"
        choices = []
        for index, span in enumerate(spans):
            levels = self.stage_levels(request, index, span.replicas, schedule)
            if isinstance(recompute, tuple):
                recomputes: tuple[bool, ...] = (recompute[index],)
            else:
                recomputes = {"auto": (False, True), "never": (False,), "always": (True,), "selective": (False,)}[recompute]
            inflight = self.inflight(index, len(spans), num_microbatches, warmup_policy, schedule)
            choices.append(self._sharded_choice(span.first, span.stop, rows, span.leads, inflight, levels,
                                                recomputes, span.tensor_parallel))
        self._sharded_memo[key] = tuple(choices)
        return choices

    def stage_levels(self, request: ShardingRequest, index: int, replicas: int, schedule: str | None
                     ) -> tuple[str, ...]:
        """The levels stage ``index`` may take under ``request`` (a level, "auto" or one per stage) and the schedule."""
        levels = ("none",) if replicas == 1 else SHARDING_LEVELS if request == "auto" else (
            (request,) if isinstance(request, str) else (request[index],))
        return schedule_levels(levels, schedule or self.schedule)

    def _choose_sharded(self, first: int, stop: int, rows: int, devices: tuple[int, ...], inflight: int,
                        levels: tuple[str, ...], recomputes: tuple[bool, ...], tensor_parallel: int = 1
                        ) -> StageChoice:
        """The fastest ``(level, recompute)`` whose memory fits; the one needing least memory if none fits.

        Why per stage and by the stage's own time: a stage's memory depends on its own choice alone, and
        the pivot latency never decreases when a stage's F, B, start or tail grows, so the choice that
        minimises the stage's whole step (its all-gather before the first forward + M (F + B) with the
        collectives and any recomputed forward in them + its tail after the last backward) is the one to
        keep for that stage; the 4 levels x 2 recompute choices are then tried per stage, not per plan
        (8 S combinations would be). Ties keep the earlier option (none before sharded, keep before
        recompute): less communication and no recomputation for the same predicted time.
        """
        cost = self.cost(first, stop, rows, len(devices), tensor_parallel)
        num_microbatches = self.global_batch_size // rows
        best: tuple[float, StageChoice] | None = None
        least: StageChoice | None = None
        for level in levels:
            for recompute in recomputes:
                memory = recompute_memory(self.chain, first, stop, cost, inflight, self.optimizer, recompute, level,
                                          len(devices), num_microbatches, tensor_parallel, self.memory_limit_bytes)
                choice = StageChoice(recompute, memory, level)
                if memory > self.memory_limit_bytes:
                    least = choice if least is None or memory < least.memory else least
                    continue
                forward_s, backward_s, tail_s = self.stage_step(first, stop, rows, devices, recompute, level,
                                                                tensor_parallel)
                start_s = self.stage_comm(first, stop, devices, level, cost.param_bytes, tensor_parallel).start_s
                seconds = start_s + num_microbatches * (forward_s + backward_s) + tail_s
                if best is None or seconds < best[0] * (1 - 1e-12):
                    best = (seconds, choice)
        if best is not None:
            return best[1]
        assert least is not None
        return least

    def fits(self, spans: Sequence[Span], rows: int, warmup_policy: str = "A", schedule: str | None = None) -> bool:
        return max(self.memory(spans, rows, warmup_policy, schedule)) <= self.memory_limit_bytes

    def candidate(self, spans: Sequence[Span], rows: int) -> Candidate:
        return Candidate(self.latency(spans, rows), rows, tuple(spans))
