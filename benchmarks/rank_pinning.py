"""Placing a CPU rank's threads: every thread of this process (gloo's included) on one core, or back on all."""

from __future__ import annotations

import os


def place_threads(cores: set[int]) -> None:
    """Set the CPU affinity of every thread of this process to ``cores`` (threads started later inherit their
    creator's, so the main thread's mask covers gloo's and the heartbeat's threads started after this)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def pin_rank(rank: int) -> int:
    """This rank's threads on core ``rank`` modulo the usable cores (one core per rank while there are as many);
    returns the core."""
    usable = sorted(os.sched_getaffinity(0))
    core = usable[rank % len(usable)]
    place_threads({core})
    return core
