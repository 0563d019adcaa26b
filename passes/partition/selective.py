"""The planner's per-block recompute choice: the least extra forward time whose saved bytes make a stage fit."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from fxpipe.core.block_recompute import normalized_choices
from fxpipe.core.plan import Plan
from fxpipe.passes.partition.spans import Span, StageChoice
from fxpipe.sim.recompute_cost import member_saving, selective_figures
from fxpipe.sim.stagecost import StageCost, stage_memory_bytes

if TYPE_CHECKING:
    from fxpipe.core.chain import CostChain
    from fxpipe.core.cluster import Cluster
    from fxpipe.core.recompute import RecomputeSetting

# (choice, bytes saved per micro-batch slice, forward seconds added), per block; "keep" is (0, 0)
BlockOptions = Sequence[Sequence[tuple[str, float, float]]]


def block_options(chain: CostChain, first: int, stop: int, rows: int, slowdown: float = 1.0,
                  tensor_parallel: int = 1, cluster: Cluster | None = None) -> list[list[tuple[str, float, float]]]:
    """Each block's useful choices with one device's figures (:func:`fxpipe.sim.recompute_cost.member_saving`; a
    T-way member reruns its collectives too): "keep", "attention" where the block has a core, "block" where it
    saves bytes."""
    options = []
    for index in range(first, stop):
        found = [("keep", 0.0, 0.0)]
        for choice in ("attention", "block"):
            num_bytes, seconds = member_saving(chain, index, choice, rows, slowdown, tensor_parallel, cluster)
            if num_bytes > 0:
                found.append((choice, num_bytes, seconds))
        options.append(found)
    return options


def fits(saved: Sequence[float], inflight: int, excess_bytes: float) -> bool:
    """Whether per-block ``saved`` bytes take ``excess_bytes`` off a stage's peak: every in-flight micro-batch
    keeps less, and one block's recomputed part is rebuilt at a time (fxpipe.sim.stagecost.saved_bytes)."""
    return inflight * sum(saved) - max(saved, default=0.0) >= excess_bytes


# stages of at most this many blocks with a choice to make are searched exhaustively (3^6 = 729 combinations)
EXHAUSTIVE_BLOCKS = 6


def pick_block_choices(options: BlockOptions, inflight: int, excess_bytes: float) -> tuple[str, ...] | None:
    """Per block a choice whose saved bytes cover ``excess_bytes`` (what keeping everything overflows) at the least
    added time; None when recomputing everything still does not.

    Exhaustive over the blocks with a choice when they are few (:data:`EXHAUSTIVE_BLOCKS`), else greedy
    (:func:`greedy_block_choices`; tests/test_selective_recompute.py compares the two).
    """
    open_blocks = [block for block, choices in enumerate(options) if len(choices) > 1]
    if len(open_blocks) > EXHAUSTIVE_BLOCKS:
        return greedy_block_choices(options, inflight, excess_bytes)
    best: tuple[float, tuple[int, ...]] | None = None
    for picked in itertools.product(*(range(len(options[block])) for block in open_blocks)):
        saved = [options[block][index][1] for block, index in zip(open_blocks, picked, strict=True)]
        seconds = sum(options[block][index][2] for block, index in zip(open_blocks, picked, strict=True))
        if fits(saved, inflight, excess_bytes) and (best is None or seconds < best[0] * (1 - 1e-12)):
            best = (seconds, picked)
    if best is None:
        return None
    chosen = dict(zip(open_blocks, best[1], strict=True))
    return tuple(choices[chosen.get(block, 0)][0] for block, choices in enumerate(options))


def greedy_block_choices(options: BlockOptions, inflight: int, excess_bytes: float) -> tuple[str, ...] | None:
    """:func:`pick_block_choices` for many blocks: from all "keep", take the upgrade with the most bytes per added
    second until the stage fits, then undo any upgrade (costliest first) it still fits without."""
    state = [0] * len(options)  # index into each block's options
    saved = [0.0] * len(options)

    def current(block: int) -> tuple[str, float, float]:
        return options[block][state[block]]

    while not fits(saved, inflight, excess_bytes):
        best: tuple[float, int, int] | None = None
        for block, choices in enumerate(options):
            _, have_bytes, have_s = current(block)
            for option_index, (_, num_bytes, seconds) in enumerate(choices):
                gain = num_bytes - have_bytes
                if gain <= 0:
                    continue
                ratio = gain / max(seconds - have_s, 1e-30)
                if best is None or ratio > best[0]:
                    best = (ratio, block, option_index)
        if best is None:
            return None
        _, block, option_index = best
        state[block] = option_index
        saved[block] = current(block)[1]
    for block in sorted(range(len(options)), key=lambda b: -current(b)[2]):
        for option_index in range(state[block]):  # cheaper options of this block, keep first
            trial = [*saved[:block], options[block][option_index][1], *saved[block + 1:]]
            if fits(trial, inflight, excess_bytes):
                state[block], saved = option_index, trial
                break
    return tuple(current(block)[0] for block in range(len(options)))


