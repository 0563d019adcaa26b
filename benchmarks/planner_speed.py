"""Planning time of the DAPPLE planner against chain length and cluster size; writes planner_speed.md.

Times are CPU seconds of this process (time.process_time), so other load on the shared machine
inflates them less than wall time; wall seconds are shown too.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tabulate import tabulate

from fxpipe.core.chain import Block, CostChain, build_chain
from fxpipe.core.cluster import compact_cluster, parse_cluster
from fxpipe.core.costgraph import Affine
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.profiles_io import read_profile


def synthetic_chain(num_blocks: int) -> CostChain:
    """A transformer-like chain: 8 MB of weights per block, uneven compute (period 7), fixed launch costs."""
    blocks = tuple(
        Block(f"b{i}", (f"n{i}",), Affine(2e-5, 1e-5 * (1 + (i % 7) / 7)), Affine(4e-5, 2e-5 * (1 + (i % 7) / 7)),
              8 * 10**6, Affine(0, 2e5))
        for i in range(num_blocks))
    return CostChain(blocks, tuple(Affine(0, 4e4) for _ in range(num_blocks - 1)), source=f"synthetic:{num_blocks}")


def measure(name: str, chain: CostChain, cluster_spec: str, batch: int) -> list[object]:
    cluster = parse_cluster(cluster_spec) if cluster_spec.startswith("dapple") else compact_cluster(
        *map(int, cluster_spec.split(":")[0].split("x")), "v100")
    cpu, wall = time.process_time(), time.perf_counter()
    plan = partition(chain, cluster, batch)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert plan.predicted is not None
    layout = plan.layout if len(plan.layout) <= 40 else plan.layout[:37] + "..."
    return [name, chain.num_blocks, cluster_spec, cluster.num_devices, batch, layout, plan.num_microbatches,
            f"{cpu:.2f}", f"{wall:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).with_name("planner_speed.md")))
    args = parser.parse_args()
    bert = build_chain(read_profile("/work/shared/profiles/bert-48-pbs-2.txt", profile_batch_size=2), max_blocks=64)
    cases = [("bert-48", bert, "dapple-a", 64), ("bert-48", bert, "dapple-b", 64)]
    for num_blocks in (16, 64, 256, 1000):
        for spec in ("2x8:v100", "16x8:v100", "128x8:v100"):
            if num_blocks < 1000 and spec == "128x8:v100" and num_blocks != 256:
                continue
            cases.append(("synthetic", synthetic_chain(num_blocks), spec, 4096))
    rows = []
    for case in cases:
        rows.append(measure(*case))
        print(rows[-1], flush=True)
    headers = ["chain", "blocks", "cluster", "devices", "GBS", "plan", "M", "CPU s", "wall s"]
    text = ["# DAPPLE planning time", "", "Command: `python benchmarks/planner_speed.py` (2-core machine shared "
            "with other jobs; CPU s = process time). Targets: BERT-48 on 16 devices < 2 s, 1,000 blocks on "
            "128 x 8 < 60 s.", "", str(tabulate(rows, headers=headers, tablefmt="github")), ""]
    Path(args.out).write_text("\n".join(text))


if __name__ == "__main__":
    main()
