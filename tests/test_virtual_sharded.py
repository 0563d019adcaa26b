"""Sharded chunks on virtual stages (fxpipe.runtime.execution.virtual_sharding): the 2:1:1 device groups with 2 chunks each
on 4 gloo ranks, group 0's chunks sharded over its 2 replicas at ZeRO-1, 2 or 3, train exactly as one process under
interleaved 1F1B, interleaved zero-bubble and ZB-V (the tied embedding included), and evaluate; ZeRO-3 under a split
backward stays refused."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from fxpipe import models as zoo
from fxpipe.core.plan import Plan
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.parallel.sharded_stage import full_value
from tests.exactness_oracle import LEARNING_RATE, _call, mismatches, train_reference
from tests.mp_utils import run_ranks
from tests.test_virtual_runtime import (
    LM,
    MAX_NORM,
    WORLD_SIZE,
    _batches,
    _build,
    _clipped,
    _compile,
    _in_world,
    virtual_plan,
)

COMPILED = {"torch_compile": {"backend": "aot_eager"}}
# (name, model, schedule, micro-batches, level of the replicated group's chunks, compile options)
CASES: tuple[tuple[str, str, str, int, str, dict[str, Any]], ...] = (
    ("lm interleaved zero3", LM, "interleaved", 4, "parameters", {}),
    ("lm zbv zero1", LM, "zbv", 3, "optimizer", {}),
    ("mlp interleaved zero1", "mlp", "interleaved", 6, "optimizer", {}),
    ("mlp interleaved_zero_bubble zero2", "mlp", "interleaved_zero_bubble", 3, "gradients", {}),
    ("mlp zbv zero1 compiled", "mlp", "zbv", 3, "optimizer", COMPILED),
)


def sharded_plan(model: str, schedule: str, num_microbatches: int, level: str) -> Plan:
    """The test's 2:1:1 plan with the two-replica group's chunks sharded at ``level``."""
    plan = virtual_plan(model, schedule, num_microbatches)
    return plan.with_updates(stages=tuple(replace(s, sharding=level) if s.replicas > 1 else s for s in plan.stages))


def _whole(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Whole tensors by name (a DTensor gathered: every replica of its chunk walks the same names in order)."""
    return {name: full_value(t) for name, t in sorted(tensors.items()) if t is not None}


def _exact(model: str, schedule: str, num_microbatches: int, level: str, options: dict[str, Any],
           reference: dict[str, Any]) -> dict[str, Any]:
    pipe = _compile(model, sharded_plan(model, schedule, num_microbatches, level), **options)
    sharded = sorted(name for name, p in pipe.named_parameters() if isinstance(p, DTensor))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE)
    losses, problems, norms = [], [], []
    for step, (inputs, targets) in enumerate(_batches(model)):
        losses.append(pipe.step(inputs, targets))
        norms.append(float(pipe.clip_grad_norm_(MAX_NORM)))  # the shards' rows counted once each
        grads = _whole({name: p.grad for name, p in pipe.named_parameters()})
        tolerance = {"rtol": 1e-4, "atol": 1e-6} if step == 0 else {"rtol": 1e-3, "atol": 1e-6, "atol_of_largest": 1e-3}
        problems += mismatches(f"step {step} grad", grads, reference["grads_per_step"][step], **tolerance)
        optimizer.step()
        optimizer.zero_grad()
    params = {name: t for name, t in pipe.state_dict().items() if name in reference["params"]}  # gathered
    problems += mismatches("param", params, reference["params"], rtol=0.0, atol=1e-4)
    inputs, targets = _batches(model, 1, seed=900)[0]
    with torch.no_grad():
        expected = float(zoo.get(model).loss_fn(_call(reference["model"], inputs), targets))
    compiled = [chunk for chunk, runner in pipe.driver.runners.items() if runner.compiled is not None]
    return {"compiled": compiled, "losses": losses, "reference_losses": reference["losses"], "problems": problems, "norms": norms,
            "reference_norms": reference["after_backward"], "sharded": sharded, "chunks": list(pipe.driver.chunks),
            "evaluated": pipe.evaluate(inputs, targets), "expected_loss": expected,
            "shard_state": [tuple(s.shape) for s in optimizer.state_dict()["state"].get(0, {}).values()
                            if isinstance(s, torch.Tensor) and s.dim() > 0]}


