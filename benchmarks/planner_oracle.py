"""DAPPLE vs the exhaustive planner on random small chains, both with the planner's default buckets, each
plan re-scored by the independent reference simulator (tests/reference_sim.py), and on cases up to 5 blocks x
4 devices also vs the test-owned brute force (tests/reference_planner.py), which shares no scoring with the
planner; writes planner_oracle.md."""

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
from reference_planner import best_plan  # noqa: E402
from reference_sim import reference_run  # noqa: E402

BRUTE_FORCE_BLOCKS, BRUTE_FORCE_DEVICES = 5, 4  # the independent brute force stays quick up to here


def compare(seed: int) -> tuple[float, float, float, float | None] | None:
    """(gap of dapple over exhaustive, dapple planning s, exhaustive planning s, gap of dapple over the
    independent brute force or None where the case is too large for it); None if nothing fits."""
    chain, cluster, batch = random_case(seed)
    try:
        best = partition(chain, cluster, batch, planner="exhaustive")
    except PlanningError:
        return None
    plan = partition(chain, cluster, batch, planner="dapple")
    assert plan.predicted is not None and best.predicted is not None
    for checked in (plan, best):  # predictions agree with the independent reference simulator
        reference = reference_run(checked, chain, cluster).iteration_time_s
        assert abs(reference / checked.predicted.iteration_time_s - 1) < 1e-9, (seed, checked.planner)
    gap = plan.predicted.iteration_time_s / best.predicted.iteration_time_s - 1.0
    independent = None
    if chain.num_blocks <= BRUTE_FORCE_BLOCKS and cluster.num_devices <= BRUTE_FORCE_DEVICES:
        oracle = best_plan(chain, cluster, batch)
        assert oracle is not None, f"seed {seed}: the planners found a plan, the brute force none"
        independent = plan.predicted.iteration_time_s / oracle[0] - 1.0
    return gap, plan.planning_time_s, best.planning_time_s, independent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--out", default=str(Path(__file__).with_name("planner_oracle.md")))
    args = parser.parse_args()
    start = time.perf_counter()
    gaps, worst_seed, times, independent = [], -1, [], []
    skipped = 0
    for seed in range(args.cases):
        result = compare(seed)
        if result is None:
            skipped += 1
            continue
        gaps.append(result[0])
        times.append(result[1])
        if result[3] is not None:
            independent.append(result[3])
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
        "- every plan's predicted time equals the independent reference simulator's (tests/reference_sim.py)",
        f"- vs the independent brute force (tests/reference_planner.py, cases up to {BRUTE_FORCE_BLOCKS} blocks x "
        f"{BRUTE_FORCE_DEVICES} devices): {len(independent)} cases, mean gap "
        f"{100 * statistics.mean(independent):.3f}%, worst {100 * max(independent):.3f}%",
        f"- dapple planning time: mean {statistics.mean(times):.3f} s, max {max(times):.3f} s",
        f"- total wall time: {time.perf_counter() - start:.0f} s",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
