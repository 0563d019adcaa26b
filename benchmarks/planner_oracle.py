"""DAPPLE vs the exhaustive planner under the simulator on random small chains; writes planner_oracle.md."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import PlanningError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from planner_cases import random_case  # noqa: E402


def compare(seed: int) -> tuple[float, float, float] | None:
    """(gap of dapple over exhaustive, dapple planning s, exhaustive planning s); None if nothing fits."""
    chain, cluster, batch = random_case(seed)
    try:
        best = partition(chain, cluster, batch, planner="exhaustive")
    except PlanningError:
        return None
    plan = partition(chain, cluster, batch, planner="dapple")
    assert plan.predicted is not None and best.predicted is not None
    gap = plan.predicted.iteration_time_s / best.predicted.iteration_time_s - 1.0
    return gap, plan.planning_time_s, best.planning_time_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).with_name("planner_oracle.md")))
    args = parser.parse_args()
    start = time.perf_counter()
    gaps, worst_seed, times = [], -1, []
    skipped = 0
    for seed in range(args.cases):
        result = compare(seed)
        if result is None:
            skipped += 1
            continue
        gaps.append(result[0])
        times.append(result[1])
        if result[0] >= max(gaps):
            worst_seed = seed
    lines = [
        "# DAPPLE vs exhaustive search (simulated iteration time)",
        "",
        f"Command: `python benchmarks/planner_oracle.py --cases {args.cases}`",
        "",
        f"- cases: {len(gaps)} compared, {skipped} where no plan fits in memory (both planners agree: infeasible)",
        f"- mean gap: {100 * statistics.mean(gaps):.3f}%",
        f"- worst gap: {100 * max(gaps):.3f}% (seed {worst_seed})",
        f"- cases with gap > 3%: {sum(g > 0.03 for g in gaps)}",
        f"- dapple planning time: mean {statistics.mean(times):.3f} s, max {max(times):.3f} s",
        f"- total wall time: {time.perf_counter() - start:.0f} s",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
