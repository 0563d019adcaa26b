"""Checkpoints: exact resume in fresh processes, resharding to other plans, consolidation, interrupted writes."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.checkpoint import MANIFEST_NAME, CheckpointError, latest_checkpoint, read_manifest
from fxpipe.passes import trace
from fxpipe.runtime.checkpoint_io import SafeFileSystemReader, load_checkpoint, save_checkpoint
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

ENTRY = zoo.get("mlp")
BATCH = 8
NUM_STEPS = 6


def _pipe(replicas: tuple[int, ...], seed: int = 0, model: str = "mlp") -> Any:
    entry = zoo.get(model)
    built, example_inputs = zoo.build(model, seed=seed, **entry.tiny_overrides)
    plan = plan_from_cuts(trace(built, example_inputs), replicas, BATCH, 2)
    return fxpipe.compile(built, example_inputs, loss_fn=entry.loss_fn, global_batch_size=BATCH, plan=plan)


def _train(pipe: Any, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = ENTRY.make_batch(BATCH, step, **ENTRY.tiny_overrides)
        losses.append(pipe.step(inputs, targets))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _state(pipe: Any) -> dict[str, Any]:
    """Numpy copies: tensors sent through a multiprocessing queue would share memory with an exited process."""
    return {name: tensor.numpy().copy() for name, tensor in pipe.state_dict().items()}


def _straight(rank: int, world_size: int, store_dir: str, root: str) -> dict[str, Any]:
    """1:1 plan, six steps; saves after step 3 (saving must not disturb training)."""
    join_world(store_dir, "straight", rank, world_size)
    try:
        pipe = _pipe((1, 1))
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        losses = _train(pipe, optimizer, range(3))
        save_checkpoint(pipe, Path(root) / "step-3", optimizer=optimizer, step=3, extra={"note": "half"})
        losses += _train(pipe, optimizer, range(3, NUM_STEPS))
        return {"losses": losses, "state": _state(pipe)}
    finally:
        leave_world()


def _resumed(rank: int, world_size: int, store_dir: str, root: str, replicas: tuple[int, ...],
             save_to: str | None) -> dict[str, Any]:
    """Fresh processes, other initial weights: load the step-3 checkpoint and train to the end."""
    join_world(store_dir, f"resume-{replicas}", rank, world_size)
    try:
        pipe = _pipe(replicas, seed=7)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.5)  # the checkpoint's lr must win
        found = latest_checkpoint(root)
        assert found is not None
        info = load_checkpoint(pipe, found, optimizer=optimizer)
        loaded = _state(pipe)
        losses = _train(pipe, optimizer, range(info["step"], NUM_STEPS))
        if save_to is not None:
            save_checkpoint(pipe, save_to, optimizer=optimizer, step=NUM_STEPS)
        return {"info": info, "loaded": loaded, "losses": losses, "state": _state(pipe),
                "lr": optimizer.param_groups[0]["lr"]}
    finally:
        leave_world()


def _reload(rank: int, world_size: int, store_dir: str, directory: str) -> dict[str, Any]:
    """Load a 2:2 checkpoint under a pure data-parallel plan; a wrong model must be refused by name."""
    join_world(store_dir, "reload", rank, world_size)
    try:
        pipe = _pipe((world_size,), seed=3)
        optimizer = torch.optim.AdamW(pipe.parameters())
        info = load_checkpoint(pipe, directory, optimizer=optimizer)
        other = _pipe((world_size,), model="tied-lm")
        try:
            load_checkpoint(other, directory)
            error = ""
        except CheckpointError as caught:
            error = str(caught)
        return {"info": info, "state": _state(pipe), "error": error}
    finally:
        leave_world()


def _gathered(results: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(_tensors(result[key]))
    return merged


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in state.items()}


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                  tolerance: tuple[float, float] | None = None) -> None:
    """Bit-identical, or close within (rtol, atol) when given."""
    assert sorted(actual) == sorted(expected)
    for name in expected:
        if tolerance is not None:
            torch.testing.assert_close(actual[name], expected[name], rtol=tolerance[0], atol=tolerance[1])
        else:
            assert torch.equal(actual[name], expected[name]), name


def test_resume_reshard_and_consolidate(tmp_path: Path) -> None:
    root, resharded = tmp_path / "run", tmp_path / "resharded"
    straight = run_ranks(_straight, 2, tmp_path, str(root))
    resumed = run_ranks(_resumed, 2, tmp_path, str(root), (1, 1), None)
    assert resumed[0]["info"] == {"step": 3, "extra": {"note": "half"}} and resumed[0]["lr"] == 1e-2
    for before, after in zip(straight, resumed, strict=True):  # bit-identical resume
        assert after["losses"] == before["losses"][3:]
        _assert_equal(_tensors(after["state"]), _tensors(before["state"]))
    final = _gathered(straight, "state")

    four = run_ranks(_resumed, 4, tmp_path, str(root), (2, 2), str(resharded))  # 1:1 -> 2:2
    with torch.no_grad():
        reference, _ = zoo.build("mlp", **ENTRY.tiny_overrides)
    _assert_equal(_gathered(four, "state"), final, (1e-5, 1e-6))
    assert four[0]["losses"] == pytest.approx(straight[0]["losses"][3:], rel=1e-5)

    consolidated = fxpipe.consolidate(resharded)
    reference.load_state_dict(consolidated, strict=True)
    _assert_equal(dict(reference.state_dict()), _gathered(four, "state"))

    reloaded = run_ranks(_reload, 2, tmp_path, str(resharded))  # 2:2 -> dp on 2 ranks
    for result in reloaded:
        assert result["info"]["step"] == NUM_STEPS
        _assert_equal(_tensors(result["state"]), consolidated)
        error = result["error"]
        assert "from another model" in error and "missing keys [blocks.0." in error, error
        assert "unexpected keys [layers.0.bias, layers.0.weight" in error, error


def _save_at_step_5(rank: int, world_size: int, store_dir: str, directory: str) -> None:
    join_world(store_dir, "one", rank, world_size)
    try:
        save_checkpoint(_pipe((1,)), directory, step=5)
    finally:
        leave_world()


def _complete_checkpoint(tmp_path: Path) -> Path:
    directory = tmp_path / "root" / "step-5"
    run_ranks(_save_at_step_5, 1, tmp_path, str(directory))  # module level: picklable where ranks are spawned
    return directory


def test_interrupted_writes_are_never_loaded(tmp_path: Path) -> None:
    complete = _complete_checkpoint(tmp_path)
    root = complete.parent
    assert latest_checkpoint(root) == complete and read_manifest(complete)["step"] == 5
    no_manifest = root / "step-9"
    shutil.copytree(complete, no_manifest)
    (no_manifest / MANIFEST_NAME).unlink()
    shutil.copytree(complete, root / "step-12.tmp-0123")  # renamed only after the manifest is written
    lost_data = root / "step-10"
    shutil.copytree(complete, lost_data)
    next(lost_data.glob("*.distcp")).unlink()
    assert latest_checkpoint(root) == complete
    with pytest.raises(CheckpointError, match=f"{MANIFEST_NAME} is missing"):
        fxpipe.consolidate(no_manifest)
    with pytest.raises(CheckpointError, match=r"files \[.*distcp.*\] named by"):
        fxpipe.consolidate(lost_data)
    assert latest_checkpoint(tmp_path / "nothing-here") is None


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("code ran from a checkpoint",))


def test_metadata_naming_code_is_refused(tmp_path: Path) -> None:
    complete = _complete_checkpoint(tmp_path)
    (complete / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CheckpointError, match="builtins.print"):
        SafeFileSystemReader(complete).read_metadata()
    with pytest.raises(CheckpointError, match=r"'\.metadata' \(written by rank 0\) has \d+ bytes"):
        fxpipe.consolidate(complete)  # the checksum check comes first
    with pytest.raises(CheckpointError, match="builtins.print"):  # and the allow-list holds without it
        fxpipe.consolidate(complete, verify=False)
