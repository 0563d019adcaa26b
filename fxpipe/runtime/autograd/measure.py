"""Per-step measurement on a rank: action timeline (simulator trace format) and exact saved-activation bytes."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal

import torch

from fxpipe.core.schedule import Action
from fxpipe.core.timeline import TimelineEvent


@dataclass
class SavedActivationMeter:
    """Counts the bytes autograd holds for backward, exactly, as unique storages alive at once; keeps the peak.

    Inside :meth:`measure`, every tensor autograd saves passes through a pack hook that wraps it in
    a handle; the handle lives exactly as long as autograd keeps the saved value (released when
    backward consumes it or the graph is freed). A storage counts once however many saved tensors
    view it; parameters (``excluded`` storages) are weights, not activations.
    """

    excluded: set[int] = field(default_factory=set)
    live_bytes: int = 0
    peak_bytes: int = 0
    _refs: dict[int, list[int]] = field(default_factory=dict)  # storage pointer -> [handles alive, nbytes]

    @classmethod
    def for_parameters(cls, parameters: Iterable[torch.Tensor]) -> SavedActivationMeter:
        return cls(excluded={p.untyped_storage().data_ptr() for p in parameters})

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def note_transient(self, num_bytes: int) -> None:
        """Bytes held for a while outside the hooks' sight (a recomputed forward's saved tensors, kept by
        checkpointing during one backward), on top of what is live now: they count toward the peak."""
        self.peak_bytes = max(self.peak_bytes, self.live_bytes + num_bytes)

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = tensor.untyped_storage().data_ptr()
        if key in self.excluded or tensor.device.type == "meta":
            return tensor
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, tensor.untyped_storage().nbytes()]
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        # detach: a saved output holding its own grad_fn would make a reference cycle that outlives backward
        return _SavedHandle(tensor.detach(), key, self)

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._refs[key]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _SavedHandle) else packed

    @contextmanager
    def measure(self) -> Iterator[SavedActivationMeter]:
        """Hooks on for the block; the peak covers everything saved inside it."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self


class _SavedHandle:
    """A saved tensor as autograd stores it; dropping the last handle of a storage frees its bytes."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: SavedActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


MeasureSetting = bool | Literal["timeline"]  # what users write: pipe.measure = True | False | "timeline"


class MeasureMode(Enum):
    """What a step records: nothing, a timeline and the exact saved-activation peak, or the timeline only
    (counting saved tensors hooks every one of them, which slows a CPU step by up to ~20%)."""

    OFF = False
    FULL = True
    TIMELINE = "timeline"

    @classmethod
    def of(cls, setting: object) -> MeasureMode:
        for mode in cls:
            if setting is mode.value or (isinstance(setting, str) and setting == mode.value):
                return mode
        raise ValueError(f"measure must be True, False or 'timeline'; got {setting!r}")


@dataclass(frozen=True)
class StepStats:
    """What one measured step showed on this rank."""

    rank: int
    stage_index: int
    step_time_s: float
    peak_activation_bytes: int | None  # None when measured with measure='timeline'
    events: tuple[TimelineEvent, ...]

    @property
    def busy_s(self) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.op in ("F", "B", "W"))


class ActionTimer:
    """Records when each action of a step starts and ends, relative to the step's start."""

    def __init__(self, rank: int, stage_index: int, synchronize: bool) -> None:
        self.rank, self.stage_index, self.synchronize = rank, stage_index, synchronize
        self.events: list[TimelineEvent] = []
        self.origin = time.perf_counter()

    def _now(self) -> float:
        if self.synchronize:
            torch.cuda.synchronize()
        return time.perf_counter() - self.origin

    def start(self) -> float:
        return self._now()

    def stop(self, action: Action, started: float, stage_index: int | None = None) -> None:
        """``stage_index``: the chunk the action ran (virtual stages; else the timer's stage)."""
        self.events.append(TimelineEvent(self.rank, self.stage_index if stage_index is None else stage_index,
                                         action.op.value, action.microbatch_index, started, self._now()))
