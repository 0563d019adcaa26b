"""``2x2:2x2`` on one 8-rank gloo world against one process: sequence shards crossing between two tensor-parallel
stages with replicas, and ZeRO inside each 2x2 group (over each member's replicas), with and without per-block
recompute."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.mp_utils import run_ranks
from tests.test_block_recompute_coverage import (
    check_cases,
    layout_of,
    recomputing_plan,
    references_for,
    run_cases,
)

WORLD_SIZE = 8
# (name, model, layout, sharding, sequence_parallel, torch_compile); names with "recompute" recompute per block
CASES: tuple[tuple[str, str, str, str, bool, Any], ...] = (
    ("2x2:2x2 SP", "tiny", "2x2:2x2", "none", True, False),
    ("2x2:2x2 ZeRO-2 SP llama", "llama", "2x2:2x2", "gradients", True, False),
    ("2x2:2x2 ZeRO-3 recompute", "tiny", "2x2:2x2", "parameters", False, False),
)


@pytest.mark.multiprocess
def test_two_tensor_parallel_stages_with_replicas_train_as_one_process_on_eight_ranks(tmp_path: Path) -> None:
    plans = {name: recomputing_plan(model, layout, sharding, WORLD_SIZE, per_block="recompute" in name)
             for name, model, layout, sharding, _, _ in CASES}
    assert all(layout_of(plans[name]) == layout and {s.sharding for s in plans[name].stages} == {sharding}
               for name, _, layout, sharding, _, _ in CASES), plans
    references = references_for(CASES)
    started = time.perf_counter()
    per_rank = run_ranks(run_cases, WORLD_SIZE, tmp_path, CASES, plans, references, timeout_s=400.0)
    print(f"8 ranks, {len(CASES)} cases: {time.perf_counter() - started:.1f} s")
    check_cases(CASES, plans, per_rank)
