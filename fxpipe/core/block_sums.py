"""Memoised sums of a cost chain's block costs over block ranges, bit-identical to summing the slice.

Planner and simulator ask for the cost of blocks ``[first, stop)`` hundreds of thousands of times on
long chains. Prefix-sum differences would be faster still but round differently from the plain
left-to-right sum (:meth:`Affine.total`), and a last-bit change can flip a tie between plans; so
every range is summed left to right from ``first`` exactly as before, and the running sums from
each ``first`` are kept (grown by doubling), so each range costs one list lookup once computed. The
bytes a stage saves again of values an earlier stage saved (:attr:`fxpipe.core.chain.Block.resaved`)
depend on ``first`` too: they are summed the same way, for every ``stop`` at once per ``first``.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, NamedTuple

from fxpipe.core.chain import block_units
from fxpipe.core.costgraph import Affine

if TYPE_CHECKING:  # fxpipe.passes imports the planner, which imports this module
    from fxpipe.core.chain import CostChain

FIELDS = ("forward_s", "backward_s", "saved_bytes")


class BlockSums:
    """Running sums of one chain's per-block Affine costs, per (field, first block): fixed and per-sample parts."""

    def __init__(self, chain: CostChain) -> None:
        self._parts = {name: ([getattr(block, name).fixed for block in chain.blocks],
                              [getattr(block, name).per_sample for block in chain.blocks]) for name in FIELDS}
        # (field, first) -> running sums over blocks[first:first+1], blocks[first:first+2], ...
        self._runs: dict[tuple[str, int], tuple[list[float], list[float]]] = {}
        self._resaved = [block.resaved for block in chain.blocks]
        # first -> running sums over stop of the re-saved bytes a stage [first, stop) counts
        self._resaved_runs: dict[int, list[Affine]] = {}
        self._units = [block_units(block) for block in chain.blocks]
        # unit totals only grow along a run when no entry is negative: then its largest and count are running figures
        self._units_grow = all(num_bytes >= 0 for entries in self._units for _, num_bytes in entries)
        self._unit_runs: dict[int, UnitRun] = {}

    def total(self, first: int, stop: int, field: str) -> Affine:
        """``Affine.total(getattr(b, field) for b in chain.blocks[first:stop])``, the same float operations."""
        assert first >= 0, f"block range [{first}, {stop}) starts before block 0"
        stop = min(stop, len(self._parts[field][0]))
        if stop <= first:
            return Affine(0.0, 0.0)
        run = self._runs.get((field, first))
        if run is None or len(run[0]) < stop - first:
            run = self._grown(field, first, stop)
        return Affine(run[0][stop - first - 1], run[1][stop - first - 1])

    def resaved(self, first: int, stop: int) -> Affine:
        """Bytes blocks ``[first, stop)`` save again of values blocks before ``first`` saved: their
        :attr:`~fxpipe.core.chain.Block.resaved` entries whose earlier saver is before ``first``, in block order."""
        assert first >= 0, f"block range [{first}, {stop}) starts before block 0"
        stop = min(stop, len(self._resaved))
        if stop <= first:
            return Affine(0.0, 0.0)
        run = self._resaved_runs.get(first, [])
        if len(run) < stop - first:  # grown by doubling, each sum continuing the last: the same additions
            target = min(len(self._resaved), max(first + 2 * len(run), stop))
            totals = (Affine.total(num_bytes for saver, num_bytes in entries if saver < first)
                      for entries in self._resaved[first + len(run):target])
            run = self._resaved_runs[first] = run + list(itertools.accumulate(totals, initial=run[-1]))[1:] \
                if run else list(itertools.accumulate(totals))
        return run[stop - first - 1]

    def units(self, first: int, stop: int) -> tuple[int, int] | None:
        """``(largest, count)`` of the positive FSDP unit totals over blocks ``[first, stop)``
        (:func:`fxpipe.sim.stagecost.stage_unit_bytes`: ``max`` and ``len`` of its list, 0 for none); None when
        some unit entry is negative (totals may then shrink: the caller walks the blocks)."""
        assert 0 <= first < stop <= len(self._units), f"block range [{first}, {stop}) is not in the chain"
        if not self._units_grow:
            return None
        run = self._unit_runs.get(first)
        if run is None or len(run.largest) < stop - first:
            run = self._unit_runs[first] = _grown_units(run or UnitRun({}, [], []), self._units[first:], stop - first)
        return run.largest[stop - first - 1], run.counts[stop - first - 1]

    def _grown(self, field: str, first: int, stop: int) -> tuple[list[float], list[float]]:
        """A longer copy of the run from ``first`` (at least to ``stop``, doubling), published whole, so a
        reader in another thread never sees a list being filled."""
        have = self._runs.get((field, first), ([], []))
        target = min(len(self._parts[field][0]), max(first + 2 * len(have[0]), stop))
        run = tuple(_extended(sums, values[first + len(sums):target])
                    for sums, values in zip(have, self._parts[field], strict=True))
        fixed, per_sample = run
        self._runs[(field, first)] = (fixed, per_sample)
        return fixed, per_sample


class UnitRun(NamedTuple):
    """Unit totals over blocks ``[first, first + len(largest))`` and, per stop, the largest and how many are > 0."""

    totals: dict[str, int]
    largest: list[int]
    counts: list[int]


def _grown_units(run: UnitRun, entries: list[tuple[tuple[str, int], ...]], length: int) -> UnitRun:
    """``run`` continued over ``entries`` (each block's units, from the run's first block) to at least ``length``
    blocks (doubling), as a new run: a reader in another thread never sees one being filled."""
    totals, largest, counts = dict(run.totals), list(run.largest), list(run.counts)
    best, count = (largest[-1], counts[-1]) if largest else (0, 0)
    for block_entries in entries[len(largest):min(len(entries), max(2 * len(largest), length))]:
        for unit, num_bytes in block_entries:
            before = totals.get(unit, 0)
            totals[unit] = after = before + num_bytes
            count += before <= 0 < after
            best = max(best, after)
        largest.append(best)
        counts.append(count)
    return UnitRun(totals, largest, counts)


def _extended(sums: list[float], values: list[float]) -> list[float]:
    """``sums`` followed by the running sums of ``values`` continuing from its last entry (0.0 when empty),
    each one addition, left to right."""
    return sums + list(itertools.accumulate(values, initial=sums[-1] if sums else 0.0))[1:]


_BY_CHAIN: dict[int, BlockSums] = {}


def block_sums(chain: CostChain) -> BlockSums:
    """The chain's :class:`BlockSums`, made once per chain object and dropped when the chain is freed."""
    key = id(chain)
    sums = _BY_CHAIN.get(key)
    if sums is None:
        sums = _BY_CHAIN[key] = BlockSums(chain)
        weakref.finalize(chain, _BY_CHAIN.pop, key, None)
    return sums
