"""Selective recompute's costs on plain numbers: per block, the bytes each choice saves and the forward it reruns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import CostChain


@dataclass(frozen=True)
class SelectiveRecompute:
    """What a stage's per-block choices do to one micro-batch slice (fxpipe.core.block_recompute).

    ``saved_bytes``: bytes each in-flight micro-batch no longer keeps; ``transient_bytes``: the largest recomputed
    part, rebuilt for one micro-batch at a time while its backward runs; ``extra_forward_s``: forward seconds run
    again in backward (stretched like compute).
    """

    saved_bytes: float
    transient_bytes: float
    extra_forward_s: float


def block_saving(chain: CostChain, index: int, choice: str, rows: int) -> tuple[float, float]:
    """``(bytes saved, forward seconds added)`` of one choice for block ``index`` on a slice of ``rows`` rows.

    "attention" saves its core's bytes (:attr:`fxpipe.core.chain.Block.attention_core_bytes`; 0 without one) for
    its core's forward. "block" keeps only what the block reads (the cut before it; the model's input for block 0)
    and the loss's saved tensors (the loss runs outside the recomputed forward), for the whole block's forward.
    """
    block = chain.blocks[index]
    if choice == "keep":
        return 0.0, 0.0
    if choice == "attention":
        return block.attention_core_bytes.at(rows), block.attention_core_s.at(rows)
    assert choice == "block", f"unknown block recompute choice {choice!r}"
    reads = chain.input_bytes if index == 0 else chain.cut_bytes[index - 1]
    loss = chain.loss_saved_bytes if index == chain.num_blocks - 1 else None
    kept = reads.at(rows) + (loss.at(rows) if loss is not None else 0.0)
    return max(0.0, block.saved_bytes.at(rows) - kept), block.forward_s.at(rows)


def selective_figures(chain: CostChain, first: int, choices: Sequence[str], rows: int, slowdown: float = 1.0,
                      tensor_parallel: int = 1) -> SelectiveRecompute | None:
    """A stage's figures for per-block ``choices`` over blocks ``[first, first + len(choices))``; None for no
    choices (the stage follows its whole-stage ``recompute`` flag). Under a T-way group each member recomputes
    and saves 1/T (attention heads and, under sequence parallelism, the rest split T ways)."""
    if not choices:
        return None
    savings = [block_saving(chain, first + offset, choice, rows) for offset, choice in enumerate(choices)]
    scale = 1.0 / tensor_parallel
    return SelectiveRecompute(saved_bytes=sum(b for b, _ in savings) * scale,
                              transient_bytes=max(b for b, _ in savings) * scale,
                              extra_forward_s=sum(s for _, s in savings) * slowdown * scale)


def selective_seconds(chain: CostChain, first: int, choices: Sequence[str], rows: int, slowdown: float = 1.0,
                      tensor_parallel: int = 1) -> float:
    """The forward seconds per-block ``choices`` rerun in one backward (0.0 without choices)."""
    figures = selective_figures(chain, first, choices, rows, slowdown, tensor_parallel)
    return figures.extra_forward_s if figures is not None else 0.0
