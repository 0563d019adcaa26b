"""Cost chain: a cost graph cut into ordered blocks, with the bytes crossing every cut."""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.costgraph import ZERO, Affine


@dataclass(frozen=True)
class Block:
    """A run of consecutive cost-graph nodes that always stay on one stage."""

    name: str
    node_names: tuple[str, ...]
    forward_s: Affine
    backward_s: Affine
    param_bytes: int
    saved_bytes: Affine = ZERO  # activation bytes autograd keeps for backward, per micro-batch slice


@dataclass(frozen=True)
class CostChain:
    """Ordered blocks plus, for each cut k (between block k and k+1), the bytes of every value crossing it.

    ``cut_bytes[k]`` counts skip connections too: a value produced in block i <= k and read in
    block j > k+... crosses every cut between them. ``input_bytes`` is what block 0 reads from
    the data loader; ``output_bytes`` what the last block hands to the loss.
    """

    blocks: tuple[Block, ...]
    cut_bytes: tuple[Affine, ...]
    input_bytes: Affine = ZERO
    output_bytes: Affine = ZERO
    source: str = ""

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a cost chain needs at least one block")
        if len(self.cut_bytes) != len(self.blocks) - 1:
            raise ValueError(
                f"a chain of {len(self.blocks)} blocks has {len(self.blocks) - 1} cuts, "
                f"got {len(self.cut_bytes)} cut sizes"
            )

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)
