"""Selective recompute's costs on plain numbers: per block, the bytes each choice saves and the forward it reruns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxpipe.sim.tensor_parallel_cost import splits, tensor_parallel_saved, tensor_parallel_times

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import CostChain
    from fxpipe.core.cluster import Cluster


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
    return max(0.0, block.saved_bytes.at(rows) - _kept_bytes(chain, index, rows)), block.forward_s.at(rows)


def _kept_bytes(chain: CostChain, index: int, rows: int) -> float:
    """What a recomputed block still keeps: what it reads (the model's input for block 0) and, last block, the loss's
    saved tensors."""
    reads = chain.input_bytes if index == 0 else chain.cut_bytes[index - 1]
    loss = chain.loss_saved_bytes if index == chain.num_blocks - 1 else None
    return reads.at(rows) + (loss.at(rows) if loss is not None else 0.0)


def member_saving(chain: CostChain, index: int, choice: str, rows: int, slowdown: float = 1.0, tensor_parallel: int = 1,
                  cluster: Cluster | None = None) -> tuple[float, float]:
    """:func:`block_saving` on one member of a T-way group, its seconds stretched by ``slowdown``
    (:mod:`fxpipe.sim.tensor_parallel_cost`'s legend). Where the block splits over T, a member's core is 1/T of it
    (heads divide), and a recomputed block saves the member's share of its activations less what it reads (whole
    on every member) and reruns the member's forward, its collectives included (``cluster``: the group's links;
    None leaves them out, for callers after bytes alone). A block that does not split runs whole on every member."""
    num_bytes, seconds = block_saving(chain, index, choice, rows)
    block = chain.blocks[index]
    if choice == "keep" or not splits(block, tensor_parallel):
        return num_bytes, seconds * slowdown
    if choice == "attention":
        return num_bytes / tensor_parallel, seconds * slowdown / tensor_parallel
    member_saved = tensor_parallel_saved(chain, index, index + 1, tensor_parallel).at(rows)
    kept = _kept_bytes(chain, index, rows)
    if cluster is None:
        assert block.tp is not None
        share = (1.0 - block.tp.time_share) + block.tp.time_share / tensor_parallel
        return max(0.0, member_saved - kept), seconds * slowdown * share
    forward_s, _ = tensor_parallel_times(chain, cluster, index, index + 1, rows, tensor_parallel, slowdown)
    return max(0.0, member_saved - kept), forward_s


def selective_figures(chain: CostChain, first: int, choices: Sequence[str], rows: int, slowdown: float = 1.0,
                      tensor_parallel: int = 1, cluster: Cluster | None = None) -> SelectiveRecompute | None:
    """A stage's figures for per-block ``choices`` over blocks ``[first, first + len(choices))`` on one device (a
    T-way group's member: :func:`member_saving`); None for no choices (the stage follows its whole-stage
    ``recompute`` flag)."""
    if not choices:
        return None
    savings = [member_saving(chain, first + offset, choice, rows, slowdown, tensor_parallel, cluster)
               for offset, choice in enumerate(choices)]
    return SelectiveRecompute(saved_bytes=sum(b for b, _ in savings), transient_bytes=max(b for b, _ in savings),
                              extra_forward_s=sum(s for _, s in savings))


def selective_seconds(chain: CostChain, first: int, choices: Sequence[str], rows: int, slowdown: float = 1.0,
                      tensor_parallel: int = 1, cluster: Cluster | None = None) -> float:
    """The forward seconds per-block ``choices`` rerun in one backward (0.0 without choices)."""
    figures = selective_figures(chain, first, choices, rows, slowdown, tensor_parallel, cluster)
    return figures.extra_forward_s if figures is not None else 0.0
