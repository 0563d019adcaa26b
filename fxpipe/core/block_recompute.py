"""Selective recompute per block: the three choices, their checks, and a stage's effective choices."""

from __future__ import annotations

from collections.abc import Sequence

# keep: every activation saved; block: only the block's inputs kept, its forward runs again in backward;
# attention: only attention's core (QK^T .. softmax .. xV, or an SDPA call) runs again (Megatron's selective recompute)
BLOCK_CHOICES = ("keep", "block", "attention")


def block_recompute_problems(stage_index: int, num_blocks: int, recompute: bool, block_recompute: Sequence[str],
                             block_node_counts: Sequence[int] = (), num_nodes: int = 0) -> list[str]:
    """What is wrong with a stage's ``block_recompute`` (empty when fine): one known choice per block, never beside
    ``recompute=True`` (which already means every block is recomputed); ``block_node_counts``, when given, one
    count per block adding up to the stage's ``num_nodes`` node names."""
    problems = []
    if block_node_counts and (len(block_node_counts) != num_blocks or sum(block_node_counts) != num_nodes
                              or min(block_node_counts) < 0):
        problems.append(f"stage {stage_index} has block_node_counts {list(block_node_counts)} for {num_blocks} blocks "
                        f"and {num_nodes} node names; give each block's count of the stage's node names, in order")
    if not block_recompute:
        return problems
    if len(block_recompute) != num_blocks:
        problems.append(f"stage {stage_index} has block_recompute {list(block_recompute)} for {num_blocks} blocks; "
                        f"give one of {list(BLOCK_CHOICES)} per block of the stage")
    unknown = [choice for choice in block_recompute if choice not in BLOCK_CHOICES]
    if unknown:
        problems.append(f"stage {stage_index} has block_recompute choices {unknown}; choose each from "
                        f"{list(BLOCK_CHOICES)}")
    if recompute:
        problems.append(f"stage {stage_index} has recompute=true and block_recompute {list(block_recompute)}; "
                        "recompute=true already recomputes every block: leave block_recompute out or set recompute false")
    return problems


def normalized_choices(choices: Sequence[str]) -> tuple[bool, tuple[str, ...]]:
    """``(recompute, block_recompute)`` storing ``choices``: all "keep" is ``(False, ())`` and all "block" today's
    whole-stage flag ``(True, ())``, so plans without selective recompute keep their bytes."""
    if all(choice == "keep" for choice in choices):
        return False, ()
    if all(choice == "block" for choice in choices):
        return True, ()
    return False, tuple(choices)


def effective_choices(num_blocks: int, recompute: bool, block_recompute: Sequence[str]) -> tuple[str, ...]:
    """One choice per block of a stage: ``block_recompute`` when given, else every block "block" or "keep"."""
    if block_recompute:
        return tuple(block_recompute)
    return ("block" if recompute else "keep",) * num_blocks


def is_selective(block_recompute: Sequence[str]) -> bool:
    """Whether a stage mixes choices (its costs then come from :mod:`fxpipe.sim.recompute_cost`)."""
    return bool(block_recompute)


def expanded_choices(choices: Sequence[str], first: int, stops: Sequence[int]) -> tuple[str, ...]:
    """Choices of coarse blocks ``first, first + 1, ...`` restated per fine block; coarse block ``i`` is fine blocks
    ``[stops[i - 1], stops[i])`` (``stops[-1]`` = 0): each fine block takes its coarse block's choice."""
    starts = [0, *stops]
    return tuple(choice for offset, choice in enumerate(choices)
                 for _ in range(starts[first + offset + 1] - starts[first + offset]))
