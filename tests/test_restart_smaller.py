"""A job that lost a rank comes back on fewer ranks: the plan is made again and the checkpoint resharded (issue 26 item 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.checkpoint import latest_checkpoint
from fxpipe.passes import trace
from tests.mp_utils import eager_weights, join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

ENTRY = zoo.get("mlp")
BATCH = 8
SAVED_AT = 3
NUM_STEPS = 6
LR = 1e-2


def _train(pipe: Any, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        inputs, targets = ENTRY.make_batch(BATCH, step, **ENTRY.tiny_overrides)
        pipe.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()


def _four_ranks_hybrid(rank: int, world_size: int, store_dir: str, root: str) -> None:
    """The first attempt: a 2:1:1 plan on 4 ranks, saving after step SAVED_AT (then it 'loses a rank')."""
    join_world(store_dir, "four", rank, world_size)
    try:
        model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
        plan = plan_from_cuts(trace(model, example_inputs), (2, 1, 1), BATCH, 2)
        pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan=plan)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
        _train(pipe, optimizer, range(SAVED_AT))
        pipe.save(Path(root) / f"step-{SAVED_AT:06d}", optimizer=optimizer, step=SAVED_AT)
    finally:
        leave_world()


def _three_ranks_auto(rank: int, world_size: int, store_dir: str, root: str) -> dict[str, Any]:
    """The restart on 3 ranks: plan='auto' plans for the ranks there are; the 4-rank checkpoint loads by name."""
    join_world(store_dir, "three", rank, world_size)
    try:
        model, example_inputs = zoo.build("mlp", seed=11, **ENTRY.tiny_overrides)  # other weights: the load must win
        pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan="auto",
                              costs="analytic")
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LR)
        found = latest_checkpoint(root)
        assert found is not None
        start = pipe.load(found, optimizer=optimizer)["step"]
        _train(pipe, optimizer, range(start, NUM_STEPS))
        state = {name: tensor.numpy().copy() for name, tensor in pipe.state_dict().items()}
        return {"start": start, "layout": pipe.plan.layout, "devices": pipe.plan.all_devices(), "state": state}
    finally:
        leave_world()


def test_a_four_rank_hybrid_job_resumes_on_three_ranks_at_the_single_process_weights(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    run_ranks(_four_ranks_hybrid, 4, tmp_path, str(root))
    results = run_ranks(_three_ranks_auto, 3, tmp_path, str(root))
    assert all(result["start"] == SAVED_AT for result in results)
    assert results[0]["devices"] == [0, 1, 2], results[0]["layout"]
    final: dict[str, torch.Tensor] = {}
    for result in results:
        final.update({name: torch.from_numpy(array) for name, array in result["state"].items()})
    expected = eager_weights("mlp", NUM_STEPS, BATCH, LR)
    assert sorted(final) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)
