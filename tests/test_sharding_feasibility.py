"""Sharding turns a job with no plan into one with a plan (issue 34, item 5(b), at CPU scale), and the plan runs.

An LM whose untied output head alone needs more than a device holds unsharded: its weight, gradient and AdamW
state at 16 bytes per parameter, on single-device hosts (``4x1:cpu``: no tensor parallelism divides it), with
the device memory one byte under that. No pipeline cut can help, since one block cannot be cut, so
``sharding="none"`` finds no plan; ``sharding="auto"`` finds one, since ZeRO-1/2 keep only 1/r of the optimizer
state (and ZeRO-2 of the gradients) per replica. On 4 gloo ranks that plan trains exactly as one process, and
every rank's measured peak (model state and what the step allocates) is its stage's planned peak within the
memory model's tolerance. The planner fills a device up to its figure (here the first stage to within 0.1% of the
device's bytes), so that tolerance is the margin a real device needs.
The same configuration at scale, on V100s: benchmarks/sharding_study.md, "Infeasible to feasible".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes.partition.request import PlanningError
from fxpipe.runtime.parallel.sharded_stage import full_value
from fxpipe.sim.sharding_memory import model_state_bytes
from fxpipe.sim.stagecost import optimizer_factor
from tests import fsdp_memory_probe
from tests.exactness_oracle import ADAM_EPS, LEARNING_RATE, mismatches, train_reference
from tests.mp_utils import join_world, leave_world, run_ranks

MODEL = "gpt-mini"
ENTRY = zoo.get(MODEL)
# a vocabulary 128x the width: the head is 2 MiB of weights, the 2 transformer blocks 0.4 MiB together
OVERRIDES = {**ENTRY.tiny_overrides, "vocab_size": 8192, "n_embd": 64, "block_size": 8, "tie_embeddings": False}
WORLD_SIZE = 4
GLOBAL_BATCH = 8
NUM_STEPS = 3
MEMORY_TOLERANCE = 0.05  # the memory model against measured peaks (tests/test_sharded_stages.py, issue 34 item 1)


def _model() -> tuple[torch.nn.Module, Any]:
    return zoo.build(MODEL, **OVERRIDES)


def _memory_bytes() -> int:
    """One byte under what the output head alone holds unsharded: weights, gradients, AdamW's two moments."""
    model, _ = _model()
    head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return int(model_state_bytes(head_bytes, optimizer_factor("adamw"), "none", 1, 1)) - 1


def _cluster() -> str:
    return f"{WORLD_SIZE}x1:cpu,memory={_memory_bytes()}B"


def _plan(sharding: str) -> Any:
    model, example_inputs = _model()
    return fxpipe.plan(model, example_inputs, cluster=_cluster(), global_batch_size=GLOBAL_BATCH, costs="analytic",
                       loss_fn=ENTRY.loss_fn, sharding=sharding)


def test_no_unsharded_plan_fits_and_sharding_auto_finds_one_within_the_memory() -> None:
    with pytest.raises(PlanningError) as raised:
        _plan("none")
    assert "OVER" in str(raised.value) and "sharding='auto'" in str(raised.value), str(raised.value)
    plan = _plan("auto")
    assert any(stage.sharding != "none" for stage in plan.stages), plan.stages
    assert all(stage.tensor_parallel == 1 for stage in plan.stages)
    assert all(0 < stage.peak_memory_bytes <= _memory_bytes() for stage in plan.stages), \
        [(stage.stage_index, stage.peak_memory_bytes, _memory_bytes()) for stage in plan.stages]
    # the output head's stage shards: alone it needs one byte more than a device holds
    head_stage = plan.stages[-1]
    assert head_stage.sharding != "none" and head_stage.replicas > 1, head_stage


def _batches(num_steps: int) -> list[Any]:
    return [ENTRY.make_batch(GLOBAL_BATCH, 500 + step, **OVERRIDES) for step in range(num_steps)]


def _weights(pipe: Any) -> dict[str, torch.Tensor]:
    names = {name for name, _ in pipe.named_parameters()}
    return {name: tensor for name, tensor in pipe.state_dict().items() if name in names}


def _train_planned(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    reference = train_reference(_model()[0], ENTRY.loss_fn, _batches(NUM_STEPS))
    fsdp_memory_probe.install()
    join_world(store_dir, "auto", rank, world_size)
    try:
        model, example_inputs = _model()
        pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=GLOBAL_BATCH,
                              cluster=_cluster(), costs="analytic", sharding="auto")
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
        problems: list[str] = []
        for step, (inputs, targets) in enumerate(_batches(NUM_STEPS)):
            pipe.step(inputs, targets)
            grads = {name: full_value(p.grad) for name, p in pipe.named_parameters()}
            tolerance = ({"rtol": 1e-4, "atol": 1e-6} if step == 0
                         else {"rtol": 1e-3, "atol": 1e-6, "atol_of_largest": 1e-3})
            problems += mismatches(f"step {step} grad", grads, reference["grads_per_step"][step], **tolerance)
            optimizer.step()
            optimizer.zero_grad()
        problems += mismatches("param", _weights(pipe), reference["params"], rtol=0.0, atol=1e-4)
        stage = pipe.plan.stages[pipe.stage_index]
        _, peak, where = fsdp_memory_probe.warmed_peak_model_state_bytes(pipe, _batches(1)[0], LEARNING_RATE)
        return {"problems": problems, "stage": stage.stage_index, "sharding": stage.sharding,
                "replicas": stage.replicas, "planned_peak": stage.peak_memory_bytes, "measured_peak": peak,
                "where": where}
    finally:
        leave_world()


@pytest.mark.multiprocess
@pytest.mark.skipif(not fsdp_memory_probe.available(), reason="the memory probe needs glibc's mallinfo2")
def test_the_sharded_plan_trains_exactly_within_the_device_memory(tmp_path: Path) -> None:
    limit = _memory_bytes()
    failures = []
    for rank, record in enumerate(run_ranks(_train_planned, WORLD_SIZE, tmp_path)):
        failures += [f"rank {rank}: {problem}" for problem in record["problems"][:3]]
        if record["sharding"] == "none" or record["replicas"] < 2:
            failures.append(f"rank {rank}: stage {record['stage']} is not sharded: {record}")
        planned, measured = record["planned_peak"], record["measured_peak"]
        if not (planned <= limit and abs(measured / planned - 1) <= MEMORY_TOLERANCE):
            failures.append(f"rank {rank}: stage {record['stage']} ({record['sharding']}, {record['replicas']} "
                            f"replicas) measured a peak of {measured} B at {record['where']} against a planned "
                            f"{planned} B (want within {MEMORY_TOLERANCE:.0%}) on a device of {limit} B")
    assert not failures, "\n".join(failures)
