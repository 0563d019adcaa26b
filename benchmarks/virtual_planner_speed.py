"""What choosing virtual stages costs the planner: the same requests with virtual_stages 1, "auto" and 2.

Run: python benchmarks/virtual_planner_speed.py --write   (writes benchmarks/virtual_planner_speed.md; the 13B
chain is traced and costed once on the meta device, analytic H100 costs in bf16, 64 blocks at most)

Each row plans one (cluster, global batch) three times: virtual_stages=1 (the default: no virtual search runs),
"auto" (one stage per group, or the fastest virtual plan found: the plain plan's groups and even groups of
contiguous devices, v = 2, 4, 8, every virtual schedule under schedule="auto", micro-batch counts near the plain
plan's) and 2 (interleaved only). CPU s is process time, wall s the elapsed time, on a shared machine.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

from tabulate import tabulate

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import parse_cluster
from fxpipe.passes.partition.request import PlanningError
from fxpipe.planning import costed_model, plan_chain

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/virtual_planner_speed.py --write"
MODEL = "gpt3-13b"
CASES = (("4x8:h100", 256), ("128x8:h100", 2048))


def chain_of(model_name: str, cache: Path | None) -> CostChain:
    if cache is not None and cache.exists():
        return pickle.loads(cache.read_bytes())  # type: ignore[no-any-return]
    from fxpipe import models

    model, example_inputs = models.build(model_name, device="meta")
    chain = costed_model(model, example_inputs, parse_cluster("4x8:h100"), costs="analytic", max_blocks=64,
                         precision="bf16").chain
    if cache is not None:
        cache.write_bytes(pickle.dumps(chain))
    return chain


def timed(chain: CostChain, cluster_name: str, batch: int, schedule: str, virtual_stages: int | str) -> list[object]:
    cluster = parse_cluster(cluster_name)
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        plan = plan_chain(chain, cluster, batch, schedule=schedule, virtual_stages=virtual_stages, precision="bf16")
        assert plan.predicted is not None
        found = [plan.layout if len(plan.layout) <= 40 else plan.layout[:37] + "...", plan.virtual_stages,
                 plan.schedule, plan.num_microbatches, f"{plan.predicted.iteration_time_s:.3f}"]
    except PlanningError as error:
        found = [f"infeasible: {str(error).splitlines()[0][:60]}", "-", "-", "-", "-"]
    return [cluster_name, cluster.num_devices, batch, schedule, virtual_stages, *found,
            f"{time.process_time() - cpu:.2f}", f"{time.perf_counter() - wall:.2f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    parser.add_argument("--cache", type=Path, default=None, help="pickle the costed chain here (reused if present)")
    args = parser.parse_args()
    chain = chain_of(MODEL, args.cache)
    rows = []
    for cluster_name, batch in CASES:
        for schedule, virtual_stages in (("early_backward", 1), ("early_backward", "auto"), ("auto", "auto"),
                                         ("early_backward", 2)):
            rows.append(timed(chain, cluster_name, batch, schedule, virtual_stages))
            print(rows[-1], flush=True)
    table = tabulate(rows, headers=["cluster", "devices", "GBS", "schedule", "virtual_stages", "plan", "v",
                                    "chosen schedule", "M", "iteration s", "CPU s", "wall s"], tablefmt="github")
    print(table)
    if args.write:
        RESULTS.write_text(f"# Planner time with virtual stages\n\nCommand: `{COMMAND}` ({MODEL}, {chain.num_blocks} "
                           f"blocks, analytic bf16 costs; a 2-core machine shared with other jobs).\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
