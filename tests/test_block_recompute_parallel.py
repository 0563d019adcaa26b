"""Per-block recompute on sharded (ZeRO-3, FSDP2 units per block) and tensor-parallel (T = 2) stages, on 2 gloo
ranks against one process; where the regions sit (inside the block's FSDP unit, on the member's shard); and the
planner's memory figures for per-block choices on sharded stages."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.plan import Plan
from fxpipe.passes.partition.selective import with_block_node_counts
from fxpipe.planning import costed_model, plan_chain
from tests.exactness_oracle import LEARNING_RATE, mismatches, train_reference
from tests.mp_utils import join_world, leave_world, run_ranks
from tests.test_tensor_parallel_runtime import TinyLM, _token_loss

hf_examples = pytest.importorskip("fxpipe.hf_examples")

GLOBAL_BATCH, NUM_MICROBATCHES, SEQ_LEN = 4, 2, 16  # make_batch("llama") rows have 16 tokens
ROWS = GLOBAL_BATCH // NUM_MICROBATCHES


def _llama() -> tuple[torch.nn.Module, Any]:
    """HF Llama, 2 layers, eager attention (its core QK^T, softmax, x V: functions); traced by torch.export
    (weights read through get_attr)."""
    model, example = hf_examples.llama(num_layers=2, hidden=32, heads=4, kv_heads=2, seq_len=SEQ_LEN, batch_size=ROWS)
    model.config._attn_implementation = "eager"
    return model, example


def _tiny() -> tuple[torch.nn.Module, Any]:
    """Two attention + MLP blocks in an nn.Sequential (an SDPA core), traced by torch.fx (leaf modules called)."""
    return TinyLM(64, 32, 4, 2), (torch.zeros(ROWS, SEQ_LEN, dtype=torch.long),)


def _tiny_batch(rows: int, seed: int) -> tuple[Any, torch.Tensor]:
    tokens = torch.randint(0, 64, (rows, SEQ_LEN + 1), generator=torch.Generator().manual_seed(seed))
    return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


# name -> (model factory, loss, batch of (rows, seed)); AdamW's eps: TinyLM's key biases get rounding-noise gradients
# that Adam would scale to full steps (tests/test_tensor_parallel_runtime.py)
MODELS: dict[str, tuple[Any, Any, Any, float]] = {
    "llama": (_llama, hf_examples.hf_loss, lambda rows, seed: hf_examples.make_batch("llama", rows, seed), 1e-8),
    "tiny": (_tiny, _token_loss, _tiny_batch, 1e-5),
}


def _batches(model: str) -> list[Any]:
    return [MODELS[model][2](GLOBAL_BATCH, 100 + step) for step in range(2)]


def _choices(chain: Any) -> tuple[str, ...]:
    """The first layer recomputes its attention core, the second every one of its blocks; the rest kept."""
    cores = [index for index, block in enumerate(chain.blocks) if block.attention_core_bytes.at(1) > 0]
    assert len(cores) == 2, [block.name for block in chain.blocks]
    second = range(cores[1], cores[1] + 2)  # layer 1's attention block and its MLP block
    return tuple("attention" if index == cores[0] else "block" if index in second else "keep"
                 for index in range(chain.num_blocks))


def _plan(model_name: str, layout: str, sharding: str) -> Plan:
    """One stage on 2 devices (``layout`` "2": two replicas; "1x2": one T = 2 group) with :func:`_choices`."""
    factory, loss_fn, batch, _ = MODELS[model_name]
    model, example = factory()
    cluster = parse_cluster("1x2:cpu")
    chain = costed_model(model, example, cluster, loss_fn=loss_fn, example_targets=batch(ROWS, 0)[1]).chain
    plan = plan_chain(chain, cluster, GLOBAL_BATCH, layout=layout, num_microbatches=NUM_MICROBATCHES,
                      recompute="never", sharding=sharding)
    stages = tuple(dataclasses.replace(stage, block_recompute=_choices(chain)) for stage in plan.stages)
    return with_block_node_counts(plan.with_updates(stages=stages), chain)


def _train(rank: int, store_dir: str, name: str, model_name: str, plan: Plan, reference: dict[str, Any]
           ) -> dict[str, Any]:
    factory, loss_fn, _, adam_eps = MODELS[model_name]
    model, example = factory()
    join_world(store_dir, name, rank, 2)
    try:
        pipe = fxpipe.compile(model, example, loss_fn=loss_fn, global_batch_size=GLOBAL_BATCH, plan=plan)
        driver = pipe.driver
        sharded = driver.sharded
        units = [sorted(name for name, _ in unit.named_children() if name.startswith("fxpipe_recompute_"))
                 for unit in (sharded.units if sharded is not None else ())]
        regions = sorted(name for name, _ in driver.runner.module.named_children() if name.startswith("fxpipe_recompute_"))
        return {"problems": _compared(pipe, reference, _batches(model_name), adam_eps), "units": units,
                "regions": regions}
    finally:
        leave_world()


def _compared(pipe: Any, reference: dict[str, Any], batches: list[Any], adam_eps: float) -> list[str]:
    """AdamW steps; each step's whole gradients (gathered over the replicas' shards or the group's members) within
    rtol 1e-4 at step 0 (float sums in another order: the replicas' reduce-scatter, the members' all-reduces) and
    1e-3 later (Adam amplifies the rounding: tests/exactness_oracle.py); the whole weights within 1e-4 at the end."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=adam_eps)
    problems: list[str] = []
    for step, (inputs, targets) in enumerate(batches):
        pipe.step(inputs, targets)
        grads = {name: pipe.driver.whole(name, param.grad) for name, param in pipe.named_parameters()}
        tolerance = {"rtol": 1e-4, "atol": 1e-6} if step == 0 else {"rtol": 1e-3, "atol": 1e-6, "atol_of_largest": 1e-3}
        problems += mismatches(f"step {step} grad", grads, reference["grads_per_step"][step], **tolerance)
        optimizer.step()
        optimizer.zero_grad()
    names = {name for name, _ in pipe.named_parameters()}
    weights = {name: value for name, value in pipe.state_dict().items() if name in names}
    return problems + mismatches("param", weights, reference["params"], rtol=0.0, atol=1e-4)


