"""Sharded chunks on virtual stages (fxpipe.runtime.parallel.virtual_sharding): the 2:1:1 device groups with 2 chunks each
on 4 gloo ranks, group 0's chunks sharded over its 2 replicas at ZeRO-1, 2 or 3, train exactly as one process under
interleaved 1F1B, interleaved zero-bubble and ZB-V (the tied embedding included), and evaluate; ZeRO-3 under a split
backward stays refused."""

from __future__ import annotations

from dataclasses import replace
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
from tests.test_virtual_runtime import LM, WORLD_SIZE, _batches, _build, _compile, _in_world, virtual_plan

# (name, model, schedule, micro-batches, level of the replicated group's chunks)
CASES = (
    ("lm interleaved zero3", LM, "interleaved", 4, "parameters"),
    ("lm zbv zero1", LM, "zbv", 3, "optimizer"),
    ("mlp interleaved zero1", "mlp", "interleaved", 6, "optimizer"),
    ("mlp interleaved_zero_bubble zero2", "mlp", "interleaved_zero_bubble", 3, "gradients"),
)


def sharded_plan(model: str, schedule: str, num_microbatches: int, level: str) -> Plan:
    """The test's 2:1:1 plan with the two-replica group's chunks sharded at ``level``."""
    plan = virtual_plan(model, schedule, num_microbatches)
    return plan.with_updates(stages=tuple(replace(s, sharding=level) if s.replicas > 1 else s for s in plan.stages))


def _whole(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """Whole tensors by name (a DTensor gathered: every replica of its chunk walks the same names in order)."""
    return {name: full_value(t) for name, t in sorted(tensors.items()) if t is not None}


def _exact(model: str, schedule: str, num_microbatches: int, level: str, reference: dict[str, Any]) -> dict[str, Any]:
    pipe = _compile(model, sharded_plan(model, schedule, num_microbatches, level))
    sharded = sorted(name for name, p in pipe.named_parameters() if isinstance(p, DTensor))
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE)
    losses, problems = [], []
    for step, (inputs, targets) in enumerate(_batches(model)):
        losses.append(pipe.step(inputs, targets))
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
    return {"losses": losses, "reference_losses": reference["losses"], "problems": problems, "sharded": sharded, "chunks": list(pipe.driver.chunks),
            "evaluated": pipe.evaluate(inputs, targets), "expected_loss": expected,
            "shard_state": [tuple(s.shape) for s in optimizer.state_dict()["state"].get(0, {}).values()
                            if isinstance(s, torch.Tensor) and s.dim() > 0]}


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    references = {model: train_reference(_build(model)[0], zoo.get(model).loss_fn, _batches(model))
                  for model in (LM, "mlp")}
    results = {}
    for index, (name, model, schedule, num_microbatches, level) in enumerate(CASES):
        results[name] = _in_world(store_dir, f"sharded-{index}", rank, lambda case=(model, schedule, num_microbatches,
                                  level): _exact(*case, references[case[0]]))
    return results


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_run, WORLD_SIZE, tmp_path_factory.mktemp("virtual-sharded"), timeout_s=600.0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [name for name, *_ in CASES])
def test_sharded_chunks_train_exactly_as_one_process(per_rank: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(per_rank):
        record = results[case]
        assert not record["problems"], (rank, record["problems"][:3])
        assert record["losses"] == pytest.approx(record["reference_losses"], rel=1e-5), rank
        assert record["evaluated"] == pytest.approx(record["expected_loss"], rel=1e-5), rank
        # the replicated group's chunks are FSDP2 shards, every other group's whole
        assert bool(record["sharded"]) == (rank in (0, 1)), (rank, record["sharded"])
    assert per_rank[0][case]["sharded"] == per_rank[1][case]["sharded"]


def test_zero3_under_a_split_backward_is_refused_naming_the_fix() -> None:
    from fxpipe.compile_plan import check_runs_virtual, check_sharded_schedule

    for schedule in ("zbv", "interleaved_zero_bubble"):
        plan = sharded_plan("mlp", schedule, 3, "parameters")
        check_runs_virtual(plan)
        with pytest.raises(PipelineSetupError, match=rf"schedule='{schedule}' runs each micro-batch's W .*'interleaved'"):
            check_sharded_schedule(plan)
    check_sharded_schedule(sharded_plan("mlp", "interleaved", 3, "parameters"))
