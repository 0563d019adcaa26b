"""Collective setup phases: a failure on any rank during compile raises on every rank, naming rank and phase."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from fxpipe.runtime.errors import RemoteSetupError

# One rank's outcome of a phase: None (ok) or (rank, error type name, message).
Outcome = tuple[int, str, str] | None
# The group setup phases exchange over (None: the default group).
SetupGroup = dist.ProcessGroup | None
# How long a rank waits for the others to finish a phase. Ranks that fail or die say so at once; this
# only bounds a rank that hangs. Planning on rank 0 may take minutes (calibration, large models), far
# beyond the communication timeout, so phases exchange over a group of their own with this timeout.
SETUP_TIMEOUT_S = 1800.0


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def setup_group(timeout_s: float = SETUP_TIMEOUT_S) -> dist.ProcessGroup | None:
    """A gloo group over every rank for :func:`setup_phase` (a collective; None in a world of one)."""
    if not _distributed():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def release_group(group: dist.ProcessGroup | None) -> None:
    """Destroy a group made by :func:`setup_group` (every rank, once setup is over)."""
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)


def _exchange(outcome: Outcome, group: dist.ProcessGroup | None) -> list[Outcome]:
    """Every rank's outcome of the phase just run (a collective over ``group``, default: the default group)."""
    if not _distributed():
        return [outcome]
    gathered: list[Outcome] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, outcome, group=group)
    return gathered


def describe_failures(phase: str, failures: list[tuple[int, str, str]]) -> str:
    """``rank R failed in PHASE: Type: message`` for the first failed rank, and which others failed."""
    rank, kind, message = failures[0]
    text = f"rank {rank} failed in {phase}: {kind}: {message}"
    if len(failures) > 1:
        text += f" (ranks {[other[0] for other in failures[1:]]} failed too)"
    return text


@contextmanager
def setup_phase(phase: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run one setup phase on every rank, then exchange ok/error records before any rank goes on.

    Every rank must enter the same phases in the same order, and a phase body must not run
    collectives (a failed rank would meet them with its record). A rank whose body raises tells the
    others and re-raises its own exception (with a note); a rank whose body succeeded raises
    :class:`RemoteSetupError` "rank R failed in PHASE: ..." when any other rank failed. ``group``
    (from :func:`setup_group`) lets a phase outlast the default group's timeout. Without a process
    group (or in a world of one) it is a plain block.
    """
    try:
        yield
    except Exception as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            _exchange((rank, type(error).__name__, str(error)), group)
        except Exception as exchange_error:  # the original error matters more than the failed notice
            error.add_note(f"fxpipe: telling the other ranks about this failure failed too: {exchange_error}")
            raise
        if _distributed():
            error.add_note(f"fxpipe: every rank was told: rank {rank} failed in {phase}")
        raise
    failures = [outcome for outcome in _exchange(None, group) if outcome is not None]
    if failures:
        raise RemoteSetupError(describe_failures(phase, failures))
