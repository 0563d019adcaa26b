"""The root cause of a failed step: the first failure recorded in the rendezvous store, and heartbeats that tell dead ranks from waiting ones.

A transport error names a neighbour, not a culprit: when rank 1 dies, rank 2 notices, raises and
exits, and rank 0 then sees its connection to rank 2 close. So the first rank that notices a
failure decides who is to blame (ranks whose store heartbeat stopped are dead; otherwise the
peer that did not answer) and records that in the c10d store the process group rendezvoused
through; every rank reads the record before raising, so all survivors name the same rank.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
import weakref
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from fxpipe.runtime.errors import BatchShapeError, CommunicationError, PipelineSetupError

# Not root causes: communication errors explain themselves, and refusals come on every rank before
# any transfer (the pipeline stays usable, so a record of them would blame a later failure on them).
REFUSALS = (CommunicationError, BatchShapeError, PipelineSetupError)

HEARTBEAT_S = 0.5  # how often each rank bumps its counter in the store
DEAD_AFTER_S = 3.0  # a counter that did not move for this long belongs to a dead (or frozen) process
POLL_S = 0.1

_instances = itertools.count()  # the same on every rank (SPMD): one key namespace per pipeline


class FailureLog:
    """This rank's heartbeat and the job's first-failure record, under ``fxpipe/failures/<n>/`` in the store."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, namespace: str) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = f"fxpipe/failures/{namespace}/"
        self.step_index = -1  # the driver bumps it at the start of each step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_default_group(cls, owner: object, rank: int, world_size: int) -> FailureLog | None:
        """A log with a running heartbeat, stopped when ``owner`` is collected; None for a world of one."""
        if world_size == 1 or not dist.is_initialized():
            return None
        log = cls(_get_default_store(), rank, world_size, str(next(_instances)))
        log._thread = threading.Thread(target=log._beat, name=f"fxpipe-heartbeat-{rank}", daemon=True)
        log._thread.start()
        weakref.finalize(owner, log._stop.set)
        # At interpreter exit a daemon thread caught inside a store call meets C++ teardown (torch aborts:
        # "terminate called without an active exception"); stop and join it first.
        atexit.register(log.stop)
        return log

    def stop(self) -> None:
        """End the heartbeat and wait for its thread (at most one store call)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=HEARTBEAT_S + 5.0)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _beat(self) -> None:
        key = self._key(f"alive/{self.rank}")
        while dist.is_initialized():
            try:
                self.store.add(key, 1)
            except Exception:  # the store is gone (job ending, or its host died): nothing left to tell
                return
            if self._stop.wait(HEARTBEAT_S):
                return

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
            return self._explain(peer, where, error)
        except Exception as store_error:  # the store's host may be the rank that died
            reason = f"{type(store_error).__name__}: {_first_line(store_error)}"
            host = store_host_rank(self.store)
            if host is not None and host != self.rank:
                return (f"rank {host} unreachable (it hosts the rendezvous store, which is unreachable too: "
                        f"{reason}) {where}")
            return (f"unknown: the rendezvous store is unreachable too ({reason}); if it lived on the "
                    "rank that died, that rank is the likely cause")

    def _explain(self, peer: int, where: str, error: BaseException) -> str:
        found = self.recorded()
        if found is not None:
            return found
        before, deadline = self._counters(), time.monotonic() + DEAD_AFTER_S
        while time.monotonic() < deadline:  # someone closer to the failure may record it meanwhile
            time.sleep(POLL_S)
            found = self.recorded()
            if found is not None:
                return found
        after = self._counters()
        dead = [rank for rank in range(self.world_size) if rank != self.rank and after[rank] == before[rank]]
        if dead:
            names = ", ".join(map(str, dead))
            cause = (f"rank{'s' if len(dead) > 1 else ''} {names} unreachable (no heartbeat for "
                     f"{DEAD_AFTER_S:g} s: process died or froze) {where}")
        elif peer >= 0:
            cause = (f"rank {peer} failed to communicate (its heartbeat still runs: stalled, or running "
                     f"another plan or batch) {where}: {_first_line(error)}")
        else:
            cause = f"a collective failed with every rank alive {where}: {_first_line(error)}"
        return self.record(cause)

    def record(self, cause: str) -> str:
        """Record ``cause`` unless a failure is recorded already; returns the one that stands."""
        return self.store.compare_set(self._key("first"), "", cause).decode()

    def note_error(self, error: BaseException) -> None:
        """This rank raised ``error``: the root cause if nothing came first (communication errors explain themselves)."""
        if isinstance(error, REFUSALS):
            return
        try:
            self.record(f"rank {self.rank} raised {type(error).__name__} at step {self.step_index}: "
                        f"{_first_line(error)}")
        except Exception:  # best effort: the error itself is raised on this rank anyway
            pass


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
