"""The planner tries every micro-batch size on any cluster, down to one row per replica (issue 34, item 4)."""

from __future__ import annotations

import pytest

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import compact_cluster
from fxpipe.core.costgraph import Affine
from fxpipe.passes.partition import dapple
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import PlanRequest, microbatch_grid


def _chain(num_blocks: int, saved_bytes_per_row: float) -> CostChain:
    """Uniform blocks: 1 GB of weights each, ``saved_bytes_per_row`` activations per row, small cuts."""
    blocks = tuple(Block(f"b{i}", (f"n{i}",), Affine(1e-4, 1e-3), Affine(2e-4, 2e-3), 10**9,
                         Affine(0, saved_bytes_per_row)) for i in range(num_blocks))
    return CostChain(blocks, tuple(Affine(0, 1e6) for _ in range(num_blocks - 1)), source="uniform")


@pytest.mark.parametrize(("batch", "expected"), [
    (512, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]),  # 1 row: one row for a one-replica stage
    (4096, [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]),  # from M = 512 (MAX_MICROBATCHES) up
])
def test_grid_on_1024_devices_keeps_every_size(batch: int, expected: list[int]) -> None:
    request = PlanRequest(_chain(4, 1e6), compact_cluster(128, 8, "v100"), batch)
    assert microbatch_grid(request) == expected


def test_search_runs_every_size_on_1024_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[int] = []
    real = dapple.search

    def recording(model: object, rows: int, **options: object):  # type: ignore[no-untyped-def]
        tried.append(rows)
        return real(model, rows, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(dapple, "search", recording)
    partition(_chain(4, 1e6), compact_cluster(128, 8, "v100"), 64)
    assert tried == [1, 2, 4, 8, 16, 32, 64]  # one row per replica of a one-replica stage, up to the whole batch


def test_a_small_size_wins_on_32_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 blocks of 1 GB weights and 0.4 GB activations per row on 4x8 V100 at batch 512: 8 stages of 4 replicas
    at 4 rows per micro-batch (one row per replica, M = 128), predicted faster than the best plan among the 6
    largest sizes (the limit large clusters had before, whose smallest is 16 rows)."""
    chain, cluster = _chain(8, 4e8), compact_cluster(4, 8, "v100")
    plan = partition(chain, cluster, 512)
    real = dapple.microbatch_grid
    monkeypatch.setattr(dapple, "microbatch_grid", lambda request: real(request)[-6:])
    largest_only = partition(chain, cluster, 512)
    assert largest_only.num_microbatches <= 32
    assert plan.num_microbatches == 128 and plan.layout == "4:4:4:4:4:4:4:4"
    assert plan.predicted is not None and largest_only.predicted is not None
    assert plan.predicted.iteration_time_s < 0.9 * largest_only.predicted.iteration_time_s
