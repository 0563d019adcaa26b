"""Discrete-event core for virtual stages: devices running several chunks' lowered actions, with queued ports."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.core.schedule import Action, ScheduleError
from fxpipe.sim.events import (
    ACTIVATION,
    BACKWARD,
    FORWARD,
    GRADIENT,
    OP_CODES,
    RECV_ACTIVATION,
    RECV_GRADIENT,
    SEND_ACTIVATION,
    SEND_GRADIENT,
    WEIGHT,
)

ChunkProgram = tuple[tuple[int, int, int], ...]  # (op code, chunk, micro-batch) per lowered action
Key = tuple[int, int, int]  # (kind, chunk, micro-batch) of a received value


def encode_chunk_program(actions: Sequence[Action]) -> ChunkProgram:
    return tuple((OP_CODES[a.op], a.chunk_index, a.microbatch_index) for a in actions)


@dataclass(frozen=True)
class ChunkCosts:
    """One chunk's figures on one device: compute seconds and the pieces it sends.

    ``activation_out``/``gradient_out`` are ``(receiving device, receiving chunk, seconds)`` in issue order;
    ``num_*_in`` how many pieces make up one received micro-batch (0 where the neighbour is local).
    """

    forward_s: float
    backward_s: float
    weight_s: float
    activation_out: tuple[tuple[int, int, float], ...]
    gradient_out: tuple[tuple[int, int, float], ...]
    num_activation_in: int
    num_gradient_in: int


@dataclass(frozen=True)
class ChunkDevice:
    """A device of a group: its chunks' costs (by chunk index), its own time per message piece, and when it starts its
    list (sharded chunks gather their weights first: :mod:`fxpipe.sim.sharding_cost`)."""

    chunks: dict[int, ChunkCosts]
    message_s: float = 0.0
    start_s: float = 0.0


@dataclass(frozen=True)
class VirtualRun:
    """When each device reached its allreduce, and (when recorded) what it did when."""

    ready_s: tuple[float, ...]
    events: tuple[tuple[tuple[int, int, int, float, float], ...], ...]  # per device: (code, chunk, m, start, end)
    transfers: tuple[tuple[int, int, int, int, int, float, float], ...]  # (src, dst, code, chunk, m, start, end)


class _VirtualSim:
    """The model of :class:`fxpipe.sim.events._ComponentSim` with per-chunk costs: a device runs its list in
    order; compute takes its chunk's time; a receive blocks until every piece arrived, then takes ``message_s``
    per piece; a send takes ``message_s`` per piece, then issues them (asynchronous). One send and one receive
    port per device, granted first come first served in issue-time order, without backfilling."""

    def __init__(self, devices: Sequence[ChunkDevice], programs: Sequence[ChunkProgram], record: bool) -> None:
        self.devices, self.programs, self.record = devices, programs, record
        count = len(devices)
        self.cursor = [0] * count
        self.send_free = [0.0] * count
        self.recv_free = [0.0] * count
        self.arrived: list[dict[Key, int]] = [{} for _ in devices]
        self.latest: list[dict[Key, float]] = [{} for _ in devices]
        self.waiting: list[Key | None] = [None] * count
        self.send_paid = [-1] * count
        self.send_start = [0.0] * count
        self.blocked_since = [-1.0] * count
        self.ready_s = [-1.0] * count
        self.events: list[list[tuple[int, int, int, float, float]]] = [[] for _ in devices]
        self.transfers: list[tuple[int, int, int, int, int, float, float]] = []
        self.heap: list[tuple[float, int, int]] = []
        self.sequence = 0

    def push(self, time_s: float, device: int) -> None:
        heapq.heappush(self.heap, (time_s, self.sequence, device))
        self.sequence += 1

    def expected(self, device: int, key: Key) -> int:
        costs = self.devices[device].chunks[key[1]]
        return costs.num_activation_in if key[0] == ACTIVATION else costs.num_gradient_in

    def run(self) -> VirtualRun:
        for device, spec in enumerate(self.devices):
            self.push(spec.start_s, device)
        while self.heap:
            time_s, _, device = heapq.heappop(self.heap)
            self.advance(device, time_s)
        stuck = [d for d, ready in enumerate(self.ready_s) if ready < 0]
        if stuck:
            raise ScheduleError(f"simulation deadlocked: devices {stuck} stopped at actions "
                                f"{[self.programs[d][self.cursor[d]] for d in stuck]}")
        return VirtualRun(tuple(self.ready_s), tuple(tuple(e) for e in self.events), tuple(self.transfers))

    def advance(self, device: int, time_s: float) -> None:
        """Execute ``device``'s actions from ``time_s`` until it blocks, must wait its turn, or ends."""
        program, spec = self.programs[device], self.devices[device]
        index, fresh = self.cursor[device], True  # fresh: time_s is the global "now" (safe to send)
        while True:
            code, chunk, m = program[index]
            if code in (FORWARD, BACKWARD, WEIGHT):
                costs = spec.chunks[chunk]
                end_s = time_s + (costs.forward_s if code == FORWARD else costs.backward_s if code == BACKWARD
                                  else costs.weight_s)
                self.note(device, code, chunk, m, time_s, end_s)
                fresh, time_s = fresh and end_s == time_s, end_s
            elif code in (RECV_ACTIVATION, RECV_GRADIENT):
                key = (ACTIVATION if code == RECV_ACTIVATION else GRADIENT, chunk, m)
                expected = self.expected(device, key)
                if self.arrived[device].get(key, 0) < expected:
                    self.waiting[device], self.blocked_since[device], self.cursor[device] = key, time_s, index
                    return
                start_s = self.blocked_since[device] if self.blocked_since[device] >= 0 else time_s
                end_s = max(time_s, self.latest[device].get(key, 0.0)) + spec.message_s * expected
                self.blocked_since[device] = -1.0
                self.note(device, code, chunk, m, start_s, end_s)
                fresh, time_s = fresh and end_s == time_s, end_s
            elif code in (SEND_ACTIVATION, SEND_GRADIENT):
                if self.send_paid[device] != index:  # pack and post first (once, even if the send must wait)
                    costs = spec.chunks[chunk]
                    pieces = costs.activation_out if code == SEND_ACTIVATION else costs.gradient_out
                    self.send_paid[device], self.send_start[device] = index, time_s
                    end_s = time_s + spec.message_s * len(pieces)
                    fresh, time_s = fresh and end_s == time_s, end_s
                if not fresh and self.heap and self.heap[0][0] <= time_s:  # ports go in global time order
                    self.cursor[device] = index
                    self.push(time_s, device)
                    return
                fresh = True
                self.issue(device, code, chunk, m, time_s)
                self.note(device, code, chunk, m, self.send_start[device], time_s)
            else:
                self.ready_s[device], self.cursor[device] = time_s, index
                return
            index += 1

    def note(self, device: int, code: int, chunk: int, m: int, start_s: float, end_s: float) -> None:
        if self.record:
            self.events[device].append((code, chunk, m, start_s, end_s))

    def issue(self, device: int, code: int, chunk: int, m: int, time_s: float) -> None:
        """Start the pieces of one send on the ports; wake a receiver once its micro-batch is complete."""
        costs = self.devices[device].chunks[chunk]
        pieces, kind = ((costs.activation_out, ACTIVATION) if code == SEND_ACTIVATION
                        else (costs.gradient_out, GRADIENT))
        for receiver, receiver_chunk, seconds in pieces:
            start_s = end_s = time_s
            if seconds > 0:
                start_s = max(time_s, self.send_free[device], self.recv_free[receiver])
                end_s = start_s + seconds
                self.send_free[device] = self.recv_free[receiver] = end_s
            key = (kind, receiver_chunk, m)
            arrived = self.arrived[receiver][key] = self.arrived[receiver].get(key, 0) + 1
            self.latest[receiver][key] = max(self.latest[receiver].get(key, 0.0), end_s)
            if self.record:
                self.transfers.append((device, receiver, code, chunk, m, start_s, end_s))
            if arrived == self.expected(receiver, key) and self.waiting[receiver] == key:
                self.waiting[receiver] = None
                # the receiver may have run ahead of the global clock through compute before blocking
                self.push(max(self.latest[receiver][key], self.blocked_since[receiver]), receiver)


