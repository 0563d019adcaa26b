"""A tied weight (tied-lm: embedding and output head share one Parameter) through save under a 1:2 layout on 3
ranks, load under 1:1 on 2 ranks, and offline consolidation: one stored tensor, the unsplit model's values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.checkpoint import read_manifest
from fxpipe.passes import trace
from fxpipe.runtime.checkpoint_io import load_checkpoint, save_checkpoint
from tests.exactness_oracle import ADAM_EPS, LEARNING_RATE, train_reference
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

MODEL = "tied-lm"
ENTRY = zoo.get(MODEL)
TIED = "embedding.weight"
BATCH = 6
NUM_STEPS = 2


def _pipe(replicas: tuple[int, ...], seed: int) -> Any:
    model, example_inputs = zoo.build(MODEL, seed=seed, **ENTRY.tiny_overrides)
    plan = plan_from_cuts(trace(model, example_inputs), replicas, BATCH, 2)
    return fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan=plan)


def _batches() -> list[Any]:
    return [ENTRY.make_batch(BATCH, step, **ENTRY.tiny_overrides) for step in range(NUM_STEPS)]


def _save(rank: int, world_size: int, store_dir: str, directory: str) -> dict[str, Any]:
    join_world(store_dir, "tied-save", rank, world_size)
    try:
        pipe = _pipe((1, 2), seed=0)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
        for inputs, targets in _batches():
            pipe.step(inputs, targets)
            optimizer.step()
            optimizer.zero_grad()
        save_checkpoint(pipe, directory, optimizer=optimizer, step=NUM_STEPS)
        return {"tied": pipe.state_dict()[TIED].numpy().copy()}
    finally:
        leave_world()


def _load(rank: int, world_size: int, store_dir: str, directory: str) -> dict[str, Any]:
    join_world(store_dir, "tied-load", rank, world_size)
    try:
        pipe = _pipe((1, 1), seed=5)  # other initial weights: the checkpoint must overwrite both copies
        info = load_checkpoint(pipe, directory, optimizer=torch.optim.AdamW(pipe.parameters()))
        return {"step": info["step"], "tied": pipe.state_dict()[TIED].numpy().copy(),
                "names": sorted(pipe.state_dict())}
    finally:
        leave_world()


def test_tied_weight_saves_reshards_and_consolidates(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    model, _ = zoo.build(MODEL, seed=0, **ENTRY.tiny_overrides)
    assert model.state_dict().keys() == {name for name, _ in model.named_parameters()}  # one name for the tie
    expected = train_reference(model, ENTRY.loss_fn, _batches())["params"][TIED]

    saved = run_ranks(_save, 3, tmp_path, str(directory))
    for result in saved:  # every rank holds the tie (stage 0 reads it, stage 1's replicas too)
        torch.testing.assert_close(torch.from_numpy(result["tied"]), expected, rtol=1e-5, atol=1e-6)

    manifest = read_manifest(directory)
    assert manifest["state_dict_keys"][TIED] in manifest["fingerprint"]
    tied_entries = [name for name in manifest["fingerprint"] if "embedding" in name]
    assert tied_entries == [manifest["state_dict_keys"][TIED]]  # stored once, not once per stage

    loaded = run_ranks(_load, 2, tmp_path, str(directory))
    assert sorted({name for result in loaded for name in result["names"]}) == sorted(model.state_dict())
    for result in loaded:  # each stage's rank holds the tie under its one name, with the trained values
        assert result["step"] == NUM_STEPS and TIED in result["names"]
        torch.testing.assert_close(torch.from_numpy(result["tied"]), expected, rtol=1e-5, atol=1e-6)

    consolidated = fxpipe.consolidate(directory)
    assert sorted(consolidated) == sorted(model.state_dict())
    torch.testing.assert_close(consolidated[TIED], expected, rtol=1e-5, atol=1e-6)
    unsplit, _ = zoo.build(MODEL, seed=9, **ENTRY.tiny_overrides)
    unsplit.load_state_dict(consolidated, strict=True)
    assert torch.equal(unsplit.embedding.weight, consolidated[TIED])  # the head reads the same Parameter
