"""A plan whose planner chose to keep a ZeRO-3 stage's gathered weights from forward to backward
(``reshard_after_forward`` false, fxpipe.passes.partition.reshard_choice) trains exactly as one process on 2 gloo
ranks, gathering in forward only (M all-gathers per unit per step under GPipe, not 2M)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import fxpipe
from fxpipe import models as zoo
from tests.exactness_oracle import train_reference
from tests.mp_utils import run_ranks
from tests.test_sharded_stages import (
    GLOBAL_BATCH,
    MODEL,
    NUM_MICROBATCHES,
    _batches,
    _clipped,
    _count_fsdp_collectives,
    _train,
    _world,
)

WORLD_SIZE = 2


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    entry = zoo.get(MODEL)
    reference = train_reference(zoo.build(MODEL, **entry.tiny_overrides)[0], entry.loss_fn, _batches(),
                                after_backward=_clipped)
    _count_fsdp_collectives()
    with _world(store_dir, "kept", rank, world_size):
        model, example_inputs = zoo.build(MODEL, **entry.tiny_overrides)
        pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=GLOBAL_BATCH,
                              plan="dp", costs="analytic", cluster=f"local:{world_size}",
                              num_microbatches=NUM_MICROBATCHES, schedule="gpipe", sharding="parameters")
        record = _train(pipe, reference, MODEL)
        record.pop("optimizer")
        record["reshard"] = [stage.reshard_after_forward for stage in pipe.plan.stages]
    return record


@pytest.mark.multiprocess
def test_a_planned_kept_zero3_stage_trains_exactly_and_gathers_in_forward_only(tmp_path: Path) -> None:
    failures = []
    for rank, record in enumerate(run_ranks(_run, WORLD_SIZE, tmp_path)):
        failures += [f"rank {rank}: {problem}" for problem in record["problems"][:3]]
        if record["levels"] != ["parameters"] or record["reshard"] != [False] or not record["sharded"]:
            failures.append(f"rank {rank}: levels {record['levels']}, reshard_after_forward {record['reshard']}")
        # per unit and step: one all-gather per forward (none in backward), one reduce-scatter per backward
        if record["collectives"] != (NUM_MICROBATCHES, NUM_MICROBATCHES):
            failures.append(f"rank {rank}: (all-gathers, reduce-scatters) per unit {record['collectives']}")
    assert not failures, "\n".join(failures)
