"""Collective setup phases: a failure on any rank during compile raises on every rank, naming rank and phase."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

from fxpipe.runtime.errors import RemoteSetupError

# One rank's outcome of a phase: None (ok) or (rank, error type name, message).
Outcome = tuple[int, str, str] | None


def _exchange(outcome: Outcome) -> list[Outcome]:
    """Every rank's outcome of the phase just run (a collective over the default group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [outcome]
    gathered: list[Outcome] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome)
    return gathered


def describe_failures(phase: str, failures: list[tuple[int, str, str]]) -> str:
    """``rank R failed in PHASE: Type: message`` for the first failed rank, and which others failed."""
    rank, kind, message = failures[0]
    text = f"rank {rank} failed in {phase}: {kind}: {message}"
    if len(failures) > 1:
        text += f" (ranks {[other[0] for other in failures[1:]]} failed too)"
    return text


@contextmanager
def setup_phase(phase: str) -> Iterator[None]:
    """Run one setup phase on every rank, then exchange ok/error records before any rank goes on.

    Every rank of the default group must enter the same phases in the same order. A rank whose body
    raises tells the others and re-raises its own exception (with a note); a rank whose body succeeded
    raises :class:`RemoteSetupError` "rank R failed in PHASE: ..." when any other rank failed. Without
    a process group (or in a world of one) it is a plain block.
    """
    try:
        yield
    except Exception as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            _exchange((rank, type(error).__name__, str(error)))
        except Exception as exchange_error:  # the original error matters more than the failed notice
            error.add_note(f"fxpipe: telling the other ranks about this failure failed too: {exchange_error}")
            raise
        if dist.is_initialized() and dist.get_world_size() > 1:
            error.add_note(f"fxpipe: every rank was told: rank {rank} failed in {phase}")
        raise
    failures = [outcome for outcome in _exchange(None) if outcome is not None]
    if failures:
        raise RemoteSetupError(describe_failures(phase, failures))
