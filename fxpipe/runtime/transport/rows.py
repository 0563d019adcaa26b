"""Which global-batch rows a rank reads (for samplers that load only those) and where they sit in partial data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fxpipe.core.plan import Plan
from fxpipe.core.row_slices import row_ranges

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram

RowRanges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RowMap:
    """The rows one replica of a stage handles, per micro-batch, in the global batch and in its partial data.

    Partial data holds this replica's rows of every micro-batch, in micro-batch order, one after the
    other: micro-batch ``m``'s slice is ``local(m)`` of it.
    """

    per_microbatch: RowRanges  # global [start, stop) of micro-batch m's slice

    @classmethod
    def of(cls, plan: Plan, replica_index: int, num_replicas: int) -> RowMap:
        """At the plan's global batch size."""
        return cls.split(row_ranges(plan.global_batch_size, plan.num_microbatches), replica_index, num_replicas)

    @classmethod
    def split(cls, microbatch_ranges: RowRanges, replica_index: int, num_replicas: int) -> RowMap:
        """Replica ``replica_index``'s share of each micro-batch ``[start, stop)`` (shares differ by at most a row)."""
        return cls(tuple((start + first, start + last) for start, stop in microbatch_ranges
                         for first, last in (row_ranges(stop - start, num_replicas)[replica_index],)))

    @property
    def num_rows(self) -> int:
        return sum(stop - start for start, stop in self.per_microbatch)

    def local(self, microbatch_index: int) -> tuple[int, int]:
        offset = sum(stop - start for start, stop in self.per_microbatch[:microbatch_index])
        start, stop = self.per_microbatch[microbatch_index]
        return offset, offset + stop - start

    def ranges(self) -> RowRanges:
        """The global rows as few ``[start, stop)`` ranges as possible (adjacent slices merged)."""
        merged: list[tuple[int, int]] = []
        for start, stop in self.per_microbatch:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            elif stop > start:
                merged.append((start, stop))
        return tuple(merged)


def input_rows(program: SplitProgram, stage_index: int, row_map: RowMap) -> RowRanges | None:
    """Global-batch rows whose inputs a replica of the stage reads; None when it reads no batched input."""
    stage_inputs = program.stages[stage_index].input_values
    reads = any(program.values[name].batched for name in program.model_inputs if name in stage_inputs)
    return row_map.ranges() if reads else None


def target_rows(program: SplitProgram, stage_index: int, row_map: RowMap) -> RowRanges | None:
    """Global-batch rows whose targets a replica of the stage reads: the last stage's; None elsewhere."""
    return row_map.ranges() if stage_index == len(program.stages) - 1 else None


def gather_rows(value: torch.Tensor, ranges: RowRanges | None, batch_dim: int = 0) -> torch.Tensor | None:
    """What a sampler that loads only ``ranges`` of the global batch gives ``step(partial=True)``: those rows,
    concatenated in the batch dim (``batch_dims`` / ``target_batch_dim`` of compile); None for None."""
    if ranges is None:
        return None
    return torch.cat([value.narrow(batch_dim, start, stop - start) for start, stop in ranges], batch_dim)
