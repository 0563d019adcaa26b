"""Preemption: a SIGTERM handler that only sets a flag; all ranks agree on it at the end of each step.

Schedulers and torchrun send SIGTERM some seconds before SIGKILL, to one process or to all. A
handler that saved a checkpoint itself would run in the middle of a step on some ranks only; so
the handler just notes the signal, each rank adds its note to the loss allreduce that ends every
step (one more float, no extra collective), and every rank sees the same ``pipe.preempted`` after
the same step. The user's loop checks it, saves a checkpoint and returns normally.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType

from fxpipe.runtime.faults.errors import PipelineSetupError

DEFAULT_SIGNALS = (signal.SIGTERM,)

_received: list[int] = []  # signal numbers noted by the handler, in order


def _note(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)


def install(signals: Sequence[int] = DEFAULT_SIGNALS) -> None:
    """Replace the handlers of ``signals`` (default SIGTERM) by one that only notes the signal.

    Call it from the main thread, as early as possible (before ``fxpipe.compile``: a signal that
    comes before the handler kills the process). System calls the signal interrupts are restarted,
    so transfers in flight carry on.
    """
    if threading.current_thread() is not threading.main_thread():
        raise PipelineSetupError("preemption handlers can only be installed from the main thread (a Python rule "
                                 "for signal handlers); call pipe.handle_preemption() there")
    for signum in signals:
        signal.signal(signum, _note)
        signal.siginterrupt(signum, False)


def signal_received() -> int | None:
    """The first preemption signal this process received, or None."""
    return _received[0] if _received else None


def vote() -> float:
    """This rank's contribution to the end-of-step sum: 1.0 once a preemption signal came, else 0.0."""
    return 1.0 if _received else 0.0


def clear() -> None:
    """Forget received signals (a test, or a loop that chose to go on after saving)."""
    _received.clear()
