"""What a hand-off to a helper thread costs on CPU ranks: after compute, after a sleep, back to back; threads floating or pinned.

Run: python benchmarks/thread_handoff.py [--rounds 40] [--calls 5] [--processes 2] [--write]

A gloo collective passes control between threads several times per call (the caller posts to gloo's worker
thread, which sends and receives through the transport's loop thread, and wakes the caller). This times that
mechanism without gloo: in each of ``--processes`` processes at once (as many as the ranks of a step, 1 thread
each for torch), the main thread sets an event that a helper thread answers with another; the round trip is timed
after each pace (nothing, ~1.5 ms of 128 x 128 matmuls, 1.5 ms of spinning, a 1.5 ms sleep), the paces
interleaved round by round, with every thread of each process left to the scheduler ("floating") and with each
process's threads on a core of its own ("pinned"; benchmarks/rank_pinning.py). Medians and means over every
process's calls: the mean is what a step summing its calls pays.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import machine_notes  # noqa: E402
from benchmarks.kept_notes import write_keeping_notes  # noqa: E402
from benchmarks.rank_pinning import pin_rank  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/thread_handoff.py --write"
GAP_S = 1.5e-3


def _paces() -> dict[str, Callable[[], object]]:
    import torch

    square = torch.randn(128, 128)

    def for_gap(work: Callable[[], object]) -> Callable[[], None]:
        def paced() -> None:
            start = time.perf_counter()
            while time.perf_counter() - start < GAP_S:
                work()
        return paced

    return {"back to back": lambda: None, "~1.5 ms of matmuls": for_gap(lambda: torch.mm(square, square)),
            "1.5 ms spinning": for_gap(lambda: None), "a 1.5 ms sleep": lambda: time.sleep(GAP_S)}


def handoff_process(index: int, pin: bool, num_rounds: int, calls: int, out: Any) -> None:
    """One process's round trips per pace (seconds), put on ``out``."""
    import torch

    torch.set_num_threads(1)
    if pin:
        pin_rank(index)
    ask, answer = threading.Event(), threading.Event()

    def helper() -> None:
        while True:
            ask.wait()
            ask.clear()
            answer.set()

    threading.Thread(target=helper, daemon=True).start()
    paces = _paces()
    times: dict[str, list[float]] = {name: [] for name in paces}
    for _ in range(num_rounds):
        for name, pace in paces.items():
            for _ in range(calls):
                pace()
                start = time.perf_counter()
                ask.set()
                answer.wait()
                answer.clear()
                times[name].append(time.perf_counter() - start)
    out.put(times)


def run(num_rounds: int, calls: int, num_processes: int) -> dict[tuple[str, str], list[float]]:
    context = multiprocessing.get_context("fork")
    result: dict[tuple[str, str], list[float]] = {}
    for placement, pin in (("floating", False), ("pinned", True), ("floating", False), ("pinned", True)):
        queue = context.Queue()
        processes = [context.Process(target=handoff_process, args=(index, pin, num_rounds, calls, queue))
                     for index in range(num_processes)]
        for process in processes:
            process.start()
        for times in (queue.get() for _ in processes):
            for name, values in times.items():
                result.setdefault((name, placement), []).extend(values)
        for process in processes:
            process.join()
    return result


def report(result: dict[tuple[str, str], list[float]], args: Any) -> str:
    table = [[pace, placement, f"{statistics.median(values) * 1e6:.0f}", f"{statistics.fmean(values) * 1e6:.0f}",
              f"{max(values) * 1e3:.1f}"] for (pace, placement), values in result.items()]
    return "\n".join([
        "# A hand-off to a helper thread on CPU ranks", "",
        f"Command: `{COMMAND} --rounds {args.rounds} --calls {args.calls} --processes {args.processes}`", "",
        f"Machine: {machine_notes()}.", "",
        tabulate(table, ["after", "threads", "median us", "mean us", "max ms"], tablefmt="github"), "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds of the paces")
    parser.add_argument("--calls", type=int, default=5, help="round trips per pace and round")
    parser.add_argument("--processes", type=int, default=2, help="processes at once (a step's ranks)")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    text = report(run(args.rounds, args.calls, args.processes), args)
    print(text)
    if args.write:
        write_keeping_notes(RESULTS, text)


if __name__ == "__main__":
    main()
