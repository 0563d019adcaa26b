"""Candidates in planner terms: stages as block spans on devices, whole candidates, each stage's memory choice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class Span:
    """One stage of a candidate: blocks ``[first, stop)`` on ``devices``, one replica per ``tensor_parallel``
    devices (a replica's group is ``devices[r*T:(r+1)*T]``, inside one host)."""

    first: int
    stop: int
    devices: tuple[int, ...]
    tensor_parallel: int = 1

    @property
    def replicas(self) -> int:
        return len(self.devices) // self.tensor_parallel

    @property
    def leads(self) -> tuple[int, ...]:
        """One device per replica, its group's first: where transfers and allreduces are costed."""
        return self.devices[::self.tensor_parallel]


def spans_from_stops(stops: Sequence[int], devices: Sequence[tuple[int, ...]],
                     tensor_parallel: Sequence[int] = ()) -> list[Span]:
    """Stages over blocks ``[stops[s-1], stops[s])`` (the first from 0) on ``devices[s]`` (groups of
    ``tensor_parallel[s]``, default 1)."""
    degrees = tuple(tensor_parallel) or (1,) * len(stops)
    return [Span(stops[s - 1] if s else 0, stop, devices[s], degrees[s]) for s, stop in enumerate(stops)]


@dataclass(frozen=True, order=True)
class Candidate:
    """A complete plan in planner terms, ordered by its pivot-model latency."""

    latency_s: float
    microbatch_rows: int
    spans: tuple[Span, ...] = field(compare=False)

    @property
    def layout(self) -> tuple[int, ...]:
        """Replicas per stage."""
        return tuple(span.replicas for span in self.spans)

    @property
    def degrees(self) -> tuple[int, ...]:
        """Tensor-parallel group size per stage."""
        return tuple(span.tensor_parallel for span in self.spans)

    @property
    def num_devices(self) -> int:
        return sum(len(span.devices) for span in self.spans)

    def identity(self) -> tuple[object, ...]:
        return (self.microbatch_rows, tuple((s.first, s.stop, s.devices, s.tensor_parallel) for s in self.spans))


class StageChoice(NamedTuple):
    """What a stage of a candidate does with its memory: recompute in backward or not, its sharding level,
    and the peak bytes per device that gives."""

    recompute: bool
    memory: int
    sharding: str = "none"


__all__ = ["Candidate", "Span", "StageChoice", "spans_from_stops"]
