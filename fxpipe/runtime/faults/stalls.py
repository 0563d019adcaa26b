"""Stalled ranks and chains of waiting ranks: what each rank is doing (published with its heartbeat) and whom a wait really waits on."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from fxpipe.core.schedule import Action

COLLECTIVE = -1  # ``waiting_on`` of a wait in a collective (no single peer)


class Waited(Protocol):
    """What a rank waits on (comm.Pending): the peer (-1: a collective) and a description."""

    peer: int
    description: str


@dataclass(frozen=True)
class Doing:
    """One rank's last published state: the step, the action it runs, and the wait it is in (if any).

    Times are wall-clock seconds (``time.time()``) so that other processes can age them.
    """

    step: int
    action: str
    since: float
    waiting_on: int | None = None
    waiting_for: str = ""
    waiting_since: float = 0.0

    def to_text(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_text(cls, text: str) -> Doing:
        return cls(**json.loads(text))

    def describe(self, now: float | None) -> str:
        """``step 2, forward of micro-batch 0 (for 4.1 s)``, plus the wait it is in (no ages when ``now`` is None)."""
        def age(since: float) -> str:
            return "" if now is None else f" (for {max(0.0, now - since):.1f} s)"

        text = f"step {self.step}, {self.action}{age(self.since)}"
        if self.waiting_on is None:
            return text
        whom = "a collective" if self.waiting_on == COLLECTIVE else f"rank {self.waiting_on}"
        return f"{text}, waiting on {whom} for {self.waiting_for}{age(self.waiting_since)}"


def describe_action(step: int, action: Action | None) -> str:
    """Words for what the driver runs: ``forward of micro-batch 2``; None: user code between steps."""
    if action is None:
        return "before the first step (setting up)" if step < 0 else (
            f"between steps (user code after step {step}: data loading, optimizer step, ...)")
    what = action.op.name.lower().replace("_", " ").replace("recv", "receive")
    return what if action.microbatch_index < 0 else f"{what} of micro-batch {action.microbatch_index}"


def make_doing(step: int, action: Action | None, since: float, waited: Waited | None,
               waiting_since: float) -> Doing:
    if waited is None:
        return Doing(step, describe_action(step, action), since)
    return Doing(step, describe_action(step, action), since, waited.peer, waited.description, waiting_since)


class SilenceClock:
    """When each rank's heartbeat counter last moved, as far as this rank's reads of the counters can tell.

    A counter that reads the same as at an earlier read did not move in between, so the rank has been
    silent at least since the first read that saw that value.
    """

    def __init__(self) -> None:
        self.first_seen: dict[int, tuple[int, float]] = {}

    def observe(self, counters: Mapping[int, int], now: float) -> dict[int, float]:
        """Update with fresh counter reads; returns each rank's silence in seconds so far."""
        silence = {}
        for rank, value in counters.items():
            seen = self.first_seen.get(rank)
            if seen is None or seen[0] != value:
                self.first_seen[rank] = seen = (value, now)
            silence[rank] = now - seen[1]
        return silence


def waiting_chain(start: int, doings: Mapping[int, Doing | None], stalled: Sequence[int]) -> list[int]:
    """``[start, r1, r2, ...]``: whom ``start`` waits on, whom that one waits on, ... up to a rank that is
    stalled, waits on no single peer, or repeats (a cycle)."""
    chain = [start]
    while chain[-1] not in stalled:
        doing = doings.get(chain[-1])
        if doing is None or doing.waiting_on is None or doing.waiting_on < 0 or doing.waiting_on in chain:
            break
        chain.append(doing.waiting_on)
    return chain


def chain_start(me: int, peer: int, doings: Mapping[int, Doing | None], stalled: Sequence[int]) -> int:
    """Where to follow the waits from: the peer, or in a collective a rank that is not in the collective."""
    if peer >= 0:
        return peer
    others = [rank for rank, doing in sorted(doings.items()) if rank != me]
    outside = [rank for rank in others if (doing := doings[rank]) is None or doing.waiting_on != COLLECTIVE]
    for rank in outside:
        if rank in stalled:
            return rank
    return outside[0] if outside else (stalled[0] if stalled else -1)


def culprit(me: int, peer: int, doings: Mapping[int, Doing | None], stalled: Sequence[int]) -> list[int]:
    """The chain of waits that ends at the rank to blame: a stalled rank if there is one (the one the
    chain reaches, else the lowest), otherwise the rank at the end of the chain of waits."""
    start = chain_start(me, peer, doings, stalled)
    if start < 0:
        return []
    chain = waiting_chain(start, doings, stalled)
    if stalled and chain[-1] not in stalled:
        return [min(stalled)]
    return chain


def describe_chain(me: int, chain: Sequence[int]) -> str:
    """``rank 0 waits on rank 2, which waits on rank 1``."""
    if len(chain) < 2:
        return ""
    rest = ", which waits on ".join(f"rank {rank}" for rank in chain[1:])
    return f" (rank {me} waits on rank {chain[0]}, which waits on {rest})"


def stall_cause(me: int, waited: Waited, chain: Sequence[int], doings: Mapping[int, Doing | None],
                silence: float, step: int) -> str:
    """The root-cause record for a rank whose heartbeat stopped while this rank waited on ``waited``."""
    rank = chain[-1]
    doing = doings.get(rank)
    # no ages: a stopped rank's status is as old as its last heartbeat tick (0.1 s apart), not its freeze
    last = doing.describe(None) if doing is not None else "unknown (it published no status)"
    peer = "a collective" if waited.peer < 0 else f"rank {waited.peer}"
    return (f"rank {rank} stalled: no heartbeat for {silence:.1f} s (process stopped or frozen: SIGSTOP, a "
            f"debugger, a native deadlock, or a call holding the GIL); its last published status: {last}; noticed at step "
            f"{step} by rank {me} waiting on {peer} for {waited.description}{describe_chain(me, chain)}")


def alive_cause(me: int, peer: int, description: str, chain: Sequence[int], doings: Mapping[int, Doing | None],
                waited_s: float, where: str) -> str | None:
    """``rank R is alive but has not sent X for T s (last action ...)`` for the end of a chain of waits whose
    heartbeats all run; None when that rank published no status."""
    rank = chain[-1]
    doing = doings.get(rank)
    if doing is None:
        return None
    now, what, waited = time.time(), description, waited_s
    if len(chain) > 1:
        waiter = doings.get(chain[-2])
        if waiter is not None and waiter.waiting_on is not None:
            what, waited = waiter.waiting_for, now - waiter.waiting_since
    what = what.removeprefix("receive ")
    return (f"rank {rank} is alive but has not sent {what} for {waited:.0f} s (last action: "
            f"{doing.describe(now)}) {where}{describe_chain(me, chain) if peer >= 0 else ''}")


def read_doings(store: Any, prefix: str, world_size: int) -> dict[int, Doing | None]:
    """Every rank's published Doing (None where it published none)."""
    doings: dict[int, Doing | None] = {}
    for rank in range(world_size):
        key = f"{prefix}doing/{rank}"
        doings[rank] = Doing.from_text(store.get(key).decode()) if store.check([key]) else None
    return doings
