"""Tiny language model whose token embedding and output head share one weight (test model).

The head reads the embedding Parameter directly (F.linear), so after tracing the tied weight is
used by the first and the last node of the graph: a pipeline must keep the two uses in sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, make_entry, next_token_batch, token_cross_entropy


@dataclass(frozen=True)
class TiedLMConfig:
    vocab_size: int = 64
    dim: int = 32
    num_blocks: int = 2
    seq_len: int = 16  # example / make_batch sequence length


class ResidualMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))  # (B, T, D)


class TiedLM(nn.Module):
    """tokens (B, T) int64 -> logits (B, T, vocab_size); per-token blocks, no attention."""

    def __init__(self, config: TiedLMConfig) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.Sequential(*[ResidualMLP(config.dim) for _ in range(config.num_blocks)])
        self.norm = nn.LayerNorm(config.dim)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.blocks(self.embedding(tokens))  # (B, T, D)
        return nn.functional.linear(self.norm(x), self.embedding.weight)  # (B, T, V), tied weight


def _batch(config: TiedLMConfig, batch_size: int, generator: torch.Generator) -> Batch:
    return next_token_batch(generator, config.vocab_size, batch_size, config.seq_len)


ENTRIES: tuple[ModelEntry, ...] = (
    make_entry("tied-lm", "2-block LM whose embedding and output head share one weight (test model)",
               model_cls=TiedLM, config=TiedLMConfig(), batch_fn=_batch, loss_fn=token_cross_entropy,
               tiny_overrides={"vocab_size": 32, "dim": 16, "seq_len": 8}),
)
