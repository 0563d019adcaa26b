"""How the CLI reports a user error: one message from rank 0, no traceback (``FXPIPE_DEBUG=1`` shows it), status 2."""

from __future__ import annotations

import os
import sys
import traceback

USER_ERROR_STATUS = 2
DEBUG_VARIABLE = "FXPIPE_DEBUG"


def launched_rank() -> int:
    """This process's rank as torchrun (or any launcher setting ``RANK``) started it; 0 outside a launch."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def report_user_error(command: str, error: BaseException) -> int:
    """Print ``fxpipe COMMAND: error: MESSAGE`` once, from rank 0, and return the exit status (2).

    fxpipe raises a user error alike on every rank (docs/errors.md), so rank 0's message is every rank's.
    With ``FXPIPE_DEBUG=1`` every rank also prints its traceback, headed by its rank. A torchrun worker
    records the error in torchelastic's error file, so the launcher's failure summary says where the
    message is instead of pointing at torchelastic's docs, and exits here with status 2 right after its
    exit handlers, so every rank ends within moments (docs/errors.md, "On the command line and under torchrun").
    """
    rank = launched_rank()
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        text = "".join(traceback.format_exception(error))
        print(f"fxpipe {command}: rank {rank}: {text}", file=sys.stderr, end="", flush=True)
    if rank == 0:
        print(f"fxpipe {command}: error: {error}", file=sys.stderr, flush=True)
    if torchrun_worker():
        _record_for_torchrun(command, error, rank)
        exit_now(USER_ERROR_STATUS)
    return USER_ERROR_STATUS


def torchrun_worker() -> bool:
    """Whether this process is a torchrun worker (torchrun sets ``TORCHELASTIC_RUN_ID``)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def exit_now(status: int) -> None:
    """Run the exit handlers (the process group is destroyed, the heartbeat stopped), then end the process at
    once, skipping the interpreter's teardown. Two reasons, both seen on torchrun workers here: after a failed
    compile that teardown took ~5 s, long enough for torchrun to see another rank's exit first, SIGTERM this one
    and log that it did; and after a finished ``fxpipe calibrate`` a worker now and then aborted in it
    ("terminate called without an active exception": a gloo group still referenced from Python, e.g. by a
    DeviceMesh, destroyed with its threads during finalization; CI of 2357cdf), failing a run whose work was done."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _record_for_torchrun(command: str, error: BaseException, rank: int) -> None:
    """Write torchelastic's error file (its JSON layout) when torchrun asks for one: a short line, no traceback."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    where = "printed above by rank 0" if rank != 0 else "printed above"
    summary = (f"fxpipe {command}: user error {type(error).__name__} ({where}; {DEBUG_VARIABLE}=1 prints the "
               "traceback)")
    record = {"message": {"message": f"{type(error).__name__}: {error}",
                          "extraInfo": {"py_callstack": summary, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as handle:
            json.dump(record, handle)
    except OSError:  # the summary then points at torchelastic's docs: nothing lost but a hint
        pass
