"""How a micro-batch's rows split over a stage's replicas, and which rows cross a cut between two splits."""

from __future__ import annotations

from functools import lru_cache

from fxpipe.core.plan import PlanError


@lru_cache(maxsize=4096)  # planner and simulator ask for the same few splits millions of times
def split_rows(num_rows: int, num_parts: int) -> tuple[int, ...]:
    """Sizes of ``num_parts`` contiguous slices of ``num_rows`` rows; they differ by at most one.

    The first ``num_rows % num_parts`` slices get the extra row. Planner, simulator and runtime all
    use this one rule, so predicted and executed slices agree.
    """
    if num_parts < 1 or num_rows < num_parts:
        raise PlanError(f"cannot split {num_rows} rows into {num_parts} non-empty slices")
    base, extra = divmod(num_rows, num_parts)
    return tuple(base + 1 if i < extra else base for i in range(num_parts))


def row_ranges(num_rows: int, num_parts: int) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` of every slice of :func:`split_rows`."""
    ranges = []
    start = 0
    for size in split_rows(num_rows, num_parts):
        ranges.append((start, start + size))
        start += size
    return tuple(ranges)


def shared_rows(num_rows: int, num_senders: int, num_receivers: int) -> tuple[tuple[int, int, int, int], ...]:
    """Which rows each sender replica hands each receiver replica across a cut.

    Returns ``(sender_index, receiver_index, start, stop)`` for every pair whose slices overlap,
    in sender-then-receiver order; rows are micro-batch-relative.
    """
    senders, receivers = row_ranges(num_rows, num_senders), row_ranges(num_rows, num_receivers)
    pairs = []
    sender_index = receiver_index = 0
    # Both slicings cover [0, num_rows) in order, so one merge pass finds every overlap (linear, not R x R).
    while sender_index < num_senders and receiver_index < num_receivers:
        (s_start, s_stop), (r_start, r_stop) = senders[sender_index], receivers[receiver_index]
        start, stop = max(s_start, r_start), min(s_stop, r_stop)
        if start < stop:
            pairs.append((sender_index, receiver_index, start, stop))
        if s_stop <= r_stop:
            sender_index += 1
        if r_stop <= s_stop:
            receiver_index += 1
    return tuple(pairs)
