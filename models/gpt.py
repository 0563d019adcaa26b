"""GPT-2/GPT-3 style decoder-only transformer (nanoGPT style) with a tied embedding / LM head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, make_entry, next_token_batch, token_cross_entropy


@dataclass(frozen=True)
class GPTConfig:
    block_size: int = 64  # longest sequence; also the example sequence length
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    bias: bool = True
    tie_embeddings: bool = True  # False: an LM head of its own (Llama 3, Qwen2), e.g. for a large vocabulary


class CausalSelfAttention(nn.Module):
    causal_mask: Tensor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # Lower-triangular causal mask, cut to the sequence length in forward.
        # Built on the CPU and moved: mask ops on meta would pull in torch._dynamo (seconds).
        positions = torch.arange(config.block_size, device="cpu")
        mask = (positions[:, None] >= positions[None, :]).to(self.c_attn.weight.device)  # (T, T)
        self.register_buffer("causal_mask", mask.view(1, 1, config.block_size, config.block_size),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        seq_len = x.size(1)
        q, k, v = self.c_attn(x).split(self.n_head * self.head_dim, dim=2)  # 3 x (B, T, C)
        q = q.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)  # (B, nh, T, hd)
        k = k.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (self.n_head, self.head_dim)).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, nh, T, T)
        # narrow (not slicing) so that torch.fx records the sequence-length-dependent cut.
        mask = self.causal_mask.narrow(2, 0, seq_len).narrow(3, 0, seq_len)  # (1, 1, T, T)
        att = att.masked_fill(mask.logical_not(), float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).flatten(-2)  # (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """idx (B, T) int64 -> logits (B, T, vocab_size)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # tied: one Parameter used by the first and last layer
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2 scaled init of residual projections
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        seq_len = idx.size(1)
        x = self.wte(idx) + self.wpe.weight[:seq_len]  # (B, T, C) + (T, C)
        for block in self.h:
            x = block(x)  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)


def _batch(config: GPTConfig, batch_size: int, generator: torch.Generator) -> Batch:
    return next_token_batch(generator, config.vocab_size, batch_size, config.block_size)


PRESETS: dict[str, tuple[GPTConfig, int | None, str]] = {
    "gpt-mini": (GPTConfig(), None, "4-layer byte-level GPT, trains on a CPU in seconds"),
    "gpt2-small": (GPTConfig(block_size=1024, vocab_size=50257, n_layer=12, n_head=12, n_embd=768),
                   124_000_000, "GPT-2 small (124M)"),
    "gpt3-xl": (GPTConfig(block_size=2048, vocab_size=50257, n_layer=24, n_head=16, n_embd=2048),
                1_300_000_000, "GPT-3 XL (1.3B)"),
    "gpt3-6.7b": (GPTConfig(block_size=2048, vocab_size=50257, n_layer=32, n_head=32, n_embd=4096),
                  6_700_000_000, "GPT-3 6.7B; build on device='meta' for planning"),
    "gpt3-13b": (GPTConfig(block_size=2048, vocab_size=50257, n_layer=40, n_head=40, n_embd=5120),
                 13_000_000_000, "GPT-3 13B (width 5120 = 40 heads x 128, as Megatron); build on device='meta'"),
    "gpt3-175b": (GPTConfig(block_size=2048, vocab_size=50257, n_layer=96, n_head=96, n_embd=12288),
                  175_000_000_000, "GPT-3 175B; build on device='meta' only"),
}
TINY = {"block_size": 16, "vocab_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32}

ENTRIES: tuple[ModelEntry, ...] = tuple(
    make_entry(name, description, model_cls=GPT, config=config, batch_fn=_batch,
               loss_fn=token_cross_entropy, paper_params=paper, tiny_overrides=TINY)
    for name, (config, paper, description) in PRESETS.items()
)
