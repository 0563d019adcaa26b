"""The free DAPPLE plan against every uniform layout a user could force, on large clusters.

Run: python benchmarks/uniform_layout_hunt.py [--seeds 0-40] [--write]

For each seed, tests/planner_cases.py's ``mixed_case`` (24-96 blocks of mixed compute, weights and activations on
3-12 hosts of 8 devices, a global batch of 64-1024) is planned freely and with every layout of S stages of N / S
replicas (``layout="w:w:...:w"``, S dividing the N devices); one row a seed. A miss is a seed whose free plan is
predicted more than 1% slower than the best forced layout, or infeasible where a forced layout fits. On these host-aligned clusters the
search runs on a coarsened chain, so its pool can miss layouts a person would try by hand (issue 34 item 4 asks
for the search at scale; passes/partition/seeds.py holds what now complements it).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from planner_cases import mixed_case  # noqa: E402

from benchmarks.bench_common import short_layout  # noqa: E402
from benchmarks.kept_notes import write_keeping_notes  # noqa: E402
from fxpipe.passes.partition.dapple import partition  # noqa: E402
from fxpipe.passes.partition.request import PlanningError  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
MARGIN = 0.01


def hunt(seed: int) -> tuple[list[str], bool]:
    """The seed's row: case, free plan and time, best forced layout and time, ratio; and whether it is a miss."""
    chain, cluster, batch = mixed_case(seed)
    start = time.process_time()
    try:
        free = partition(chain, cluster, batch)
        free_s = free.predicted.iteration_time_s if free.predicted else None
    except PlanningError:
        free, free_s = None, None
    planning_s = time.process_time() - start
    best: tuple[float, str] | None = None
    for num_stages in range(1, min(chain.num_blocks, cluster.num_devices) + 1):
        if cluster.num_devices % num_stages:
            continue
        layout = ":".join([str(cluster.num_devices // num_stages)] * num_stages)
        try:
            forced = partition(chain, cluster, batch, layout=layout)
        except PlanningError:
            continue
        if forced.predicted and (best is None or forced.predicted.iteration_time_s < best[0]):
            best = (forced.predicted.iteration_time_s, f"{num_stages} x {cluster.num_devices // num_stages}")
    miss = best is not None and (free_s is None or free_s > best[0] * (1 + MARGIN))
    row = [str(seed), f"{chain.num_blocks} blocks, {cluster.name}, "
           f"{cluster.device.memory_bytes / 2**30:.0f} GiB, batch {batch}",
           short_layout(free.layout) if free else "infeasible", f"{free_s:.4f}" if free_s else "-",
           best[1] if best else "none fits", f"{best[0]:.4f}" if best else "-",
           f"{free_s / best[0]:.3f}" if free_s and best else "-", f"{planning_s:.2f}"]
    return row, miss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-40", help="a range FIRST-STOP of mixed_case seeds")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args()
    first, stop = (int(part) for part in args.seeds.split("-"))
    rows, misses = [], []
    for seed in range(first, stop):
        row, miss = hunt(seed)
        rows.append(row)
        if miss:
            misses.append(seed)
        print(" | ".join(row), "MISS" if miss else "", flush=True)
    headers = ["seed", "case", "free plan", "free s", "best forced S x w", "forced s", "free / forced",
               "free plan CPU s"]
    text = "\n".join([
        f"# {__doc__.splitlines()[0]}", "",
        f"Command: `python benchmarks/uniform_layout_hunt.py --seeds {args.seeds} --write`", "",
        __doc__.split("\n\n", 2)[2].strip(), "",
        f"Free plan more than {MARGIN:.0%} slower than the best forced layout (or infeasible where one fits): "
        f"{len(misses)} of {len(rows)} seeds{': ' + ', '.join(map(str, misses)) if misses else ''}.", "",
        tabulate(rows, headers=headers, tablefmt="github"), ""])
    print(text)
    if args.write:
        write_keeping_notes(RESULTS, text)


if __name__ == "__main__":
    main()
