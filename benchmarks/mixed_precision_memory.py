"""Peak model-state bytes of one sharded stage (3 gloo ranks, 8 Linear(512, 512) blocks: P = 8 U) per ZeRO level and
M, fp32 against bf16-params, in units U of one block's fp32 bytes (the probe of tests/fsdp_memory_probe.py).

    python benchmarks/mixed_precision_memory.py parameters,optimizer,gradients

Figures to compare with: fxpipe.sim.sharding_memory.model_state_bytes (docs/sharding.md, "Bytes per parameter").
"""

from __future__ import annotations

import copy
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fxpipe  # noqa: E402
from fxpipe.passes import trace  # noqa: E402
from tests import fsdp_memory_probe  # noqa: E402
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks  # noqa: E402

WIDTH, LAYERS, WORLD_SIZE = 512, 8, 3


def _squared_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs.float() - targets) ** 2).sum()


def measure(level: str, num_microbatches: int, mixed: bool) -> tuple[float, str]:
    """This rank's peak model-state bytes over one block's fp32 bytes, and where it fell."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))
    rows = 4 * num_microbatches
    example = (torch.randn(rows, WIDTH),)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example), (WORLD_SIZE,), rows, num_microbatches)
    dtype = torch.bfloat16 if mixed else None
    pipe = fxpipe.compile(model, example, loss_fn=_squared_error, global_batch_size=rows, plan=plan,
                          schedule="dapple", sharding=level, autocast_dtype=dtype, param_dtype=dtype)
    batch = (torch.randn(rows, WIDTH), torch.randn(rows, WIDTH))
    _, peak, where = fsdp_memory_probe.warmed_peak_model_state_bytes(pipe, batch, 1e-3)
    return peak / pipe.driver.sharded.largest_unit_bytes, where


def _rank(rank: int, world_size: int, store_dir: str, levels: list[str]) -> dict[Any, tuple[float, str]]:
    torch.set_num_threads(1)
    fsdp_memory_probe.install()
    results = {}
    for index, case in enumerate((level, m, mixed) for level in levels for m in (1, 3) for mixed in (False, True)):
        join_world(store_dir, f"case-{index}", rank, world_size)
        try:
            results[case] = measure(*case)
        finally:
            leave_world()
    return results


def main() -> None:
    levels = (sys.argv[1] if len(sys.argv) > 1 else "parameters,optimizer,gradients").split(",")
    ranks = run_ranks(_rank, WORLD_SIZE, tempfile.mkdtemp(), levels)
    for case in ranks[0]:
        level, num_microbatches, mixed = case
        figures = ", ".join(f"{record[case][0]:.2f} U at {record[case][1]}" for record in ranks)
        print(f"{level} M={num_microbatches} {'bf16-params' if mixed else 'fp32'}: {figures}")


if __name__ == "__main__":
    main()
