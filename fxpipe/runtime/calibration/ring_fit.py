"""Latency and bandwidth of a ring collective from two timed sizes (pure arithmetic, for the calibrations)."""

from __future__ import annotations


def ring_allreduce_fit(num_ranks: int, small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """``(latency s, bandwidth B/s)`` that make :meth:`fxpipe.core.cluster.Cluster.allreduce_time`'s ring
    formula, ``2 (R-1) latency + 2 (R-1) W / (R bandwidth)``, give the two measured ``(bytes, seconds)``."""
    return ring_fit(num_ranks, small, large, passes=2)


def ring_fit(num_ranks: int, small: tuple[float, float], large: tuple[float, float], *,
             passes: int) -> tuple[float, float]:
    """``(latency s, bandwidth B/s)`` that make a ring collective of ``passes`` trips around the ring,
    ``passes (R-1) latency + passes (R-1) W / (R bandwidth)`` (an allreduce 2: reduce-scatter then
    all-gather; a reduce-scatter or an all-gather 1), give the two measured ``(bytes, seconds)``.

    A large collective no slower than the small one (noise) gives the bandwidth of 1 ns for the
    difference; the latency is never negative.
    """
    if num_ranks < 2:
        raise ValueError(f"a ring collective needs at least 2 ranks; got {num_ranks}")
    (small_bytes, small_s), (large_bytes, large_s) = small, large
    if large_bytes <= small_bytes:
        raise ValueError(f"the large collective ({large_bytes} B) must carry more than the small one ({small_bytes} B)")
    steps = passes * (num_ranks - 1)
    share = steps / num_ranks
    bandwidth = share * (large_bytes - small_bytes) / max(large_s - small_s, 1e-9)
    latency = max(small_s - share * small_bytes / bandwidth, 0.0) / steps
    return latency, bandwidth
