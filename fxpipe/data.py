"""Training data for the demo and `fxpipe train`: byte-level text from the Python standard library, or random batches."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

__all__ = ["DataError", "TextBatches", "stdlib_corpus"]


class DataError(ValueError):
    """The requested corpus cannot be built (no files found, block size too large)."""


def stdlib_corpus(max_bytes: int = 4_000_000) -> torch.Tensor:
    """The standard library's own ``.py`` files, sorted by path and concatenated, as a uint8 tensor.

    Every machine with Python has this corpus, so the demo needs no download. Sorting makes
    the corpus (and so every batch) identical on every rank of one machine.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue  # an unreadable file is skipped; the corpus stays deterministic per machine
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total == 0:
        raise DataError(f"found no readable .py files under the standard library at {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).clone()


class TextBatches:
    """Random windows of a byte corpus: inputs are ``block_size`` bytes, targets the next bytes.

    ``batch(step)`` is a pure function of the step number, so every rank draws the same global
    batch without communicating (fxpipe's SPMD rule).
    """

    def __init__(self, corpus: torch.Tensor, block_size: int, batch_size: int, seed: int = 0) -> None:
        if corpus.numel() <= block_size + 1:
            raise DataError(f"corpus of {corpus.numel()} bytes is too short for block_size={block_size}")
        self.corpus = corpus.long()
        self.block_size = block_size
        self.batch_size = batch_size
        self.seed = seed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.corpus.numel() - self.block_size - 1, (self.batch_size,), generator=generator)
        offsets = torch.arange(self.block_size + 1)
        windows = self.corpus[starts[:, None] + offsets[None, :]]
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
