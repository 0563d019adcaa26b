"""Per-block recompute on sharded (ZeRO-3, FSDP2 units per block) and tensor-parallel (T = 2) stages, on 2 gloo
ranks against one process; where the regions sit (inside the block's FSDP unit, on the member's shard); and the
planner's memory figures for per-block choices on sharded stages."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec, parse_cluster
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan
from fxpipe.passes.partition.latency import stage_times
from fxpipe.passes.partition.selective import recompute_memory, with_block_node_counts
from fxpipe.planning import costed_model, plan_chain
from fxpipe.sim.stagecost import stage_cost, stage_memory_bytes
from fxpipe.sim.tensor_parallel_cost import splits
from tests.exactness_oracle import LEARNING_RATE, mismatches, train_reference
from tests.mp_utils import join_world, leave_world, run_ranks
from tests.reference_sim import rerun_and_dropped, stage_peak_bytes
from tests.test_oracle_simulate import assert_agrees
from tests.test_tensor_parallel_plan import tp_setup
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


def _choices(chain: Any, model_name: str) -> tuple[str, ...]:
    """The first layer recomputes its attention core, the second some of its blocks whole (Llama: its core's chain
    block and the next; the small LM: all of them, so that no node of its FSDP unit is left outside a region); the
    rest kept."""
    cores = [index for index, block in enumerate(chain.blocks) if block.attention_core_bytes.at(1) > 0]
    assert len(cores) == 2, [block.name for block in chain.blocks]
    second = range(cores[1], cores[1] + 2)  # layer 1's attention block and the next
    if model_name == "tiny":
        layer = [index for index, block in enumerate(chain.blocks)
                 if any(name.startswith("blocks_1_") for name in block.node_names)]
        second = range(layer[0], layer[-1] + 2)  # its first module call to its closing residual add
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
    stages = tuple(dataclasses.replace(stage, block_recompute=_choices(chain, model_name)) for stage in plan.stages)
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
        return {"problems": compared_steps(pipe, reference, _batches(model_name), adam_eps), "units": units,
                "regions": regions}
    finally:
        leave_world()


def compared_steps(pipe: Any, reference: dict[str, Any], batches: list[Any], adam_eps: float,
                   check_losses: bool = False) -> list[str]:
    """AdamW steps; each step's whole gradients (gathered over the replicas' shards or the group's members) within
    rtol 1e-4 at step 0 (float sums in another order: the replicas' reduce-scatter, the members' all-reduces) and
    1e-3 later (Adam amplifies the rounding: tests/exactness_oracle.py); the whole weights within 1e-4 at the end;
    with ``check_losses`` each step's loss within rtol 1e-5 too."""
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=adam_eps)
    problems: list[str] = []
    for step, (inputs, targets) in enumerate(batches):
        loss = pipe.step(inputs, targets)
        expected = reference["losses"][step] if check_losses else loss
        if abs(loss - expected) > 1e-5 * abs(expected):
            problems.append(f"step {step} loss {loss} vs {expected}")
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
        # Llama: layer 0's core, layer 1's core block and the next; the small LM: layer 0's core, layer 1 block by block
        assert [len(result["regions"]) for result in results.values()] == [3, 21, 3], (rank, results)
        # ZeRO-3: each layer its own FSDP unit holding its regions, so the unit's hooks wrap the checkpoint (the
        # export front end's regions read weights as arguments; the fx one's call the block's layers, and the small
        # LM's layer 1 is all regions: its unit is found through what they call). The small LM's closing residual
        # add (its last region) calls no module and follows the layer's last call: the root unit runs it
        for name, outside in (("zero3", set()), ("zero3 fx", {"fxpipe_recompute_20"})):
            units, regions = results[name]["units"], results[name]["regions"]
            assert len(units) == 2 and units[0] == ["fxpipe_recompute_0"], (rank, name, units)
            assert sorted(units[1]) == sorted(set(regions) - {"fxpipe_recompute_0"} - outside), (rank, name, units)


# ---------------------------------------------------------------- simulator, reference, pivot model and planner


def _with_choices(seed: int) -> tuple[Plan, Any, Any, dict[str, Any]]:
    """tests/test_tensor_parallel_plan.py's random R x T plans (ZeRO levels, split and whole blocks), blocks given
    attention cores, and most stages per-block choices at random."""
    plan, chain, net, options = tp_setup(seed)
    rng = random.Random(seed + 7 * 10**6)
    chain = dataclasses.replace(chain, blocks=tuple(dataclasses.replace(
        block, attention_core_bytes=Affine(0, rng.uniform(0, 0.7) * block.saved_bytes.per_sample),
        attention_core_s=Affine(0, rng.uniform(0, 0.1) * block.forward_s.per_sample)) for block in chain.blocks))
    stages = tuple(dataclasses.replace(stage, recompute=False, block_recompute=tuple(
        rng.choice(("keep", "block", "attention")) for _ in range(stage.stop_block - stage.first_block)))
        if plan.schedule != "zero_bubble" and rng.random() < 0.8 else stage for stage in plan.stages)
    return plan.with_updates(stages=stages), chain, net, options


