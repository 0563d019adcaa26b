"""GNMT-16: 8-layer LSTM encoder (bidirectional bottom layer) and 8-layer LSTM decoder with attention.

Follows Wu et al. 2016 in shape: hidden 1024, bidirectional first encoder layer, residual
connections from the third layer up, attention computed from the bottom decoder layer and fed to
every higher decoder layer. The decoder is run teacher-forced over the whole target sequence, so
the graph is static; attention is scaled dot-product with learned query/key projections (GNMT used
additive attention). The default vocabulary (36,549 entries) is the BPE-32k WMT16 en-de vocabulary
of the TensorFlow NMT GNMT benchmark, which gives the ~291M parameters quoted by DAPPLE.
nn.LSTM stays a leaf module under torch.fx.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .registry import Batch, ModelEntry, make_entry, random_tokens, token_cross_entropy


@dataclass(frozen=True)
class GNMTConfig:
    vocab_size: int = 36549  # shared by source and target, separate embeddings
    hidden_size: int = 1024
    num_encoder_layers: int = 8
    num_decoder_layers: int = 8
    residual_start: int = 2  # layers with index >= this get a residual connection
    src_len: int = 32  # example / make_batch source length
    tgt_len: int = 32  # example / make_batch target length


class Encoder(nn.Module):
    def __init__(self, config: GNMTConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.residual_start = config.residual_start
        self.embedding = nn.Embedding(config.vocab_size, hidden)
        self.bidirectional = nn.LSTM(hidden, hidden, batch_first=True, bidirectional=True)
        sizes = [2 * hidden] + [hidden] * (config.num_encoder_layers - 2)
        self.layers = nn.ModuleList([nn.LSTM(size, hidden, batch_first=True) for size in sizes])

    def forward(self, src: Tensor) -> Tensor:
        x = self.bidirectional(self.embedding(src))[0]  # (B, S, 2H)
        for index, lstm in enumerate(self.layers, start=1):
            y = lstm(x)[0]  # (B, S, H)
            x = x + y if index >= self.residual_start else y
        return x  # (B, S, H)


class Attention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden, bias=False)
        self.key = nn.Linear(hidden, hidden, bias=False)
        self.scale = 1.0 / math.sqrt(hidden)

    def forward(self, queries: Tensor, memory: Tensor) -> Tensor:
        scores = self.query(queries) @ self.key(memory).transpose(1, 2) * self.scale  # (B, T, S)
        return scores.softmax(dim=-1) @ memory  # (B, T, H)


class Decoder(nn.Module):
    def __init__(self, config: GNMTConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.residual_start = config.residual_start
        self.embedding = nn.Embedding(config.vocab_size, hidden)
        self.bottom = nn.LSTM(hidden, hidden, batch_first=True)
        self.attention = Attention(hidden)
        self.layers = nn.ModuleList(
            [nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(config.num_decoder_layers - 1)]
        )
        self.classifier = nn.Linear(hidden, config.vocab_size)

    def forward(self, tgt: Tensor, memory: Tensor) -> Tensor:
        x = self.bottom(self.embedding(tgt))[0]  # (B, T, H)
        context = self.attention(x, memory)  # (B, T, H)
        for index, lstm in enumerate(self.layers, start=1):
            y = lstm(torch.cat([x, context], dim=-1))[0]  # (B, T, 2H) -> (B, T, H)
            x = x + y if index >= self.residual_start else y
        return self.classifier(x)  # (B, T, V)


class GNMT(nn.Module):
    """(src (B, S) int64, tgt_in (B, T) int64) -> logits (B, T, vocab_size)."""

    def __init__(self, config: GNMTConfig) -> None:
        super().__init__()
        if config.num_encoder_layers < 2 or config.num_decoder_layers < 1:
            raise ValueError(
                f"need num_encoder_layers >= 2 and num_decoder_layers >= 1, got "
                f"{config.num_encoder_layers} and {config.num_decoder_layers}"
            )
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        for name, param in self.named_parameters():
            if "weight" in name:
                nn.init.uniform_(param, -0.1, 0.1)
            else:
                nn.init.zeros_(param)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decoder(tgt_in, self.encoder(src))


def _batch(config: GNMTConfig, batch_size: int, generator: torch.Generator) -> Batch:
    src = random_tokens(generator, config.vocab_size, batch_size, config.src_len)
    tgt = random_tokens(generator, config.vocab_size, batch_size, config.tgt_len + 1)
    return (src, tgt[:, :-1].contiguous()), tgt[:, 1:].contiguous()


TINY = {"vocab_size": 64, "hidden_size": 16, "num_encoder_layers": 3, "num_decoder_layers": 3,
        "src_len": 6, "tgt_len": 5}

ENTRIES: tuple[ModelEntry, ...] = (
    make_entry("gnmt-16", "GNMT-16: 8+8 LSTM layers, hidden 1024, attention, residuals (DAPPLE)",
               model_cls=GNMT, config=GNMTConfig(), batch_fn=_batch, loss_fn=token_cross_entropy,
               paper_params=291_000_000, tiny_overrides=TINY),
)
