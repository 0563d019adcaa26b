"""BERT encoder (post-LayerNorm) with a masked-language-model head tied to the word embeddings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, make_entry, random_tokens, token_cross_entropy


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 16
    intermediate_size: int = 4096
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    seq_len: int = 128  # example / make_batch sequence length
    layer_norm_eps: float = 1e-12


class SelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if config.hidden_size % config.num_heads != 0:
            raise ValueError(f"hidden_size={config.hidden_size} not divisible by num_heads={config.num_heads}")
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)  # (B, nh, T, hd)

    def forward(self, x: Tensor, additive_mask: Tensor) -> Tensor:
        q, k, v = self._heads(self.query(x)), self._heads(self.key(x)), self._heads(self.value(x))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
        probs = (scores + additive_mask).softmax(dim=-1)  # mask: (B, 1, 1, T)
        return self.output((probs @ v).transpose(1, 2).flatten(-2))  # (B, T, H)


class Layer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = SelfAttention(config)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.gelu = nn.GELU()
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: Tensor, additive_mask: Tensor) -> Tensor:
        x = self.attention_norm(x + self.attention(x, additive_mask))
        return self.output_norm(x + self.output(self.gelu(self.intermediate(x))))  # (B, T, H)


class Bert(nn.Module):
    """(input_ids (B, T) int64, attention_mask (B, T) int64 1=token 0=pad) -> MLM logits (B, T, V).

    The attention mask is turned into an additive (B, 1, 1, T) bias once and read by every layer,
    so it crosses every pipeline stage.
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.embedding_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.num_layers)])
        self.mlm_transform = nn.Linear(config.hidden_size, config.hidden_size)
        self.mlm_gelu = nn.GELU()
        self.mlm_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        seq_len = input_ids.size(1)
        x = self.word_embeddings(input_ids)  # (B, T, H)
        x = x + self.position_embeddings.weight[:seq_len] + self.token_type_embeddings.weight[0]
        x = self.embedding_norm(x)
        keep = attention_mask[:, None, None, :].to(x.dtype)  # (B, 1, 1, T)
        additive_mask = (1.0 - keep) * -10000.0
        for layer in self.layers:
            x = layer(x, additive_mask)  # (B, T, H)
        h = self.mlm_norm(self.mlm_gelu(self.mlm_transform(x)))
        # Decoder tied to the word embeddings (one Parameter read twice).
        return nn.functional.linear(h, self.word_embeddings.weight, self.mlm_bias)  # (B, T, V)


def _batch(config: BertConfig, batch_size: int, generator: torch.Generator) -> Batch:
    """15% of tokens replaced by a [MASK] id; targets are the original ids at every position.

    The loss is averaged over all positions (not only masked ones) so that it is a plain per-row
    mean, which keeps pipeline micro-batch splitting exact.
    """
    seq_len = config.seq_len
    targets = random_tokens(generator, config.vocab_size, batch_size, seq_len)
    masked = torch.rand(batch_size, seq_len, generator=generator) < 0.15
    mask_id = min(103, config.vocab_size - 1)
    input_ids = targets.masked_fill(masked, mask_id)
    num_pad = torch.randint(0, seq_len // 4 + 1, (batch_size, 1), generator=generator)
    attention_mask = (torch.arange(seq_len)[None, :] < seq_len - num_pad).long()
    return (input_ids, attention_mask), targets


PRESETS: dict[str, tuple[BertConfig, int, str]] = {
    "bert-large": (BertConfig(), 340_000_000, "BERT-large: 24 layers, hidden 1024"),
    "bert-48": (BertConfig(num_layers=48), 640_000_000, "BERT-48 (DAPPLE): 48 layers, hidden 1024"),
}
TINY = {"vocab_size": 128, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 32, "seq_len": 16}

ENTRIES: tuple[ModelEntry, ...] = tuple(
    make_entry(name, description, model_cls=Bert, config=config, batch_fn=_batch,
               loss_fn=token_cross_entropy, paper_params=paper, tiny_overrides=TINY)
    for name, (config, paper, description) in PRESETS.items()
)