def _checkpoints(rank: int, store_dir: str, directory: str) -> dict[str, Any]:
    """Train 2 steps with group 0's chunks at ZeRO-1 under zbv and save; load into unsharded and ZeRO-3 chunks
    (interleaved), then train one more step on each: the same weights before and after (optimizer state too)."""
    def train(pipe: Any, optimizer: Any, batches: list[Any]) -> None:
        for inputs, targets in batches:
            pipe.step(inputs, targets)
            optimizer.step()
            optimizer.zero_grad()

    def save() -> dict[str, Any]:
        pipe = _compile(LM, sharded_plan(LM, "zbv", 3, "optimizer"))
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE)
        train(pipe, optimizer, _batches(LM))
        pipe.save(directory, optimizer=optimizer, step=2)
        saved = {name: t.numpy().copy() for name, t in pipe.state_dict().items()}  # queue-safe
        train(pipe, optimizer, _batches(LM, 1, seed=700))
        return {"saved": saved, "trained": {name: t.numpy().copy() for name, t in pipe.state_dict().items()}}

    def load(plan: Plan) -> dict[str, Any]:
        pipe = _compile(LM, plan)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE)
        assert pipe.load(directory, optimizer=optimizer)["step"] == 2
        loaded = {name: t.numpy().copy() for name, t in pipe.state_dict().items()}
        train(pipe, optimizer, _batches(LM, 1, seed=700))
        return {"loaded": loaded, "trained": {name: t.numpy().copy() for name, t in pipe.state_dict().items()}}

    saved = _in_world(store_dir, "ckpt-save", rank, save)
    plain = _in_world(store_dir, "ckpt-plain", rank, lambda: load(virtual_plan(LM, "interleaved", 3)))
    zero3 = _in_world(store_dir, "ckpt-zero3", rank, lambda: load(sharded_plan(LM, "interleaved", 3, "parameters")))
    return {"saved": saved, "plain": plain, "zero3": zero3}


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    references = {model: train_reference(_build(model)[0], zoo.get(model).loss_fn, _batches(model),
                                         after_backward=_clipped) for model in (LM, "mlp")}
    results = {}
    for index, (name, model, schedule, num_microbatches, level, options) in enumerate(CASES):
        results[name] = _in_world(store_dir, f"sharded-{index}", rank,
                                  partial(_exact, model, schedule, num_microbatches, level, options, references[model]))
    return {"exact": results, "checkpoints": _checkpoints(rank, store_dir, f"{store_dir}/ckpt")}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_run, WORLD_SIZE, tmp_path_factory.mktemp("virtual-sharded"), timeout_s=600.0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [name for name, *_ in CASES])
def test_sharded_chunks_train_exactly_as_one_process(per_rank: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(per_rank):
        record = results["exact"][case]
        assert not record["problems"], (rank, record["problems"][:3])
        assert record["losses"] == pytest.approx(record["reference_losses"], rel=1e-5), rank
        assert min(record["reference_norms"]) > MAX_NORM, record["reference_norms"]  # every step clips
        assert record["norms"] == pytest.approx(record["reference_norms"], rel=1e-5), rank
        assert record["evaluated"] == pytest.approx(record["expected_loss"], rel=1e-5), rank
        # the replicated group's chunks are FSDP2 shards, every other group's whole
        assert bool(record["sharded"]) == (rank in (0, 1)), (rank, record["sharded"])
        assert record["compiled"] == (record["chunks"] if "compiled" in case else []), rank
    assert per_rank[0]["exact"][case]["sharded"] == per_rank[1]["exact"][case]["sharded"]


@pytest.mark.multiprocess
def test_checkpoints_load_between_sharded_and_whole_chunks(per_rank: list[dict[str, Any]]) -> None:
    saved: dict[str, Any] = {}
    trained: dict[str, Any] = {}
    for results in per_rank:
        saved.update(results["checkpoints"]["saved"]["saved"])
        trained.update(results["checkpoints"]["saved"]["trained"])
    for rank, results in enumerate(per_rank):
        plain, zero3 = results["checkpoints"]["plain"], results["checkpoints"]["zero3"]
        assert plain["loaded"] and plain["loaded"].keys() == zero3["loaded"].keys(), rank
        for name in plain["loaded"]:
            assert (plain["loaded"][name] == saved[name]).all(), (rank, name)
            assert (zero3["loaded"][name] == saved[name]).all(), (rank, name)
            # the optimizer state loaded into whole and ZeRO-3 chunks: the next step the saving run took
            for loaded in (plain, zero3):
                torch.testing.assert_close(torch.from_numpy(loaded["trained"][name]), torch.from_numpy(trained[name]),
                                           rtol=1e-5, atol=1e-6)


def test_zero3_under_a_split_backward_is_refused_naming_the_fix() -> None:
    from fxpipe.compile_plan import check_sharded_schedule

    for schedule in ("zbv", "interleaved_zero_bubble"):
        plan = sharded_plan("mlp", schedule, 3, "parameters")
        with pytest.raises(PipelineSetupError, match=rf"schedule='{schedule}' runs each micro-batch's W .*'interleaved'"):
            check_sharded_schedule(plan)
    check_sharded_schedule(sharded_plan("mlp", "interleaved", 3, "parameters"))
