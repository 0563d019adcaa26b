"""Whether a user's loss is the token cross-entropy that a vocabulary-parallel head can compute without gathering logits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["is_token_cross_entropy"]


def is_token_cross_entropy(loss_fn: Callable[[Any, Any], Tensor], logits_shape: tuple[int, ...], targets: Tensor,
                           output_of: Callable[[Tensor], Any] = lambda logits: logits, *, draws: int = 2) -> bool:
    """Whether ``loss_fn(output_of(logits), targets)`` equals ``F.cross_entropy(logits.flatten(0, -2),
    targets.flatten())`` (mean over the tokens, ignore index -100) on ``draws`` random logits of ``logits_shape``.

    A numerical check, not a name match: any loss that computes this value (``F.cross_entropy``, ``nn.CrossEntropyLoss``,
    a Hugging Face ``loss_function``) may be replaced by
    :func:`fxpipe.passes.tensor_parallel_ops.vocab_parallel_cross_entropy`; anything else (label smoothing, weights,
    a sum) gathers the logits instead. ``output_of`` wraps the logits the way the stage returns them (a dict).
    """
    generator = torch.Generator().manual_seed(0)
    for _ in range(draws):
        logits = torch.randn(logits_shape, generator=generator, dtype=torch.float64)
        try:
            value = loss_fn(output_of(logits), targets)
        except Exception:  # a loss that cannot take these values is not this loss; the logits get gathered
            return False
        expected = F.cross_entropy(logits.flatten(0, -2), targets.flatten())
        if not isinstance(value, Tensor) or value.shape != () or \
                not torch.allclose(value.double(), expected, rtol=1e-9, atol=1e-12):
            return False
    return True
