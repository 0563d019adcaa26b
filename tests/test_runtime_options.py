"""compile() options on 2 gloo ranks, in one spawn: sync_params="off", check_batch "always"/"first"/"off", and a
schedule override on a given multi-stage plan, each against one process on the whole batch."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from fxpipe.runtime.transport.batchcheck import BatchMismatchError
from tests.exactness_oracle import train_reference
from tests.mp_utils import plan_from_cuts, run_ranks, run_scenarios

pytestmark = pytest.mark.multiprocess

MODEL = "mlp"
ENTRY = zoo.get(MODEL)
GLOBAL_BATCH = 8
NUM_STEPS = 3


def _model(seed: int) -> tuple[torch.nn.Module, Any]:
    return zoo.build(MODEL, seed=seed, **ENTRY.tiny_overrides)


def _batches() -> list[Any]:
    return [ENTRY.make_batch(GLOBAL_BATCH, step, **ENTRY.tiny_overrides) for step in range(NUM_STEPS)]


def _compile(seed: int, replicas: tuple[int, ...], **options: Any) -> Any:
    """The tiny model from ``seed`` under an early_backward plan cut into ``len(replicas)`` stages."""
    model, example_inputs = _model(seed)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), replicas, GLOBAL_BATCH, 2)
    return fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=GLOBAL_BATCH, plan=plan,
                          **options)


def _train(pipe: Any, batches: list[Any]) -> list[float]:
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    losses = []
    for inputs, targets in batches:
        losses.append(pipe.step(inputs, targets))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _numpy_state(pipe: Any) -> dict[str, Any]:
    return {name: tensor.detach().numpy().copy() for name, tensor in pipe.state_dict().items()}


def _schedule_override() -> dict[str, Any]:
    pipe = _compile(0, (1, 1), schedule="gpipe")
    return {"schedule": pipe.plan.schedule, "given": "early_backward", "losses": _train(pipe, _batches())}


def _sync_off(rank: int) -> dict[str, Any]:
    """Two data-parallel replicas built from different seeds: with sync_params="off" each keeps its own."""
    pipe = _compile(rank, (2,), sync_params="off")
    return {"state": _numpy_state(pipe)}


def _check_batch(rank: int, mode: str) -> dict[str, Any]:
    """Steps 0-1 see the same batch on both ranks; step 2 gives rank 1 other inputs (which stage 1 never reads)."""
    pipe = _compile(0, (1, 1), check_batch=mode)
    batches = _batches()
    if rank == 1:
        inputs, targets = batches[2]
        batches[2] = (tuple(value + 1.0 for value in inputs), targets)
    try:
        return {"losses": _train(pipe, batches), "error": ""}
    except BatchMismatchError as error:
        return {"losses": None, "error": str(error)}


def _off_at_first_step(rank: int) -> dict[str, Any]:
    """check_batch="off": rank 1's other inputs on step 0 are not fingerprinted, so the step runs."""
    pipe = _compile(0, (1, 1), check_batch="off")
    inputs, targets = _batches()[0]
    if rank == 1:
        inputs = tuple(value + 1.0 for value in inputs)
    return {"loss": pipe.step(inputs, targets)}


def _scenarios(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    return run_scenarios({
        "schedule": _schedule_override,
        "sync_off": lambda: _sync_off(rank),
        "always": lambda: _check_batch(rank, "always"),
        "first": lambda: _check_batch(rank, "first"),
        "off": lambda: _off_at_first_step(rank),
    }, rank, world_size, store_dir, "options")


def test_sync_off_check_batch_modes_and_schedule_override(tmp_path: Any) -> None:
    results = run_ranks(_scenarios, 2, tmp_path)
    reference = train_reference(_model(0)[0], ENTRY.loss_fn, _batches())
    expected = pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)

    for result in results:  # the override wins over the plan's schedule, and trains exactly
        assert result["schedule"]["schedule"] == "gpipe"
        assert result["schedule"]["losses"] == expected

    for rank, result in enumerate(results):  # no broadcast: each replica still holds its own seed's weights
        own = _model(rank)[0].state_dict()
        state = result["sync_off"]["state"]
        assert sorted(state) == sorted(own)
        for name, value in state.items():
            assert torch.equal(torch.from_numpy(value), own[name]), (rank, name)
    assert any(not torch.equal(_model(0)[0].state_dict()[name], _model(1)[0].state_dict()[name])
               for name in _model(0)[0].state_dict())  # else the check above could not tell

    for result in results:  # "always" fingerprints step 2 and fails on every rank; "first" stopped after step 1
        assert result["always"]["losses"] is None
        assert result["always"]["error"], result["always"]
        assert result["first"]["error"] == ""
        assert result["first"]["losses"] == expected  # stage 1 never reads the inputs that differ
    eager_loss = reference["losses"][0]
    assert results[0]["off"]["loss"] == pytest.approx(eager_loss, rel=1e-5)
    assert results[1]["off"]["loss"] == results[0]["off"]["loss"]
