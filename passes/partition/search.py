"""DAPPLE's planner search: states (blocks planned, device usage), transitions that split the final stage."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.placement import Usage, host_aligned, placements, replica_choices
from fxpipe.passes.partition.spans import Candidate, Span
from fxpipe.sim.stagecost import optimizer_factor
from fxpipe.sim.tensor_parallel_cost import tensor_parallel_degrees, tied_degree_conflict

# The pivot model is within a few percent of the simulator on most plans (worst ~17%), so a branch is
# cut only when its lower bound exceeds the best latency so far by this much.
PRUNE_SLACK = 0.1
# Default beam: prefixes kept per state = BEAM_BUDGET / (blocks x devices), between 1 and MAX_BEAM_WIDTH.
BEAM_BUDGET = 400
MAX_BEAM_WIDTH = 8
# On host-aligned (large) clusters at most STATE_BUDGET states are expanded per micro-batch size.
STATE_BUDGET = 256


@dataclass(order=True)
class _State:
    """A prefix of stages over blocks ``[0, stop)``; ``rank`` orders states sharing a canonical key."""

    rank: tuple[int, float]
    stop: int = field(compare=False)
    usage: Usage = field(compare=False)
    spans: tuple[Span, ...] = field(compare=False)
    work_s: float = field(default=0.0, compare=False)  # sum of F+B over the prefix's steps (transfers too)
    bound_s: float = field(default=0.0, compare=False)  # max_s [work up to s + (M-1)(F_s+B_s)]: L >= this


@dataclass
class SearchResult:
    """Memory-feasible complete candidates found for one micro-batch size, and the closest miss."""

    candidates: list[Candidate]
    closest_miss: Candidate | None = None
    closest_ratio: float = float("inf")


class _Search:
    """One run of the state search for a fixed micro-batch size ``rows``."""

    def __init__(self, model: CandidateCosts, rows: int, layout: tuple[int, ...] | None,
                 bound_s: float, beam_width: int, pool_size: int, all_devices: bool = False,
                 num_stages: int | None = None, accept: Callable[[Candidate], bool] | None = None,
                 degrees: tuple[int, ...] | None = None) -> None:
        self.model = model
        self.all_devices = all_devices
        self.rows = rows
        self.num_microbatches = model.global_batch_size // rows
        self.num_blocks = model.chain.num_blocks
        self.layout = layout
        # per stage: the tensor-parallel group size forced by the layout, or None for every worthwhile one
        self.degrees = degrees
        self.tensor_parallel = tensor_parallel_degrees(model.chain, model.cluster.devices_per_host)
        # tied weights constrain T only where a stage can take T > 1 (tied_degree_conflict in record)
        self.tied = bool(model.chain.shared_params) and len(self.tensor_parallel) > 1
        self.max_stages = min(self.num_microbatches, self.num_blocks, model.cluster.num_devices)
        if layout is not None:
            self.max_stages = min(self.max_stages, len(layout))
        self.accept = accept
        if num_stages is not None:
            self.max_stages = min(self.max_stages, num_stages)
        self.bound_s = bound_s
        self.beam_width = beam_width
        self.pool_size = pool_size
        self.pool: dict[tuple[object, ...], Candidate] = {}
        self.result = SearchResult([])
        per_sample = [b.forward_s.per_sample + b.backward_s.per_sample for b in model.chain.blocks]
        self.suffix_work = [0.0] * (self.num_blocks + 1)
        for index in range(self.num_blocks - 1, -1, -1):
            self.suffix_work[index] = self.suffix_work[index + 1] + per_sample[index]
        self.weight_factor = optimizer_factor(model.optimizer)
        # Large clusters: expand only the best states at every depth (a global beam over all keys).
        self.max_states_per_depth = (max(4, STATE_BUDGET // self.num_blocks)
                                     if host_aligned(model.cluster) else None)

    def limit(self) -> float:
        return self.bound_s * (1.0 + PRUNE_SLACK)

    def record(self, spans: tuple[Span, ...]) -> tuple[bool, float]:
        """Score a complete plan and keep it if it fits in memory; returns (fits, pivot latency)."""
        candidate = self.model.candidate(spans, self.rows)
        if self.all_devices and candidate.num_devices != self.model.cluster.num_devices:
            return False, candidate.latency_s
        if self.layout is not None and candidate.layout != self.layout:
            return False, candidate.latency_s
        if self.degrees is not None and candidate.degrees != self.degrees:
            return False, candidate.latency_s
        if self.accept is not None and not self.accept(candidate):
            return False, candidate.latency_s
        if self.tied and tied_degree_conflict(self.model.chain, [(span.first, span.stop, span.tensor_parallel)
                                                                 for span in spans]):
            return False, candidate.latency_s
        ratio = max(self.model.memory(spans, self.rows, "A")) / self.model.memory_limit_bytes
        if ratio > 1.0:
            if ratio < self.result.closest_ratio:
                self.result.closest_ratio, self.result.closest_miss = ratio, candidate
            return False, candidate.latency_s
        self.pool.setdefault(candidate.identity(), candidate)
        if len(self.pool) > 4 * self.pool_size:
            self._trim()
        self.bound_s = min(self.bound_s, candidate.latency_s)
        return True, candidate.latency_s

    def _trim(self) -> None:
        kept = sorted(self.pool.values())[: self.pool_size]
        self.pool = {c.identity(): c for c in kept}

    def completion(self, stop: int, usage: Usage, spans: tuple[Span, ...]) -> tuple[int, float]:
        """Rank of a state: its prefix plus one final stage on every remaining device (paper 1.3)."""
        if stop == self.num_blocks:
            return (0, self.model.latency(spans, self.rows))
        if usage.num_free == 0 or len(spans) + 1 > self.max_stages:
            return (2, float("inf"))
        best = (2, float("inf"))
        for degree in sorted({1, self.final_degree(usage, spans)}):  # T = 1, and the last stage's T where it fits
            if usage.num_free // degree <= self.rows:
                fits, latency = self.record((*spans, Span(stop, self.num_blocks, usage.take_all()[1], degree)))
                best = min(best, (0 if fits else 1, latency))
        return best

    @staticmethod
    def final_degree(usage: Usage, spans: tuple[Span, ...]) -> int:
        """The group size of a completing stage: the prefix's last stage's where every host's free devices hold
        whole groups (so prefixes of T-way stages compete with fair completions), else 1."""
        degree = spans[-1].tensor_parallel if spans else 1
        if degree > 1 and any((usage.per_host - used) % degree for used in usage.used):
            return 1
        return degree

    def run(self) -> SearchResult:
        empty = Usage.empty(self.model.cluster)
        buckets: list[dict[tuple[int, ...], list[_State]]] = [{} for _ in range(self.num_blocks + 1)]
        buckets[0][empty.key()] = [_State((0, 0.0), 0, empty, ())]
        for stop in range(self.num_blocks):
            states = sorted(state for bucket in buckets[stop].values() for state in bucket)
            for state in states[: self.max_states_per_depth]:
                self.expand(state, buckets)
        self._trim()
        self.result.candidates = sorted(self.pool.values())
        return self.result

    def expand(self, state: _State, buckets: list[dict[tuple[int, ...], list[_State]]]) -> None:
        """Split the state's final stage: a new stage of ``replicas`` devices, then the rest."""
        if len(state.spans) >= self.max_stages:
            return
        per_host = self.model.cluster.devices_per_host
        near = frozenset(d // per_host for d in state.spans[-1].devices) if state.spans else frozenset()
        for replicas, degree in self.choices(state):
            for counts in placements(state.usage, replicas * degree, near, degree):  # whole T-groups per host
                usage, devices = state.usage.take(counts)
                self.extend(state, usage, devices, buckets, degree)

    def choices(self, state: _State) -> list[tuple[int, int]]:
        """``(replicas, T)`` the next stage may take: forced by the layout, else the replica counts of
        :func:`replica_choices` for T = 1 and the device counts it allows that T divides for each T > 1."""
        free, index = state.usage.num_free, len(state.spans)
        if self.layout is not None:
            replicas, degree = self.layout[index], (self.degrees[index] if self.degrees else 1)
            return [(replicas, degree)] if replicas <= self.rows and replicas * degree <= free else []
        found: list[tuple[int, int]] = []
        for degree in self.tensor_parallel:
            found.extend((count // degree, degree) for count in replica_choices(self.model.cluster, free, self.rows * degree)
                         if count % degree == 0 and count // degree <= self.rows)
        return found

    def extend(self, state: _State, usage: Usage, devices: tuple[int, ...],
               buckets: list[dict[tuple[int, ...], list[_State]]], degree: int = 1) -> None:
        """Add stages ``[state.stop, stop)`` on ``devices`` for every ``stop``, pruning by lower bounds.

        The pivot latency of any completion is at least max_s [sum_{t<=s}(F_t+B_t) + (M-1)(F_s+B_s)]
        over its steps, so prefix steps give a valid bound; the new stage's term grows with ``stop``.
        """
        model, first, replicas, m = self.model, state.stop, len(devices) // degree, self.num_microbatches
        last_stage = len(state.spans) + 1 == self.max_stages
        work, bound = state.work_s, state.bound_s
        if state.spans:
            previous = state.spans[-1]
            hop = model.hop(previous.stop - 1, self.rows, previous.leads, devices[::degree])
            bound = max(bound, work + m * 2 * hop)
            work += 2 * hop
        for stop in range(first + 1, self.num_blocks + 1):
            cost = model.cost(first, stop, self.rows, replicas, degree)
            step = cost.forward_s + cost.backward_s
            new_bound = max(bound, work + m * step)
            if new_bound > self.limit():
                return  # the new stage alone is too slow, and only grows with more blocks
            if model.least_state_bytes(first, stop, replicas, cost.param_bytes * self.weight_factor, m, degree) \
                    > model.memory_limit_bytes:
                return  # its weights, gradients and optimizer state alone overflow, and only grow with more blocks
            spans = (*state.spans, Span(first, stop, devices, degree))
            if stop == self.num_blocks:
                self.record(spans)
                return
            if last_stage or usage.num_free == 0:
                continue
            remainder_bound = work + step + m * self.suffix_work[stop] * self.rows / usage.num_free
            if remainder_bound > self.limit():
                continue
            rank = self.rank(stop, usage, spans, work + step, new_bound)
            bucket = buckets[stop].setdefault(usage.key(), [])
            if len(bucket) < self.beam_width or rank < bucket[-1].rank:
                self.insert(bucket, _State(rank, stop, usage, spans, work + step, new_bound))

    def rank(self, stop: int, usage: Usage, spans: tuple[Span, ...], work: float, bound: float
             ) -> tuple[int, float]:
        """The completion's latency when its lower bound is within reach, else that bound (ranked last)."""
        degree = self.final_degree(usage, spans)
        if usage.num_free // degree > self.rows:
            return (2, float("inf"))
        final = self.model.cost(stop, self.num_blocks, self.rows, usage.num_free // degree, degree)
        if degree > 1 and usage.num_free <= self.rows:  # either completion may be the faster one
            whole = self.model.cost(stop, self.num_blocks, self.rows, usage.num_free)
            final = min(final, whole, key=lambda cost: cost.forward_s + cost.backward_s)
        lower = max(bound, work + self.num_microbatches * (final.forward_s + final.backward_s))
        if lower > self.limit():
            return (1, lower)
        return self.completion(stop, usage, spans)

    def insert(self, states: list[_State], state: _State) -> None:
        states.append(state)
        states.sort()
        del states[self.beam_width:]


def search(model: CandidateCosts, rows: int, *, layout: tuple[int, ...] | None = None,
           bound_s: float = float("inf"), beam_width: int | None = None, pool_size: int = 32,
           all_devices: bool = False, num_stages: int | None = None,
           accept: Callable[[Candidate], bool] | None = None, degrees: tuple[int, ...] | None = None) -> SearchResult:
    """Best memory-feasible candidates for micro-batch size ``rows`` by the pivot model.

    ``bound_s`` is a known achievable latency (e.g. plain DP) used to prune from the start;
    ``beam_width`` prefixes are kept per canonical state (blocks planned, sorted per-host usage); by
    default several on small problems (where it is cheap and closes gaps to exhaustive search) and
    one on large ones. ``all_devices`` keeps only plans that give every device of the cluster a role;
    ``num_stages`` caps the stage count; ``accept`` filters complete candidates. Each stage may be
    T-way tensor-parallel groups, T in :func:`tensor_parallel_degrees` (``degrees``: forced per stage, with
    ``layout``), each group inside one host.
    """
    if beam_width is None:
        size = model.chain.num_blocks * model.cluster.num_devices
        beam_width = max(1, min(MAX_BEAM_WIDTH, BEAM_BUDGET // size))
    return _Search(model, rows, layout, bound_s, beam_width, pool_size, all_devices, num_stages, accept,
                   degrees).run()
