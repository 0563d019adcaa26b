"""One tensor-parallel collective's phases on 2 gloo CPU ranks: by what precedes it, by the runtime's path, with and without the heartbeat.

Run: python benchmarks/tp_collective_phases.py [--rounds 4] [--calls 30] [--bytes 131072] [--write]

On 2 forked gloo ranks (1 thread each), ``--calls`` all-reduces of ``--bytes`` (gpt-mini ``1x2``'s activation
size) are timed per variant, the variants interleaved round by round so that the host's load falls on all alike:

- what precedes each call: a barrier (the collective's own threads just ran), ~1.5 ms of matmuls on both ranks
  without a barrier (as in a tensor-parallel step, and as calibrate_lockstep times the group's link), or a 1.5 ms
  sleep (the threads idle as long, no compute);
- the path: a plain blocking ``dist.all_reduce``, or the runtime's ``GroupCommunicator.all_reduce`` with the
  driver's ``PeerExchange`` (its copy, an async all-reduce, ``Work.wait(timeout)`` through the exchange);
- the failure log's heartbeat thread: absent in the first half of the rounds, running in the second (once started
  it runs to the end).

Each call is split, on the host's monotonic clock both forked ranks share, into rank 0's wait for its peer to
enter (max of the entries - its own) and the time after both had entered; the CPU time of every thread but the
main one (gloo's worker and transport threads, the heartbeat), from /proc schedstat, is divided by the calls.
Medians of rank 0's calls over every round of a variant.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import machine_notes, run_ranks  # noqa: E402
from benchmarks.tp_fidelity_terms import _thread_cpu_s  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/tp_collective_phases.py --write"
GAP_S = 1.5e-3


class _Owner:
    """What the failure log's heartbeat lives as long as."""


def _variant(pace: Callable[[], object], call: Callable[[], object], calls: int) -> tuple[list[float], list[float], float]:
    """Entry and exit times of ``calls`` calls, each after ``pace()``, and the helper threads' CPU seconds per call."""
    import torch.distributed as dist

    main = str(os.getpid())
    entries, exits = [], []
    dist.barrier()
    before = _thread_cpu_s()
    for _ in range(calls):
        pace()
        entries.append(time.perf_counter())
        call()
        exits.append(time.perf_counter())
    after = _thread_cpu_s()
    helpers = sum(cpu - before[tid] for tid, cpu in after.items() if tid in before and tid != main)
    return entries, exits, helpers / calls


def phases_rank(rank: int, world_size: int, num_rounds: int, calls: int, num_bytes: int) -> dict[str, Any]:
    import torch.distributed as dist

    from fxpipe.runtime.calibration.calibrate_lockstep import LOCKSTEP_MATMUL_SIZE, lockstep_matmuls
    from fxpipe.runtime.faults.failures import FailureLog
    from fxpipe.runtime.parallel.tensor_parallel import GroupCommunicator
    from fxpipe.runtime.transport.comm import PeerExchange

    torch.set_num_threads(1)
    group = dist.new_group([0, 1])
    tensor, square = torch.randn(max(1, num_bytes // 4)), torch.randn(LOCKSTEP_MATMUL_SIZE, LOCKSTEP_MATMUL_SIZE)
    count = lockstep_matmuls(square, group)
    exchange = PeerExchange(rank, torch.device("cpu"), 60.0)
    communicator = GroupCommunicator(group, 2, rank, exchange=exchange)

    def matmuls() -> None:
        for _ in range(count):
            torch.mm(square, square)

    paces: dict[str, Callable[[], object]] = {"a barrier": dist.barrier, "~1.5 ms of matmuls": matmuls,
                                              "a 1.5 ms sleep": functools.partial(time.sleep, GAP_S)}
    paths: dict[str, Callable[[], object]] = {
        "dist.all_reduce": functools.partial(dist.all_reduce, tensor, group=group),
        "GroupCommunicator + PeerExchange": functools.partial(communicator.all_reduce, tensor)}
    owner, log = _Owner(), dict[tuple[str, str, str], list[Any]]()
    for index in range(num_rounds):
        heartbeat = "running" if index >= num_rounds // 2 else "absent"
        if heartbeat == "running" and exchange.failures is None:
            exchange.failures = FailureLog.for_default_group(owner, rank, world_size)
        for pace_name, pace in paces.items():
            for path_name, path in paths.items():
                entries, exits, helpers = _variant(pace, path, calls)
                runs = log.setdefault((pace_name, path_name, heartbeat), [])
                runs.append((entries[1:], exits[1:], helpers))  # the first call of a run waits for the barrier
    both: list[Any] = [None] * world_size
    dist.all_gather_object(both, log)
    if exchange.failures is not None:
        exchange.failures.stop()
    return _summary(both[0], both[1]) if rank == 0 else {}


def _summary(mine: dict[Any, Any], peer: dict[Any, Any]) -> dict[Any, dict[str, float]]:
    out = {}
    for key, runs in mine.items():
        total, waited, after = [], [], []
        for (entries, exits, _), (peer_entries, _, _) in zip(runs, peer[key], strict=True):
            for entry, leave, other in zip(entries, exits, peer_entries, strict=True):
                total.append(leave - entry)
                waited.append(max(entry, other) - entry)
                after.append(leave - max(entry, other))
        out[key] = {"call_s": statistics.median(total), "peer_wait_s": statistics.median(waited),
                    "after_both_s": statistics.median(after),
                    "helpers_cpu_s": statistics.median([helpers for _, _, helpers in runs])}
    return out


def report(result: dict[Any, dict[str, float]], args: Any) -> str:
    table = [[pace, path, heartbeat, *(f"{figures[key] * 1e3:.3f}" for key in
                                       ("call_s", "peer_wait_s", "after_both_s", "helpers_cpu_s"))]
             for (pace, path, heartbeat), figures in sorted(result.items())]
    return "\n".join([
        f"# One tensor-parallel collective's phases: {args.bytes} B all-reduces on 2 gloo CPU ranks", "",
        f"Command: `{COMMAND} --rounds {args.rounds} --calls {args.calls} --bytes {args.bytes}`", "",
        f"Machine: {machine_notes()}.", "",
        tabulate(table, ["after", "path", "heartbeat", "ms per call (median)", "waiting for the peer",
                         "after both entered", "helper threads' CPU per call"], tablefmt="github"), "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (half without the heartbeat)")
    parser.add_argument("--calls", type=int, default=30, help="calls per variant and round")
    parser.add_argument("--bytes", type=int, default=2**17, help="bytes per all-reduce")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    result = run_ranks(phases_rank, 2, args.rounds, args.calls, args.bytes)[0]
    text = report(result, args)
    print(text)
    if args.write:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