def test_simulator_matches_the_reference_with_per_block_recompute_on_sharded_and_tensor_parallel_stages() -> None:
    seen: set[str] = set()
    for seed in range(120):
        plan, chain, net, options = _with_choices(seed)
        described = [(s.tensor_parallel, s.sharding, s.block_recompute) for s in plan.stages]
        assert_agrees(plan, chain, net, f"seed {seed}: {described}", **options)
        for stage in (stage for stage in plan.stages if stage.block_recompute):
            blocks = chain.blocks[stage.first_block:stage.stop_block]
            if any(choice == "block" and splits(block, stage.tensor_parallel)
                   for choice, block in zip(stage.block_recompute, blocks, strict=True)):
                seen.add("split block rerun")
            if stage.sharding != "none" and stage.replicas > 1:
                seen.add(stage.sharding)
    assert {"split block rerun", "optimizer", "gradients", "parameters"} <= seen, seen


def test_pivot_model_charges_the_rerun_forward_with_its_collectives() -> None:
    checked = 0
    for seed in range(60):
        plan, chain, net, _ = _with_choices(seed)
        plain = plan.with_updates(stages=tuple(dataclasses.replace(s, block_recompute=()) for s in plan.stages))
        selective, base = stage_times(plan, chain, net), stage_times(plain, chain, net)
        for index, stage in enumerate(plan.stages):
            rows = -(-plan.microbatch_size // stage.replicas)
            compute, _, comm = rerun_and_dropped(chain, stage, rows, net)
            step = selective.stage_index.index(index)
            assert selective.backward[step] - base.backward[step] == pytest.approx(
                compute * net.compute_slowdown + comm, rel=1e-9, abs=1e-15), (seed, index)
            checked += comm > 0
    assert checked > 5  # collectives rerun on split blocks were charged


def _wide_chain(num_layers: int) -> Any:
    """A transformer-like chain: per layer 64 MiB of weights, 256 MiB saved per row (a 16 MiB residual in between),
    1 ms forward per row."""
    block = Block("layer", (), Affine(0, 1e-3), Affine(0, 2e-3), 64 * 2**20, Affine(0, 256 * 2**20))
    return CostChain(tuple(dataclasses.replace(block, name=f"layer{i}") for i in range(num_layers)),
                     tuple(Affine(0, 16 * 2**20) for _ in range(num_layers - 1)), Affine(0, 2**20), Affine(0, 2**20))


def test_planner_recomputes_a_zero3_stage_per_block_and_prices_it_per_unit() -> None:
    """16 layers on 4 devices at 2 GiB, one row per replica: keeping activations (4 GiB a row) or a whole-stage
    checkpoint (one FSDP unit of the whole stage, all 4 GiB rebuilt at once) does not fit; ZeRO-3 with units per
    block and blocks recomputed does. The plan's peak is the reference's (tests/reference_sim.py, written out apart)."""
    chain, limit = _wide_chain(16), 2 * 2**30
    cluster = Cluster("1x4", 1, 4, DeviceSpec("dev", limit, (("float32", 1e13),), 1e12), LinkSpec(100e9, 5e-6),
                      LinkSpec(10e9, 2e-5))
    plan = plan_chain(chain, cluster, 4, layout="dp", num_microbatches=1, sharding="parameters")
    stage = plan.stages[0]
    assert (stage.sharding, stage.recompute) == ("parameters", False) and "block" in stage.block_recompute, stage
    assert stage.peak_memory_bytes == stage_peak_bytes(plan, chain, 0, stage.inflight_microbatches) <= limit
    cost = stage_cost(chain, 0, 16, 4, 4)
    every_block = recompute_memory(chain, 0, 16, cost, 1, "adam", True, "parameters", 4, 1, limit_bytes=limit)
    assert every_block == stage_peak_bytes(plan.with_updates(stages=(dataclasses.replace(
        stage, block_recompute=("block",) * 16),)), chain, 0, 1) <= limit  # what the search priced
    assert recompute_memory(chain, 0, 16, cost, 1, "adam", False, "parameters", 4, 1) > limit  # all kept
    one_unit = stage_memory_bytes(cost, 1, "adam", True, sharding="parameters", replicas=4, num_microbatches=1)
    assert one_unit > limit  # the whole-stage checkpoint: one FSDP unit, the whole stage rebuilt at once


def test_planner_recomputes_per_block_where_only_that_fits_an_unsharded_stage() -> None:
    """6 layers on one device at 2 GiB (1.5 GiB of weights and Adam state): the whole-stage checkpoint rebuilds 1.5 GiB
    at once and does not fit; every block recomputed per block (one layer rebuilt at a time) does, and the plan says
    so per block (the search priced only the whole-stage checkpoint before, and found no plan)."""
    chain, limit = _wide_chain(6), 2 * 2**30
    cluster = Cluster("1x1", 1, 1, DeviceSpec("dev", limit, (("float32", 1e13),), 1e12), LinkSpec(100e9, 5e-6),
                      LinkSpec(10e9, 2e-5))
    cost = stage_cost(chain, 0, 6, 1, 1)
    assert stage_memory_bytes(cost, 1, "adam", True) > limit
    plan = plan_chain(chain, cluster, 1, layout="1", num_microbatches=1)
    stage = plan.stages[0]
    assert not stage.recompute and stage.block_recompute.count("block") >= 5, stage.block_recompute
    assert stage.peak_memory_bytes == stage_peak_bytes(plan, chain, 0, 1) <= limit