def run_chunk_devices(devices: Sequence[ChunkDevice], programs: Sequence[ChunkProgram],
                      record: bool = True) -> VirtualRun:
    """Simulate devices running several chunks each (``programs[d]``: device d's lowered list, encoded).

    Devices that exchange nothing (e.g. the replica columns of groups with equal replica counts) share no port,
    so each set linked by pieces runs alone, and sets with equal local figures once (the same deterministic
    computation): exact, as :func:`fxpipe.sim.simulate._simulate_components`.
    """
    ready = [0.0] * len(devices)
    events: list[tuple[tuple[int, int, int, float, float], ...]] = [()] * len(devices)
    transfers: list[tuple[int, int, int, int, int, float, float]] = []
    cache: dict[tuple[object, ...], VirtualRun] = {}
    for members in _components(devices):
        local = {device: index for index, device in enumerate(members)}
        specs = tuple(_localised(devices[d], local) for d in members)
        key = (tuple((spec.message_s, spec.start_s, tuple(sorted(spec.chunks.items()))) for spec in specs),
               tuple(programs[d] for d in members))
        run = cache.get(key)
        if run is None:
            run = cache[key] = _VirtualSim(specs, [programs[d] for d in members], record).run()
        for index, device in enumerate(members):
            ready[device], events[device] = run.ready_s[index], run.events[index]
        transfers.extend((members[src], members[dst], code, chunk, m, start_s, end_s)
                         for src, dst, code, chunk, m, start_s, end_s in run.transfers)
    return VirtualRun(tuple(ready), tuple(events), tuple(transfers))


def _components(devices: Sequence[ChunkDevice]) -> list[list[int]]:
    """Sets of devices linked by pieces (union-find), each sorted, in order of their first device."""
    parent = list(range(len(devices)))

    def find(device: int) -> int:
        while parent[device] != device:
            parent[device] = parent[parent[device]]
            device = parent[device]
        return device

    for device, spec in enumerate(devices):
        for costs in spec.chunks.values():
            for receiver, _, _ in (*costs.activation_out, *costs.gradient_out):
                parent[find(receiver)] = find(device)
    groups: dict[int, list[int]] = {}
    for device in range(len(devices)):
        groups.setdefault(find(device), []).append(device)
    return sorted(groups.values())


def _localised(spec: ChunkDevice, local: dict[int, int]) -> ChunkDevice:
    """``spec`` with its pieces' receiving devices renumbered within its set."""
    def moved(pieces: tuple[tuple[int, int, float], ...]) -> tuple[tuple[int, int, float], ...]:
        return tuple((local[receiver], chunk, seconds) for receiver, chunk, seconds in pieces)

    return ChunkDevice({chunk: ChunkCosts(c.forward_s, c.backward_s, c.weight_s, moved(c.activation_out),
                                          moved(c.gradient_out), c.num_activation_in, c.num_gradient_in)
                        for chunk, c in spec.chunks.items()}, spec.message_s, spec.start_s)
