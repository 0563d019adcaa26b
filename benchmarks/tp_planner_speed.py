"""Planning time with tensor-parallel blocks: an 80-layer 70B-like chain on 2x8, 8x8 and 96x8 H100; writes
tp_planner_speed.md (the DAPPLE plan, its prediction, the megatron grid's best, CPU and wall seconds)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from tabulate import tabulate

from fxpipe.core.chain import Block, BlockTensorParallel, CostChain
from fxpipe.core.cluster import compact_cluster
from fxpipe.core.costgraph import Affine
from fxpipe.passes.partition.dapple import partition

HIDDEN, SEQUENCE = 8192, 4096
LAYER_PARAMS = 0.856e9  # Llama-3 70B: 80 layers of about 0.86 B parameters


def tensor_parallel_chain(num_blocks: int) -> CostChain:
    """One 70B-like layer per block, per sequence of 4,096 tokens: 7.6 TFLOP forward at ~600 TFLOP/s (12.6 ms,
    backward twice that), fp32 weights, 34 x s x h bytes saved (Megatron's count with flash attention), two
    collective points of s x h bf16 values; 97% of the time, all weights but norms and 95% of the saved bytes
    split, 8 heads of kv (divisor 8). Illustrative figures for timing the planner, not a calibrated model."""
    activation = SEQUENCE * HIDDEN * 2
    split = BlockTensorParallel(0.97, int(LAYER_PARAMS * 4 * 0.999), 0.95, Affine(0, 2 * activation), 8)
    blocks = tuple(Block(f"layer{i}", (f"n{i}",), Affine(2e-4, 12.6e-3), Affine(4e-4, 25.2e-3), int(LAYER_PARAMS * 4),
                         Affine(0, 34 * SEQUENCE * HIDDEN), tp=split) for i in range(num_blocks))
    return CostChain(blocks, tuple(Affine(0, activation) for _ in range(num_blocks - 1)), source="tp-70b-like")


CASES = [(2, 80, 64), (8, 80, 384), (96, 80, 384)]


def measure(num_hosts: int, num_blocks: int, batch: int) -> list[object]:
    cluster, chain = compact_cluster(num_hosts, 8, "h100"), tensor_parallel_chain(num_blocks)
    cpu, wall = time.process_time(), time.perf_counter()
    plan = partition(chain, cluster, batch)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    grid = partition(chain, cluster, batch, planner="megatron")
    assert plan.predicted is not None and grid.predicted is not None
    return [f"{num_hosts}x8:h100", num_blocks, batch, plan.layout, plan.num_microbatches,
            round(plan.predicted.iteration_time_s, 3), grid.layout, round(grid.predicted.iteration_time_s, 3),
            round(cpu, 2), round(wall, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).with_name("tp_planner_speed.md")))
    args = parser.parse_args()
    rows = []
    for case in CASES:
        rows.append(measure(*case))
        print(rows[-1], flush=True)
    headers = ["cluster", "blocks", "GBS", "dapple plan", "M", "predicted s", "megatron grid", "grid s", "CPU s",
               "wall s"]
    text = ["# Planning time with tensor-parallel blocks", "",
            "Command: `python benchmarks/tp_planner_speed.py` (2-core machine shared with other jobs; CPU s = process "
            "time of the DAPPLE planning alone). Target (issue 33): 96 x 8 H100 and 80 blocks in well under 60 s.", "",
            f"1-minute load average at the end of the run: {os.getloadavg()[0]:.1f} on 2 cores.", "",
            tabulate(rows, headers=headers, tablefmt="github"), ""]
    Path(args.out).write_text("\n".join(text))


if __name__ == "__main__":
    main()
