"""Discrete-event core of the simulator: devices running lowered action lists, with queued transfer ports."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.core.schedule import Action, Op, ScheduleError

# Integer codes of lowered actions; the event loop dispatches on ranges of them.
# (WEIGHT, the split backward's parameter gradients, came last so the older codes keep their values.)
FORWARD, BACKWARD, RECV_ACTIVATION, RECV_GRADIENT, SEND_ACTIVATION, SEND_GRADIENT, ALLREDUCE, WEIGHT = range(8)
OP_CODES: dict[Op, int] = {
    Op.FORWARD: FORWARD, Op.BACKWARD: BACKWARD, Op.WEIGHT: WEIGHT, Op.RECV_ACTIVATION: RECV_ACTIVATION,
    Op.RECV_GRADIENT: RECV_GRADIENT, Op.SEND_ACTIVATION: SEND_ACTIVATION, Op.SEND_GRADIENT: SEND_GRADIENT,
    Op.ALLREDUCE: ALLREDUCE,
}
CODE_OPS: tuple[Op, ...] = tuple(sorted(OP_CODES, key=OP_CODES.__getitem__))
ACTIVATION, GRADIENT = 0, 1  # kinds of received values

Program = tuple[tuple[int, int], ...]  # (op code, micro-batch index) per lowered action


def encode_program(actions: Sequence[Action]) -> Program:
    return tuple((OP_CODES[a.op], a.microbatch_index) for a in actions)


@dataclass(frozen=True)
class ReplicaSpec:
    """One device of a component: its stage, compute times, and outgoing transfer pieces.

    ``activation_out``/``gradient_out`` are ``(local receiver index, seconds)`` in the order the
    device issues them; ``num_*_in`` is how many pieces make up one received micro-batch.
    """

    stage_index: int
    forward_s: float
    backward_s: float
    activation_out: tuple[tuple[int, float], ...]
    gradient_out: tuple[tuple[int, float], ...]
    num_activation_in: int
    num_gradient_in: int
    message_s: float = 0.0  # the device's own time per message it sends or receives (packing, posting)
    weight_s: float = 0.0  # a W action (split backward: parameter gradients); B then takes backward_s
    stretch_s: float = 0.0  # the last B or W takes this longer: gradient buckets in flight beside it
    start_s: float = 0.0  # when the device may start its list: its stage's step all-gather (sharded weights)


@dataclass(frozen=True)
class ComponentRun:
    """What one component's devices did (local indices): when each reached its allreduce, when its last
    gradient-producing compute (B, or W under split backward) ended, and what it did when."""

    allreduce_ready_s: tuple[float, ...]
    events: tuple[tuple[tuple[int, int, float, float], ...], ...]  # per device: (code, m, start, end)
    transfers: tuple[tuple[int, int, int, int, float, float], ...]  # (src, dst, code, m, start, end)
    gradient_end_s: tuple[float, ...] = ()  # buckets fill during that last pass (before its gradient send)


class _ComponentSim:
    """Runs devices that only exchange data among themselves.

    Model: a device executes its list in order. Compute takes its time; a receive blocks until
    every piece of that micro-batch arrived, then takes ``message_s`` per piece of the device's
    time; a send takes ``message_s`` per piece, then is asynchronous and issues one transfer per
    receiving replica. Each device has one send port and one receive
    port (full duplex): a transfer holds the sender's send port and the receiver's receive port
    for ``latency + bytes / bandwidth``, starting when both are free. Ports are granted first come,
    first served in issue-time order (equal times: the order the events were created), without
    backfilling. Zero-byte pieces arrive at once.
    """

    def __init__(self, replicas: Sequence[ReplicaSpec], programs: Sequence[Program], num_microbatches: int,
                 record: bool) -> None:
        self.replicas = replicas
        self.programs = [programs[r.stage_index] for r in replicas]
        # the index of each device's last gradient-producing pass (B, or W under split backward)
        self.last_pass = [max((i for i, (code, _) in enumerate(program) if code in (BACKWARD, WEIGHT)), default=-1)
                          for program in self.programs]
        self.num_microbatches = num_microbatches
        self.record = record
        count = len(replicas)
        self.cursor = [0] * count
        self.send_free = [0.0] * count
        self.recv_free = [0.0] * count
        self.remaining = ([[r.num_activation_in] * num_microbatches for r in replicas],
                          [[r.num_gradient_in] * num_microbatches for r in replicas])
        self.latest = ([[0.0] * num_microbatches for _ in replicas], [[0.0] * num_microbatches for _ in replicas])
        self.waiting = [-1] * count  # kind * M + m of the blocking receive, -1 when not blocked
        self.send_paid = [-1] * count  # index of the send action whose message time was already spent
        self.send_start = [0.0] * count  # when that send action began
        self.blocked_since = [-1.0] * count
        self.ready_s = [-1.0] * count
        self.gradient_end_s = [0.0] * count
        self.events: list[list[tuple[int, int, float, float]]] = [[] for _ in replicas]
        self.transfers: list[tuple[int, int, int, int, float, float]] = []
        self.heap: list[tuple[float, int, int]] = []
        self.sequence = 0

    def push(self, time_s: float, device: int) -> None:
        heapq.heappush(self.heap, (time_s, self.sequence, device))
        self.sequence += 1

    def run(self) -> ComponentRun:
        for device, replica in enumerate(self.replicas):
            self.push(replica.start_s, device)
        while self.heap:
            time_s, _, device = heapq.heappop(self.heap)
            self.advance(device, time_s)
        stuck = [d for d, ready in enumerate(self.ready_s) if ready < 0]
        if stuck:
            raise ScheduleError(f"simulation deadlocked: local devices {stuck} stopped at actions "
                                f"{[self.programs[d][self.cursor[d]] for d in stuck]}")
        return ComponentRun(tuple(self.ready_s), tuple(tuple(e) for e in self.events), tuple(self.transfers),
                            tuple(self.gradient_end_s))

    def advance(self, device: int, time_s: float) -> None:
        """Execute ``device``'s actions from ``time_s`` until it blocks, must wait its turn, or ends."""
        program, replica, events = self.programs[device], self.replicas[device], self.events[device]
        index, fresh = self.cursor[device], True  # fresh: time_s is the global "now" (safe to send)
        while True:
            code, m = program[index]
            if code <= BACKWARD or code == WEIGHT:
                end_s = time_s + (replica.forward_s if code == FORWARD else replica.backward_s if code == BACKWARD
                                  else replica.weight_s)
                if index == self.last_pass[device] and replica.stretch_s:
                    end_s += replica.stretch_s
                if self.record:
                    events.append((code, m, time_s, end_s))
                if code != FORWARD:
                    self.gradient_end_s[device] = end_s
                fresh, time_s = fresh and end_s == time_s, end_s
            elif code <= RECV_GRADIENT:
                kind = code - RECV_ACTIVATION
                if self.remaining[kind][device][m]:
                    self.waiting[device] = kind * self.num_microbatches + m
                    self.blocked_since[device], self.cursor[device] = time_s, index
                    return
                start_s = self.blocked_since[device] if self.blocked_since[device] >= 0 else time_s
                end_s = max(time_s, self.latest[kind][device][m]) + replica.message_s * (
                    replica.num_activation_in if kind == ACTIVATION else replica.num_gradient_in)
                self.blocked_since[device] = -1.0
                if self.record:
                    events.append((code, m, start_s, end_s))
                fresh, time_s = fresh and end_s == time_s, end_s
            elif code <= SEND_GRADIENT:
                if self.send_paid[device] != index:  # pack and post first (once, even if the send must wait)
                    self.send_paid[device], self.send_start[device] = index, time_s
                    pieces = replica.activation_out if code == SEND_ACTIVATION else replica.gradient_out
                    end_s = time_s + replica.message_s * len(pieces)
                    fresh, time_s = fresh and end_s == time_s, end_s
                # ports are granted in global time order: send now only if no other event comes first
                if not fresh and self.heap and self.heap[0][0] <= time_s:
                    self.cursor[device] = index
                    self.push(time_s, device)
                    return
                fresh = True
                self.issue(device, code, m, time_s)
                if self.record:
                    events.append((code, m, self.send_start[device], time_s))
            else:
                self.ready_s[device], self.cursor[device] = time_s, index
                return
            index += 1

    def issue(self, device: int, code: int, m: int, time_s: float) -> None:
        """Start the transfers of one send action, queued on the ports; wake a receiver when complete."""
        replica = self.replicas[device]
        pieces, kind = ((replica.activation_out, ACTIVATION) if code == SEND_ACTIVATION
                        else (replica.gradient_out, GRADIENT))
        for receiver, seconds in pieces:
            start_s = end_s = time_s
            if seconds > 0:
                start_s = max(time_s, self.send_free[device], self.recv_free[receiver])
                end_s = start_s + seconds
                self.send_free[device] = self.recv_free[receiver] = end_s
            remaining, latest = self.remaining[kind][receiver], self.latest[kind][receiver]
            remaining[m] -= 1
            if end_s > latest[m]:
                latest[m] = end_s
            if self.record:
                self.transfers.append((device, receiver, code, m, start_s, end_s))
            if remaining[m] == 0 and self.waiting[receiver] == kind * self.num_microbatches + m:
                self.waiting[receiver] = -1
                # the receiver may have run ahead of the global clock through compute before blocking
                self.push(max(latest[m], self.blocked_since[receiver]), receiver)


def run_component(replicas: Sequence[ReplicaSpec], programs: Sequence[Program], num_microbatches: int,
                  record: bool = True) -> ComponentRun:
    """Simulate one set of devices that exchange data only among themselves."""
    return _ComponentSim(replicas, programs, num_microbatches, record).run()
