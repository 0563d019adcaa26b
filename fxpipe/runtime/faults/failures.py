"""The root cause of a failed step: the first failure recorded in the rendezvous store, and heartbeats that tell dead, stalled and waiting ranks apart.

A transport error names a neighbour, not a culprit: when rank 1 dies, rank 2 notices, raises and
exits, and rank 0 then sees its connection to rank 2 close. So the first rank that notices a
failure decides who is to blame (ranks whose store heartbeat stopped are dead; otherwise the
peer that did not answer) and records that in the c10d store the process group rendezvoused
through; every rank reads the record before raising, so all survivors name the same rank.

A frozen rank (SIGSTOP, a native deadlock) closes no connection, so nothing fails: its peers would wait
out the receive timeout. So each heartbeat also publishes what its rank is doing (step, action, the
wait it is in), and while this rank waits, its heartbeat thread watches the others: a rank silent for
``stall_timeout_s`` is recorded as the root cause (the one at the end of the chain of waits), and the
wait is broken so that it raises now (:mod:`fxpipe.runtime.faults.stalls`).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from fxpipe.core.schedule import Action
from fxpipe.runtime.faults.errors import BatchShapeError, CommunicationError, PipelineSetupError
from fxpipe.runtime.faults.stalls import (
    SilenceClock,
    Waited,
    alive_cause,
    culprit,
    make_doing,
    read_doings,
    stall_cause,
)

# Not root causes: communication errors explain themselves, and refusals come on every rank before
# any transfer (the pipeline stays usable, so a record of them would blame a later failure on them).
REFUSALS = (CommunicationError, BatchShapeError, PipelineSetupError)

HEARTBEAT_S = 0.5  # how often each rank bumps its counter in the store
DEAD_AFTER_S = 3.0  # a counter that did not move for this long belongs to a dead (or frozen) process
POLL_S = 0.1
TICK_S = 0.1  # the heartbeat thread's tick: publishes a changed status, and watches while this rank waits
WATCH_AFTER_S = 0.3  # a wait shorter than this is never watched (no store reads in a flowing pipeline)
WATCH_EVERY_S = 0.5  # while watching: how often to read the failure record and every rank's counter
DEFAULT_STALL_TIMEOUT_S = 5.0
BREAK_TAG = 2**30 + 7  # a receive no rank ever sends: waiting on it for 1 ms closes the group's connections

_instances = itertools.count()  # the same on every rank (SPMD): one key namespace per pipeline


class FailureLog:
    """This rank's heartbeat and the job's first-failure record, under ``fxpipe/failures/<n>/`` in the store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, namespace: str) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = f"fxpipe/failures/{namespace}/"
        self.step_index = -1  # the driver bumps it at the start of each step
        # written by the driver's thread (plain attribute writes, nothing more), read by the heartbeat thread
        self.action: Action | None = None  # the action running (None: between steps)
        self.waiting: Waited | None = None  # the transfer or collective being waited on (comm.Pending)
        self.stall_timeout_s = DEFAULT_STALL_TIMEOUT_S
        self.groups: list[Any] = []  # process groups a broken wait may block in (the default one is added)
        self.aborted: str | None = None  # set by the heartbeat thread when it broke a wait: the root cause
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._published: tuple[Any, ...] = ()
        self._since = self._waiting_since = time.time()
        self._watched: Waited | None = None
        self._watch_from = self._next_check = 0.0
        self._silence = SilenceClock()

    @classmethod
    def for_default_group(cls, owner: object, rank: int, world_size: int) -> FailureLog | None:
        """A log with a running heartbeat, stopped when ``owner`` is collected; None for a world of one."""
        if world_size == 1 or not dist.is_initialized():
            return None
        log = cls(_get_default_store(), rank, world_size, str(next(_instances)))
        log._thread = threading.Thread(target=log._beat, name=f"fxpipe-heartbeat-{rank}", daemon=True)
        log._thread.start()
        _LIVE.add(log)
        _install_excepthooks()
        weakref.finalize(owner, log._stop.set)
        # At interpreter exit a daemon thread caught inside a store call meets C++ teardown (torch aborts:
        # "terminate called without an active exception"); stop and join it first.
        atexit.register(log.stop)
        return log

    def watch_waits(self, stall_timeout_s: float, groups: list[Any]) -> None:
        """Name a rank silent for ``stall_timeout_s`` while this rank waits; ``groups``: where a wait may block."""
        self.stall_timeout_s = stall_timeout_s
        self.groups = [group for group in groups if group is not None]

    def stop(self) -> None:
        """End the heartbeat and wait for its thread (at most one store call)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=HEARTBEAT_S + 5.0)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _beat(self) -> None:
        key, next_beat = self._key(f"alive/{self.rank}"), 0.0
        while dist.is_initialized():
            now = time.monotonic()
            try:
                if now >= next_beat:
                    self.store.add(key, 1)
                    next_beat = now + HEARTBEAT_S
                self._publish()
                self._watch(now)
            except RuntimeError:  # the store is gone (job ending, or its host died): nothing left to tell
                return
            if self._stop.wait(TICK_S):
                return

    def _publish(self) -> None:
        """Write this rank's status (:class:`stalls.Doing`) when the step, action or wait changed."""
        step, action, waiting = self.step_index, self.action, self.waiting
        if self._published and (step, action) == self._published[:2] and waiting is self._published[2]:
            return
        if not self._published or (step, action) != self._published[:2]:
            self._since = time.time()
        if waiting is not None and (not self._published or waiting is not self._published[2]):
            self._waiting_since = time.time()
        self._published = (step, action, waiting)
        doing = make_doing(step, action, self._since, waiting, self._waiting_since)
        self.store.set(self._key(f"doing/{self.rank}"), doing.to_text())

    def _watch(self, now: float) -> None:
        """While this rank waits: take a recorded failure or a stalled rank as the root cause, and break the wait."""
        waited = self.waiting
        if waited is not self._watched:
            self._watched, self._watch_from = waited, now + WATCH_AFTER_S
            return
        if waited is None or now < max(self._watch_from, self._next_check):
            return
        self._next_check = now + WATCH_EVERY_S
        cause = self.recorded()
        if cause is None:
            silence = self._silence.observe(self._counters(), now)
            stalled = sorted(r for r, s in silence.items() if r != self.rank and s >= self.stall_timeout_s)
            if not stalled:
                return
            doings = read_doings(self.store, self.prefix, self.world_size)
            chain = culprit(self.rank, waited.peer, doings, stalled)
            cause = self.record(stall_cause(self.rank, waited, chain, doings, silence[chain[-1]], self.step_index))
        if self.waiting is waited:
            self.aborted = cause
            self._break(waited)

    def _break(self, waited: Waited) -> None:
        """Make the wait on ``waited`` raise now: a 1 ms wait that times out closes the connections of the
        group's gloo context (gloo's own timeout does the same), failing whatever waits on them."""
        work = getattr(waited, "work", None)
        if waited.peer >= 0 and work is not None:
            _time_out(lambda: work)
        for group in [None, *self.groups]:
            members = dist.get_process_group_ranks(group or dist.group.WORLD)
            others = [rank for rank in members if rank != self.rank]
            if self.rank in members and others:
                _time_out(functools.partial(dist.irecv, torch.empty(1), others[0], group=group, tag=BREAK_TAG))

    def _counters(self) -> dict[int, int]:
        return {rank: self.store.add(self._key(f"alive/{rank}"), 0) for rank in range(self.world_size)}

    def recorded(self) -> str | None:
        """The first failure anyone recorded, or None."""
        key = self._key("first")
        return self.store.get(key).decode() if self.store.check([key]) else None

    def explain(self, peer: int, description: str, error: BaseException) -> str:
        """The job's root cause (recording this rank's diagnosis if it is the first); never raises."""
        where = f"at step {self.step_index}, noticed by rank {self.rank} during {description}"
        try:
            return self._explain(peer, description, where, error)
        except Exception as store_error:  # the store's host may be the rank that died
            reason = f"{type(store_error).__name__}: {_first_line(store_error)}"
            host = store_host_rank(self.store)
            if host is not None and host != self.rank:
                return (f"rank {host} unreachable (it hosts the rendezvous store, which is unreachable too: "
                        f"{reason}) {where}")
            return (f"unknown: the rendezvous store is unreachable too ({reason}); if it lived on the "
                    "rank that died, that rank is the likely cause")

    def _explain(self, peer: int, description: str, where: str, error: BaseException) -> str:
        found = self.recorded()
        if found is not None:
            return found
        before = self._counters()
        found = self._await_record(DEAD_AFTER_S)  # someone closer to the failure may record it meanwhile
        if found is not None:
            return found
        after = self._counters()
        dead = [rank for rank in range(self.world_size) if rank != self.rank and after[rank] == before[rank]]
        if dead:
            names = ", ".join(map(str, dead))
            cause = (f"rank{'s' if len(dead) > 1 else ''} {names} unreachable (no heartbeat for "
                     f"{DEAD_AFTER_S:g} s: process died or froze) {where}")
        elif (alive := self._alive_cause(peer, description, where, error)) is not None:
            cause = alive
        elif (found := self._await_record(DEAD_AFTER_S)) is not None:
            return found  # all alive and no timeout here: a rank whose wait timed out is explaining it
        elif peer >= 0:
            cause = (f"rank {peer} failed to communicate (its heartbeat still runs: stalled, or running "
                     f"another plan or batch) {where}: {_first_line(error)}")
        else:
            cause = f"a collective failed with every rank alive {where}: {_first_line(error)}"
        return self.record(cause)

    def _await_record(self, seconds: float) -> str | None:
        """The failure someone records within ``seconds``, or None."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            found = self.recorded()
            if found is not None:
                return found
        return None

    def _alive_cause(self, peer: int, description: str, where: str, error: BaseException) -> str | None:
        """After a timeout with every heartbeat running: the rank at the end of the chain of waits, alive
        but not sending (None for other errors, or when that rank published no status)."""
        if "timed out" not in str(error).lower():
            return None
        doings = read_doings(self.store, self.prefix, self.world_size)
        chain = culprit(self.rank, peer, doings, [])
        if not chain or chain[-1] == self.rank:
            return None
        waiting = self.waiting  # still set while the failed wait raises (comm.PeerExchange.wait)
        waited = time.time() - self._waiting_since if waiting is not None else 0.0
        what = waiting.description if waiting is not None else description
        return alive_cause(self.rank, peer, what, chain, doings, waited, where)

    def record(self, cause: str) -> str:
        """Record ``cause`` unless a failure is recorded already; returns the one that stands."""
        return self.store.compare_set(self._key("first"), "", cause).decode()

    def recorded_safely(self) -> bool:
        """Whether a failure is recorded (True when the store cannot tell: nothing more to add then)."""
        try:
            return self.recorded() is not None
        except Exception:  # the store is gone: this rank's error is printed and raised anyway
            return True

    def record_safely(self, cause: str) -> None:
        try:
            self.record(cause)
        except Exception:  # best effort: the error itself is raised on this rank anyway
            pass

    def note_error(self, error: BaseException) -> None:
        """This rank raised ``error``: the root cause if nothing came first (communication errors explain themselves)."""
        if isinstance(error, REFUSALS):
            return
        try:
            self.record(f"rank {self.rank} raised {type(error).__name__} at step {self.step_index}: "
                        f"{_first_line(error)}")
        except Exception:  # best effort: the error itself is raised on this rank anyway
            pass


def _time_out(start: Callable[[], Any]) -> None:
    """Wait 1 ms on the work ``start`` returns, meaning it to time out (breaking its group's connections)."""
    try:
        start().wait(timedelta(milliseconds=1))
    except RuntimeError:  # the intended timeout: the group's waits now fail, each raising with the record
        return


class NoLog:
    """Where the driver writes its current action in a world of one (no heartbeat to publish it)."""

    action: Action | None = None


_LIVE: weakref.WeakSet[FailureLog] = weakref.WeakSet()
_hooks_installed = False


def _install_excepthooks() -> None:
    """Record an error that escapes the main script between steps (``sys.excepthook``: the process is ending) as
    this rank's failure, so the others name it instead of the disconnect (once per process). Not
    ``threading.excepthook``: a failed side thread does not end the job."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        note_uncaught(error)
        previous(kind, error, trace)

    sys.excepthook = hook


def note_uncaught(error: BaseException) -> None:
    """Record ``error`` (uncaught, outside fxpipe's calls) in every live pipeline's failure log; never raises."""
    for log in list(_LIVE):
        if isinstance(error, REFUSALS) or log.recorded_safely():
            continue
        log.record_safely(f"rank {log.rank} raised {type(error).__name__} outside fxpipe, after step "
                          f"{log.step_index} (user code between steps: data loading, optimizer step, ...): "
                          f"{_first_line(error)}")


def store_host_rank(store: dist.Store) -> int | None:
    """The rank whose process serves ``store``: 0 for a TCPStore outside torchrun's agent store, else None."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return 0  # env:// and tcp:// start the server in rank 0 (MASTER_ADDR)
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def root_cause_hint(log: Any, peer: int, description: str, error: BaseException) -> str:
    """`` Root cause: ...`` for an error message, or '' without a log."""
    if log is None:
        return ""
    return f" Root cause (the job's first failure): {log.explain(peer, description, error)}."