class StageCosts(Protocol):
    """What :func:`selective_choice` reads of the planner's cost model (passes/partition/candidates.CandidateCosts),
    as a Protocol so that the two modules do not import each other."""

    chain: CostChain
    cluster: Cluster
    optimizer: str
    memory_limit_bytes: int
    global_batch_size: int
    recompute: RecomputeSetting

    @property
    def cost(self) -> Callable[..., StageCost]: ...  # (first, stop, rows, replicas, tensor_parallel), memoised there


def selective_choice(model: StageCosts, span: Span, rows: int, inflight: int, choice: StageChoice,
                     schedule: str) -> tuple[StageChoice, tuple[str, ...]]:
    """A stage's choice with per-block recompute where the setting asks for it: under ``"auto"`` a stage the
    search recomputes whole gets the cheapest per-block choices that fit (:func:`pick_block_choices`); under
    ``"selective"`` every block with an attention core recomputes it. Returns the choice (recompute flag and
    memory redone) and the per-block choices (``()``: the flag alone says).

    A stage that recomputes every block keeps today's whole-stage checkpoint where that fits; else its choices stay
    per block, all "block" (:func:`recompute_memory` priced it so)."""
    setting = model.recompute
    if schedule == "zero_bubble" or not (setting == "selective" or choice.recompute):
        return choice, ()
    cost = model.cost(span.first, span.stop, rows, span.replicas, span.tensor_parallel)
    num_microbatches = model.global_batch_size // rows
    whole_fits = stage_memory_bytes(
        cost, inflight, model.optimizer, True, sharding=choice.sharding, replicas=span.replicas,
        num_microbatches=num_microbatches) <= model.memory_limit_bytes
    if setting not in ("auto", "selective") and (whole_fits or not choice.recompute):
        return choice, ()
    options = block_options(model.chain, span.first, span.stop, cost.rows, model.cluster.compute_slowdown,
                            span.tensor_parallel, model.cluster)

    def memory(choices: tuple[str, ...]) -> int:
        selective = selective_figures(model.chain, span.first, choices, cost.rows, tensor_parallel=span.tensor_parallel)
        return stage_memory_bytes(cost, inflight, model.optimizer, False, sharding=choice.sharding,
                                  replicas=span.replicas, num_microbatches=num_microbatches, selective=selective)

    every_block = ("block",) * (span.stop - span.first)
    picked: tuple[str, ...] | None = every_block  # "always" or this stage's own flag
    if setting == "selective":
        picked = tuple("attention" if any(name == "attention" for name, _, _ in block) else "keep" for block in options)
    elif setting == "auto":
        picked = pick_block_choices(options, inflight, memory(()) - model.memory_limit_bytes)
    if picked is None and (whole_fits or memory(every_block) > model.memory_limit_bytes):
        return choice, ()  # nothing per block fits better than the whole-stage checkpoint the search costed
    recompute, block_recompute = normalized_choices(picked or every_block)
    if recompute and whole_fits:  # every block recomputed: the whole-stage checkpoint the search costed
        return choice, ()
    block_recompute = every_block if recompute else block_recompute
    return StageChoice(False, memory(block_recompute), choice.sharding), block_recompute


def recompute_memory(chain: CostChain, first: int, stop: int, cost: StageCost, inflight: int, optimizer: str,
                     recompute: bool, sharding: str, replicas: int, num_microbatches: int, tensor_parallel: int = 1,
                     limit_bytes: float = float("inf")) -> int:
    """:func:`fxpipe.sim.stagecost.stage_memory_bytes` as the search prices a stage. One that recomputes keeps the
    whole-stage checkpoint where it fits in ``limit_bytes``; else it recomputes per block, every block "block",
    where that needs less (each in-flight micro-batch keeps every block's input, one block is rebuilt at a time; on
    a sharded stage each checkpoint sits inside its block's FSDP unit, as torchtitan checkpoints then shards each
    block, so a ZeRO-3 stage gathers one block's weights at a time instead of the stage's);
    :func:`selective_choice` then writes the choices per block. The same rule for every level: the ZeRO-1 stages of the
    forced 16-stage 462B layout of benchmarks/scale_study.py fit recomputed whole and not per block."""
    whole = stage_memory_bytes(cost, inflight, optimizer, recompute, sharding=sharding, replicas=replicas,
                               num_microbatches=num_microbatches)
    if not recompute or whole <= limit_bytes:
        return whole
    selective = selective_figures(chain, first, ("block",) * (stop - first), cost.rows, tensor_parallel=tensor_parallel)
    per_block = stage_memory_bytes(cost, inflight, optimizer, False, sharding=sharding, replicas=replicas,
                                   num_microbatches=num_microbatches, selective=selective)
    return min(whole, per_block)


def with_block_node_counts(plan: Plan, chain: CostChain) -> Plan:
    """``plan`` whose stages with per-block choices record how many node names each block holds (the runtime
    finds a block's nodes by them: fxpipe.passes.recompute_regions); other stages keep their bytes."""
    return plan.with_updates(stages=tuple(
        replace(stage, block_node_counts=tuple(len(block.node_names)
                                               for block in chain.blocks[stage.first_block:stage.stop_block]))
        if stage.block_recompute else stage for stage in plan.stages))
