"""Contiguous block partitions: min-max balance (torchgpipe), chain coarsening and local cut refinement."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import numpy as np

from fxpipe.core.chain import (
    Block,
    CostChain,
    block_units,
    merged_resaved,
    merged_tensor_parallel,
    merged_units,
    regroup_shared_params,
)
from fxpipe.core.costgraph import Affine

# Above this many (blocks x parts) the exact O(parts x blocks^2) balance gives way to bisection.
EXACT_BALANCE_LIMIT = 4096


def uniform_cuts(num_blocks: int, num_parts: int) -> list[int]:
    """Stop indices of ``num_parts`` parts with (nearly) equal block counts (DeepSpeed's ``uniform``)."""
    return [round(num_blocks * (part + 1) / num_parts) for part in range(num_parts)]


def param_weights(chain: CostChain) -> list[float]:
    """Each block's parameter bytes, as weights for :func:`balanced_cuts`."""
    return [float(block.param_bytes) for block in chain.blocks]


def work_weights(chain: CostChain) -> list[float]:
    """Each block's per-sample forward + backward seconds, as weights for :func:`balanced_cuts`."""
    return [block.forward_s.per_sample + block.backward_s.per_sample for block in chain.blocks]


def balanced_cuts(weights: Sequence[float], num_parts: int) -> list[int]:
    """Stop indices of ``num_parts`` non-empty contiguous parts minimising the largest part sum.

    Exact dynamic program (torchgpipe's ``balance_by_time`` solves the same block-partition
    problem), vectorised over a part's start; ties prefer earlier cuts so the result is deterministic.
    """
    num_items = len(weights)
    if not 1 <= num_parts <= num_items:
        raise ValueError(f"cannot cut {num_items} blocks into {num_parts} non-empty parts")
    if num_items * num_parts > EXACT_BALANCE_LIMIT:
        return _bisected_cuts(weights, num_parts)
    prefix_list = [0.0]
    for weight in weights:
        prefix_list.append(prefix_list[-1] + weight)  # left to right, as the plain loop always summed
    prefix = np.array(prefix_list)
    inf = float("inf")
    # best[k][i]: smallest possible largest part when the first i items form k parts.
    best = np.full((num_parts + 1, num_items + 1), inf)
    choice = [[0] * (num_items + 1) for _ in range(num_parts + 1)]
    best[0][0] = 0.0
    for parts in range(1, num_parts + 1):
        for stop in range(parts, num_items - (num_parts - parts) + 1):
            # every start in [parts - 1, stop); the first smallest wins, as the strict-< scan did
            values = np.maximum(best[parts - 1, parts - 1:stop], prefix[stop] - prefix[parts - 1:stop])
            offset = int(np.argmin(values))
            if values[offset] < inf:
                best[parts, stop], choice[parts][stop] = values[offset], parts - 1 + offset
    stops = []
    stop = num_items
    for parts in range(num_parts, 0, -1):
        stops.append(stop)
        stop = choice[parts][stop]
    return stops[::-1]


def _greedy_stops(weights: Sequence[float], limit: float) -> list[int]:
    stops, running = [], 0.0
    for index, weight in enumerate(weights):
        if running + weight > limit and running > 0:
            stops.append(index)
            running = 0.0
        running += weight
    return [*stops, len(weights)]


def _bisected_cuts(weights: Sequence[float], num_parts: int) -> list[int]:
    """Min-max partition by bisection on the largest part (greedy feasibility), for long sequences."""
    low, high = max(weights), sum(weights)
    for _ in range(100):
        middle = (low + high) / 2
        if len(_greedy_stops(weights, middle)) <= num_parts:
            high = middle
        else:
            low = middle
    stops = _greedy_stops(weights, high)
    while len(stops) < num_parts:  # split the heaviest multi-block part until there are num_parts
        starts = [0, *stops[:-1]]
        part = max((i for i in range(len(stops)) if stops[i] - starts[i] > 1),
                   key=lambda i: sum(weights[starts[i]:stops[i]]))
        stops.insert(part, (starts[part] + stops[part]) // 2)
    return stops


def coarse_boundaries(chain: CostChain, num_groups: int) -> list[int]:
    """Fine block indices where ``num_groups`` groups of about equal per-sample compute end."""
    work = [b.forward_s.per_sample + b.backward_s.per_sample + b.forward_s.fixed + b.backward_s.fixed
            for b in chain.blocks]
    total = sum(work) or 1.0
    stops: list[int] = []
    running = 0.0
    for index, value in enumerate(work[:-1]):
        running += value
        target = total * (len(stops) + 1) / num_groups
        if running >= target and (not stops or stops[-1] < index + 1):
            stops.append(index + 1)
        if len(stops) == num_groups - 1:
            break
    # Fill up with evenly spaced cuts when compute is concentrated in a few blocks.
    step = max(1, chain.num_blocks // num_groups)
    extra = iter(range(step, chain.num_blocks, step))
    while len(stops) < num_groups - 1:
        candidate = next(extra, None)
        if candidate is None:
            break
        if candidate not in stops:
            stops.append(candidate)
    return sorted(set(stops)) + [chain.num_blocks]


def coarsen_chain(chain: CostChain, stops: Sequence[int]) -> CostChain:
    """Merge the blocks of every group ``[stops[i-1], stops[i])`` into one block."""
    blocks = []
    first = 0
    group_of_block = [bisect.bisect_right(stops, block) for block in range(chain.num_blocks)]
    for group, stop in enumerate(stops):
        members = chain.blocks[first:stop]
        blocks.append(Block(
            name=f"{members[0].name}..{members[-1].name}" if len(members) > 1 else members[0].name,
            node_names=tuple(n for block in members for n in block.node_names),
            forward_s=Affine.total(block.forward_s for block in members),
            backward_s=Affine.total(block.backward_s for block in members),
            param_bytes=sum(block.param_bytes for block in members),
            saved_bytes=Affine.total(block.saved_bytes for block in members),
            resaved=merged_resaved(((group_of_block[saver], num_bytes) for block in members
                                    for saver, num_bytes in block.resaved), group),
            tp=merged_tensor_parallel(members),
            units=merged_units(entry for block in members for entry in block_units(block)),
            attention_core_bytes=Affine.total(block.attention_core_bytes for block in members),
            attention_core_s=Affine.total(block.attention_core_s for block in members),
        ))
        first = stop
    cuts = tuple(chain.cut_bytes[stop - 1] for stop in stops[:-1])
    return CostChain(tuple(blocks), cuts, chain.input_bytes, chain.output_bytes, chain.source,
                     regroup_shared_params(chain.shared_params, group_of_block),
                     loss_saved_bytes=chain.loss_saved_bytes, input_saved_bytes=chain.input_saved_bytes,
                     target_saved_bytes=chain.target_saved_bytes)


def refine_cuts(stops: list[int], num_blocks: int, score: Callable[[list[int]], float],
                max_rounds: int = 4) -> list[int]:
    """Move each cut to a better position (steps halving from a quarter of its room) until none helps."""
    best_stops, best_score = list(stops), score(stops)
    for _ in range(max_rounds):
        improved = False
        for index in range(len(best_stops) - 1):
            low = best_stops[index - 1] + 1 if index else 1
            high = best_stops[index + 1] - 1
            step = max(1, (high - low) // 4)
            while step >= 1:
                moved = False
                for delta in (-step, step):
                    position = best_stops[index] + delta
                    if not low <= position <= high:
                        continue
                    trial = best_stops[:index] + [position] + best_stops[index + 1:]
                    value = score(trial)
                    if value < best_score:
                        best_stops, best_score, moved, improved = trial, value, True, True
                if not moved:
                    step //= 2
        if not improved:
            break
    assert best_stops[-1] == num_blocks
    return best_stops


def holds_parameters(chain: CostChain) -> list[bool]:
    """Whether each block reads a trainable parameter: its own bytes or a copy of a tied one."""
    shared = {block for param in chain.shared_params for block in param.blocks}
    return [block.param_bytes > 0 or index in shared for index, block in enumerate(chain.blocks)]


def parameter_groups(chain: CostChain) -> list[int]:
    """Stops of the coarsest grouping in which every group holds parameters (the cuttable blocks).

    A block without parameters joins the group before it (leading ones join the first group), so any
    contiguous partition of the groups gives every stage something for its optimizer. A chain with no
    parameters at all keeps every block as its own group.
    """
    holders = [index for index, holds in enumerate(holds_parameters(chain)) if holds]
    if not holders:
        return list(range(1, chain.num_blocks + 1))
    return [*holders[1:], chain.num_blocks]
