"""XLNet-like relative-position transformer LM (the DAPPLE XLNet-36 benchmark shape).

Simplifications against XLNet (Yang et al., 2019), chosen to keep the graph static and traceable:
- no two-stream attention and no permutation language modelling: the factorisation order is the
  identity permutation, i.e. a causal mask (a registered buffer), trained with next-token loss;
- relative positions use a learned per-layer, per-head bias over clipped relative distances
  (Shaw et al. / T5 style) instead of sinusoidal relative encodings with rel-shift and r_w/r_r biases;
- no Transformer-XL segment memory, no segment embeddings.
Kept: no absolute position embeddings, post-LayerNorm blocks, GELU feed-forward, LM head tied to
the word embeddings. Size is dominated by the 36 x (4 H^2 + 2 H * d_inner) block weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, make_entry, next_token_batch, token_cross_entropy


@dataclass(frozen=True)
class XLNetConfig:
    vocab_size: int = 32000
    d_model: int = 1024
    n_layer: int = 36
    n_head: int = 16
    d_inner: int = 4096
    max_len: int = 512  # longest sequence (size of the mask / relative-position buffers)
    max_relative_distance: int = 128  # relative distances are clipped to +-this
    seq_len: int = 128  # example / make_batch sequence length
    layer_norm_eps: float = 1e-12


class RelativeAttention(nn.Module):
    def __init__(self, config: XLNetConfig) -> None:
        super().__init__()
        if config.d_model % config.n_head != 0:
            raise ValueError(f"d_model={config.d_model} not divisible by n_head={config.n_head}")
        self.n_head = config.n_head
        self.head_dim = config.d_model // config.n_head
        self.q = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k = nn.Linear(config.d_model, config.d_model, bias=False)
        self.v = nn.Linear(config.d_model, config.d_model, bias=False)
        self.o = nn.Linear(config.d_model, config.d_model, bias=False)
        self.relative_bias = nn.Embedding(2 * config.max_relative_distance + 1, config.n_head)

    def _heads(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)  # (B, nh, T, hd)

    def forward(self, x: Tensor, mask: Tensor, relative_ids: Tensor) -> Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
        bias = self.relative_bias(relative_ids).permute(2, 0, 1)  # (T, T, nh) -> (nh, T, T)
        scores = (scores + bias).masked_fill(mask.logical_not(), float("-inf"))
        return self.o((scores.softmax(dim=-1) @ v).transpose(1, 2).flatten(-2))  # (B, T, C)


class Layer(nn.Module):
    def __init__(self, config: XLNetConfig) -> None:
        super().__init__()
        self.attention = RelativeAttention(config)
        self.attention_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.ff_in = nn.Linear(config.d_model, config.d_inner)
        self.gelu = nn.GELU()
        self.ff_out = nn.Linear(config.d_inner, config.d_model)
        self.ff_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor, relative_ids: Tensor) -> Tensor:
        x = self.attention_norm(x + self.attention(x, mask, relative_ids))
        return self.ff_norm(x + self.ff_out(self.gelu(self.ff_in(x))))  # (B, T, C)


class XLNet(nn.Module):
    """input_ids (B, T) int64 -> next-token logits (B, T, vocab_size)."""

    relative_ids: Tensor
    causal_mask: Tensor

    def __init__(self, config: XLNetConfig) -> None:
        super().__init__()
        self.config = config
        self.word_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleList([Layer(config) for _ in range(config.n_layer)])
        self.lm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        # Buffers are built on the CPU and moved: these ops on meta would pull in torch._dynamo.
        device = self.lm_bias.device
        positions = torch.arange(config.max_len, device="cpu")
        distance = positions[None, :] - positions[:, None]  # (L, L): key index - query index
        clipped = distance.clamp(-config.max_relative_distance, config.max_relative_distance)
        relative_ids = (clipped + config.max_relative_distance).to(device)
        self.register_buffer("relative_ids", relative_ids, persistent=False)
        causal = (distance <= 0).to(device)  # (L, L) lower triangle: sees itself and earlier keys
        self.register_buffer("causal_mask", causal, persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: Tensor) -> Tensor:
        seq_len = input_ids.size(1)
        # narrow (not slicing) so that torch.fx records the sequence-length-dependent cut.
        mask = self.causal_mask.narrow(0, 0, seq_len).narrow(1, 0, seq_len)  # (T, T)
        relative_ids = self.relative_ids.narrow(0, 0, seq_len).narrow(1, 0, seq_len)  # (T, T)
        x = self.word_embedding(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, mask, relative_ids)
        return nn.functional.linear(x, self.word_embedding.weight, self.lm_bias)  # (B, T, V)


def _batch(config: XLNetConfig, batch_size: int, generator: torch.Generator) -> Batch:
    return next_token_batch(generator, config.vocab_size, batch_size, config.seq_len)


TINY = {"vocab_size": 128, "d_model": 32, "n_layer": 2, "n_head": 2, "d_inner": 64, "max_len": 32,
        "max_relative_distance": 8, "seq_len": 16}

ENTRIES: tuple[ModelEntry, ...] = (
    make_entry("xlnet-36", "XLNet-like 36-layer relative-position transformer, hidden 1024 (DAPPLE)",
               model_cls=XLNet, config=XLNetConfig(), batch_fn=_batch, loss_fn=token_cross_entropy,
               paper_params=500_000_000, tiny_overrides=TINY),
)
