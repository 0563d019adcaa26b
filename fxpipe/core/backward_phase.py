"""Which pass of a split backward is running on this thread, for autograd functions that can skip work in it.

Zero-bubble's split backward (fxpipe.runtime.autograd.split_backward) runs a stage's backward in two passes over
one autograd graph: B asks for the input gradients only, W later for the parameter gradients only. Torch's own
backward nodes compute only the gradients a pass asks for; a custom autograd function cannot tell which ones a
``torch.autograd.grad`` over leaves asks for, so it would compute both in both passes. The split backward sets
the pass here (a context variable: per thread, so tensor-parallel members run in threads do not see each other's),
and such a function reads it. Outside a split backward it is ``None``: compute every gradient that is required.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

__all__ = ["BackwardPhase", "backward_phase", "current_backward_phase"]

BackwardPhase = Literal["inputs", "weights"]

_PHASE: ContextVar[BackwardPhase | None] = ContextVar("fxpipe_backward_phase", default=None)


@contextmanager
def backward_phase(phase: BackwardPhase) -> Iterator[None]:
    """Run the block as a split backward's ``"inputs"`` pass (B) or ``"weights"`` pass (W)."""
    token = _PHASE.set(phase)
    try:
        yield
    finally:
        _PHASE.reset(token)


def current_backward_phase() -> BackwardPhase | None:
    """The split-backward pass running on this thread; None in any other backward."""
    return _PHASE.get()
