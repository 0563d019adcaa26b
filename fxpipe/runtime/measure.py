"""Per-step measurement on a rank: action timeline (simulator trace format) and exact saved-activation bytes."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fxpipe.schedule import Action
from fxpipe.simulate import TimelineEvent


class SavedActivationMeter:
    """Counts the bytes autograd holds for backward, exactly, while installed as saved-tensor hooks.

    Every saved tensor is packed into a small holder; the holder is freed when autograd drops
    it (after the backward that used it), which decrements the live count. Storages saved
    several times count once; parameters count as weights, not activations.
    """

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self._weights = {_storage_key(p) for p in parameters}
        self._live: dict[tuple[int, int], list[int]] = {}  # storage -> [holders alive, nbytes]
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _pack(self, tensor: torch.Tensor) -> _Held:
        key = _storage_key(tensor)
        if key in self._weights:
            return _Held(tensor, None, self)
        entry = self._live.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._live[key] = [1, nbytes]
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[0] += 1
        return _Held(tensor, key, self)

    def _release(self, key: tuple[int, int]) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._live[key]

    @contextmanager
    def installed(self) -> Iterator[SavedActivationMeter]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield self


class _Held:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int] | None, meter: SavedActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


def _unpack(held: _Held) -> torch.Tensor:
    return held.tensor


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return (storage.data_ptr(), storage.nbytes()) if storage.nbytes() else (id(storage), 0)


@dataclass(frozen=True)
class StepStats:
    """What one measured step showed on this rank."""

    rank: int
    stage_index: int
    step_time_s: float
    peak_activation_bytes: int
    events: tuple[TimelineEvent, ...]

    @property
    def busy_s(self) -> float:
        return sum(e.end_s - e.start_s for e in self.events if e.op in ("F", "B"))


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

    def stop(self, action: Action, started: float) -> None:
        self.events.append(TimelineEvent(self.rank, self.stage_index, action.op.value, action.microbatch_index,
                                         started, self._now()))
