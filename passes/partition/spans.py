"""Candidates in planner terms: stages as block spans on devices, whole candidates, each stage's memory choice."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(frozen=True)
class Span:
    """One stage of a candidate: blocks ``[first, stop)`` on ``devices`` (one replica per device)."""

    first: int
    stop: int
    devices: tuple[int, ...]


def spans_from_stops(stops: Sequence[int], devices: Sequence[tuple[int, ...]]) -> list[Span]:
    """Stages over blocks ``[stops[s-1], stops[s])`` (the first from 0) on ``devices[s]``."""
    return [Span(stops[s - 1] if s else 0, stop, devices[s]) for s, stop in enumerate(stops)]


@dataclass(frozen=True, order=True)
class Candidate:
    """A complete plan in planner terms, ordered by its pivot-model latency."""

    latency_s: float
    microbatch_rows: int
    spans: tuple[Span, ...] = field(compare=False)

    @property
    def layout(self) -> tuple[int, ...]:
        return tuple(len(span.devices) for span in self.spans)

    @property
    def num_devices(self) -> int:
        return sum(len(span.devices) for span in self.spans)

    def identity(self) -> tuple[object, ...]:
        return (self.microbatch_rows, tuple((s.first, s.stop, s.devices) for s in self.spans))


class StageChoice(NamedTuple):
    """What a stage of a candidate does with its memory: recompute in backward or not, its sharding level,
    and the peak bytes per device that gives."""

    recompute: bool
    memory: int
    sharding: str = "none"


__all__ = ["Candidate", "Span", "StageChoice", "spans_from_stops"]
