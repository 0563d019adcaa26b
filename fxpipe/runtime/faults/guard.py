"""Collective setup phases: a failure on any rank during compile raises on every rank, naming rank and phase."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

from fxpipe.runtime.faults.errors import RemoteSetupError

# One rank's outcome of a phase: None (ok) or (rank, error type name, message, the pickled error when it is
# the user's: a ValueError or TypeError that pickles back to the same type and message, else None).
Outcome = tuple[int, str, str, bytes | None] | None
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


def describe_failures(phase: str, failures: list[tuple[int, str, str, bytes | None]]) -> str:
    """``rank R failed in PHASE: Type: message`` for the first failed rank, and which others failed."""
    rank, kind, message = failures[0][:3]
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

    A user error (a ValueError or TypeError: options, layout, loss, plan file, cluster, ...) of the
    lowest failed rank is raised on every rank as itself (same type, same message; the others get a
    copy), so a launch reports one error however many ranks it has (docs/errors.md).
    """
    try:
        yield
    except Exception as error:
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            outcomes = _exchange((rank, type(error).__name__, str(error), portable_error(error)), group)
        except Exception as exchange_error:  # the original error matters more than the failed notice
            error.add_note(f"fxpipe: telling the other ranks about this failure failed too: {exchange_error}")
            raise
        first = _failures(outcomes)[0]
        if first[0] != rank and first[3] is not None:  # a lower rank's user error: raise the same one
            raise _copy_of(first, phase) from error
        if _distributed():
            error.add_note(f"fxpipe: every rank was told: rank {rank} failed in {phase}")
        raise
    failures = _failures(_exchange(None, group))
    if failures:
        if failures[0][3] is not None:
            raise _copy_of(failures[0], phase)
        raise RemoteSetupError(describe_failures(phase, failures))


def _failures(outcomes: list[Outcome]) -> list[tuple[int, str, str, bytes | None]]:
    return [outcome for outcome in outcomes if outcome is not None]


def portable_error(error: BaseException) -> bytes | None:
    """``error`` pickled when it is a user error (ValueError/TypeError) that unpickles to the same type and
    message, so another rank can raise it as itself; None otherwise (machine failures stay RemoteSetupError)."""
    if not isinstance(error, ValueError | TypeError):
        return None
    try:
        data = pickle.dumps(error)
        copy = pickle.loads(data)  # noqa: S301  (our own bytes, from a rank of this job)
    except Exception:  # noqa: BLE001  (an error with unpicklable arguments: reported as RemoteSetupError)
        return None
    return data if type(copy) is type(error) and str(copy) == str(error) else None


def _copy_of(failure: tuple[int, str, str, bytes | None], phase: str) -> BaseException:
    """The user error another rank raised, to raise here as itself."""
    assert failure[3] is not None
    copy: BaseException = pickle.loads(failure[3])  # noqa: S301  (our own bytes, from a rank of this job)
    copy.add_note(f"fxpipe: rank {failure[0]} raised this in {phase}; every rank raises it")
    return copy
