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
from typing import TYPE_CHECKING

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
        run = self._resaved_runs.get(first)
        if run is None:  # every stop at once: one pass over the blocks from ``first``
            totals = (Affine.total(num_bytes for saver, num_bytes in entries if saver < first)
                      for entries in self._resaved[first:])
            run = self._resaved_runs[first] = list(itertools.accumulate(totals))
        return run[stop - first - 1]

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