def _checks(rank: int, world_size: int, store_dir: str, plans: dict[str, tuple[str, Plan]]) -> dict[str, Any]:
    references = {}
    for model_name, (factory, loss_fn, _, adam_eps) in MODELS.items():
        references[model_name] = train_reference(factory()[0], loss_fn, _batches(model_name), adam_eps=adam_eps)
    return {name: _train(rank, store_dir, name, model_name, plan, references[model_name])
            for name, (model_name, plan) in plans.items()}


@pytest.mark.multiprocess
def test_per_block_recompute_on_zero3_and_tensor_parallel_stages_trains_as_one_process(tmp_path: Any) -> None:
    plans = {"zero3": ("llama", _plan("llama", "2", "parameters")), "zero3 fx": ("tiny", _plan("tiny", "2", "parameters")),
             "tp": ("llama", _plan("llama", "1x2", "none"))}
    assert all(plan.stages[0].sharding == "parameters" for name, (_, plan) in plans.items() if name.startswith("zero3"))
    assert plans["tp"][1].stages[0].tensor_parallel == 2
    per_rank = run_ranks(_checks, 2, tmp_path, plans)
    for rank, results in enumerate(per_rank):
        for name, result in results.items():
            # gradients within rtol 1e-4 at step 0 (float sums in another order: the replicas' reduce-scatter, the
            # members' all-reduces), weights within 1e-4 after AdamW (tests/exactness_oracle.py)
            assert result["problems"] == [], (rank, name, result["problems"])
        # three regions: layer 0's core, layer 1's attention block and MLP block
        assert [len(result["regions"]) for result in results.values()] == [3, 3, 3], (rank, results)
        # ZeRO-3: each layer its own FSDP unit holding its regions, so the unit's hooks wrap the checkpoint (the
        # export front end's regions read weights as arguments, the fx one's call the block's layers)
        for name in ("zero3", "zero3 fx"):
            assert results[name]["units"] == [["fxpipe_recompute_0"], ["fxpipe_recompute_1", "fxpipe_recompute_2"]], (
                rank, name, results[name]["units"])
