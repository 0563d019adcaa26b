"""The caller's own ``torch.autocast`` around ``step``, ``evaluate`` or ``predict``: honoured as ``autocast_dtype`` is.

A user who writes ``with torch.autocast("cpu", dtype=torch.bfloat16): loss = pipe.step(x, y)`` means the
model's forward and loss to run under bf16 autocast, as one process would. fxpipe honours that exactly as
``fxpipe.compile(..., autocast_dtype=torch.bfloat16)``: every stage's forward and loss run under autocast of that
dtype, the values crossing each cut have the dtypes autocast gives them (so every receive buffer is made for
them), and the backward, the transfers and the gradient sums run outside autocast, as ``loss.backward()`` after
an autocast region does. Unhonoured, the region leaked into the stages' forwards only: stages sent bfloat16 where
their receivers expected float32, and read memory nobody wrote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from fxpipe.runtime.faults.errors import PipelineSetupError


def caller_autocast(device: torch.device) -> torch.dtype | None:
    """The dtype of the ``torch.autocast`` region the caller opened for ``device``'s type (None: none is on)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def effective_autocast(compiled: torch.dtype | None, caller: torch.dtype | None, *, compiled_stages: bool) -> \
        torch.dtype | None:
    """The autocast dtype a call runs under: the pipeline's ``autocast_dtype``, else the caller's region's.

    A caller's region of another dtype than ``autocast_dtype`` is refused (which one wins would be a guess), and
    so is one around stages compiled with torch.compile, which were traced without autocast.
    """
    if caller is None or caller == compiled:
        return compiled
    if compiled is not None:
        raise PipelineSetupError(
            f"step/evaluate/predict runs under torch.autocast(dtype={caller}) but the pipeline was compiled with "
            f"autocast_dtype={compiled}; drop the torch.autocast region (the pipeline applies its own) or compile "
            f"with autocast_dtype={caller}")
    if compiled_stages:
        raise PipelineSetupError(
            f"step/evaluate/predict runs under torch.autocast(dtype={caller}) but this pipeline's stages were compiled "
            "with torch.compile without autocast; compile with autocast_dtype="
            f"{caller} (fxpipe.compile(..., autocast_dtype=...)) instead of the torch.autocast region")
    return caller


@contextlib.contextmanager
def honour_caller_autocast(device: torch.device, compiled: torch.dtype | None, *, compiled_stages: bool,
                           use_autocast: Callable[[torch.dtype | None], None]) -> Iterator[None]:
    """Around a collective call: the forwards run under the effective autocast (``use_autocast`` switches the
    driver to it), and the caller's region is switched off for everything else (backward, transfers, sums)."""
    caller = caller_autocast(device)
    use_autocast(effective_autocast(compiled, caller, compiled_stages=compiled_stages))
    with torch.autocast(device.type, enabled=False) if caller is not None else contextlib.nullcontext():
        yield
