"""Per-block recompute on the stage kinds tests/test_block_recompute_parallel.py leaves out, on one 4-rank gloo world
against one process: ZeRO-1 and ZeRO-2 stages, RxT stages both tensor-parallel and sharded, compiled sharded stages
and sequence-parallel stages; each with an attention core and several whole blocks recomputed per stage."""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe.core import meta
from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes import trace
from fxpipe.passes.codegen import split_for_plan
from fxpipe.passes.partition.selective import with_block_node_counts
from fxpipe.passes.recompute_regions import REGION_PREFIX, stage_regions
from fxpipe.passes.tp_shard import shard_stage
from fxpipe.planning import costed_model, plan_chain
from tests.exactness_oracle import train_reference
from tests.mp_utils import join_world, leave_world, run_ranks
from tests.test_block_recompute_parallel import MODELS, ROWS, _batches, compared_steps

WORLD_SIZE = 4
GLOBAL_BATCH, NUM_MICROBATCHES = 4, 2  # tests/test_block_recompute_parallel.py's batches: rows of 16 tokens
COMPILED = {"backend": "aot_eager"}  # AOTAutograd's graphs without inductor's code generation (seconds, not minutes)

# (name, model, layout, sharding, sequence_parallel, torch_compile)
CASES: tuple[tuple[str, str, str, str, bool, Any], ...] = (
    ("ZeRO-1 2:2", "tiny", "2:2", "optimizer", False, False),
    ("ZeRO-2 2:2 llama", "llama", "2:2", "gradients", False, False),
    ("ZeRO-3 2x2", "tiny", "2x2", "parameters", False, False),
    ("ZeRO-2 2x2 SP llama", "llama", "2x2", "gradients", True, False),
    ("1x2:1x2 SP", "tiny", "1x2:1x2", "none", True, False),
    ("ZeRO-2 2:2 compiled", "tiny", "2:2", "gradients", False, COMPILED),
    ("ZeRO-3 2:2 compiled", "tiny", "2:2", "parameters", False, COMPILED),
)


def stage_choices(chain: CostChain, stage: StagePlan) -> tuple[str, ...]:
    """Per block of ``stage``: its first attention core recomputed alone ("attention"), any later core's block and
    every third other block recomputed whole ("block"), the rest kept: cores and whole blocks in every stage,
    whole blocks next to kept ones (regions whose inputs and outputs cross kept code)."""
    blocks = chain.blocks[stage.first_block:stage.stop_block]
    cores = [index for index, block in enumerate(blocks) if block.attention_core_bytes.at(1) > 0]
    return tuple("attention" if cores and index == cores[0] else "block" if index in cores or index % 3 == 1
                 else "keep" for index in range(len(blocks)))


@functools.cache
def _chain(model_name: str, world_size: int) -> CostChain:
    """The model's costed chain on ``world_size`` CPU devices (traced and costed once per file: seconds each)."""
    factory, loss_fn, batch, _ = MODELS[model_name]
    model, example = factory()
    cluster = parse_cluster(f"1x{world_size}:cpu")
    return costed_model(model, example, cluster, loss_fn=loss_fn, example_targets=batch(ROWS, 0)[1]).chain


def recomputing_plan(model_name: str, layout: str, sharding: str, world_size: int, per_block: bool = True) -> Plan:
    """The planner's cuts for ``layout`` on ``world_size`` CPU devices at ``sharding``, recomputing per block
    (:func:`stage_choices`; ``per_block`` False: nothing recomputed)."""
    cluster = parse_cluster(f"1x{world_size}:cpu")
    chain = _chain(model_name, world_size)
    plan = plan_chain(chain, cluster, GLOBAL_BATCH, layout=layout, num_microbatches=NUM_MICROBATCHES,
                      recompute="never", sharding=sharding)
    if not per_block:
        return plan
    stages = tuple(dataclasses.replace(stage, block_recompute=stage_choices(chain, stage)) for stage in plan.stages)
    return with_block_node_counts(plan.with_updates(stages=stages), chain)


def num_regions(stage: StagePlan) -> int:
    """Checkpointed regions the stage's choices ask for: one per whole block, one per core (one core per block)."""
    return sum(choice != "keep" for choice in stage.block_recompute)


def compared(pipe: Any, model_name: str, reference: dict[str, Any]) -> list[str]:
    """AdamW steps: each step's loss (rtol 1e-5) and every whole gradient (gathered over the replicas' shards and
    the group's members; rtol 1e-4 at step 0, 1e-3 later where Adam amplifies the rounding:
    tests/exactness_oracle.py), then the whole weights (1e-4), against the one-process reference."""
    return compared_steps(pipe, reference, _batches(model_name), MODELS[model_name][3], check_losses=True)


def regions_run(pipe: Any) -> int:
    """Checkpointed regions in this rank's stage module (under FSDP2 units too)."""
    return sum(1 for name, _ in pipe.driver.runner.module.named_modules()
               if name.rsplit(".", 1)[-1].startswith(REGION_PREFIX))


def references_for(cases: tuple[tuple[str, str, str, str, bool, Any], ...]) -> dict[str, dict[str, Any]]:
    """One process's training of each model the cases use (computed once, in the parent, not on every rank)."""
    references = {}
    for model in sorted({case[1] for case in cases}):
        trained = train_reference(MODELS[model][0]()[0], MODELS[model][1], _batches(model), adam_eps=MODELS[model][3])
        references[model] = {key: value for key, value in trained.items() if key != "model"}
    return references


def run_cases(rank: int, world_size: int, store_dir: str, cases: tuple[tuple[str, str, str, str, bool, Any], ...],
              plans: dict[str, Plan], references: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case (``CASES``' shape) in a fresh process group of the world, trained against one process."""
    results: dict[str, Any] = {}
    for index, (name, model_name, _, _, sequence_parallel, torch_compile) in enumerate(cases):
        join_world(store_dir, f"case-{index}", rank, world_size)
        try:
            model, example = MODELS[model_name][0]()
            pipe = fxpipe.compile(model, example, loss_fn=MODELS[model_name][1], global_batch_size=GLOBAL_BATCH,
                                  plan=plans[name], sequence_parallel=sequence_parallel, torch_compile=torch_compile)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                problems = compared(pipe, model_name, references[model_name])
            # FSDP2 warns when a unit returns a view: an in-place op on it would drop the unit's backward hook
            problems += [f"warned: {w.message}" for w in caught if "returned a view tensor" in str(w.message)][:1]
            results[name] = {"problems": problems, "stage": pipe.stage_index, "regions": regions_run(pipe),
                             "names": sorted(n for n, _ in pipe.named_parameters()),
                             "fsdp": pipe.driver.sharded is not None, "degree": pipe.driver.tensor_parallel.degree,
                             "split": dict(pipe.driver.token_split),
                             "frames": pipe.compile_stats()[rank].num_frames if torch_compile else 0}
        finally:
            leave_world()
    return results


def layout_of(plan: Plan) -> str:
    return ":".join(f"{s.replicas}x{s.tensor_parallel}" if s.tensor_parallel > 1 else str(s.replicas)
                    for s in plan.stages)


def check_cases(cases: tuple[tuple[str, str, str, str, bool, Any], ...], plans: dict[str, Plan],
                per_rank: list[dict[str, Any]]) -> None:
    """Every rank of every case exact (:func:`compared`), and what each case is about did happen."""
    failures = [f"{name} rank {rank}: {problem}" for rank, results in enumerate(per_rank)
                for name, record in results.items() for problem in record["problems"][:4]]
    assert not failures, "\n".join(failures)
    for name, model_name, _, sharding, sequence_parallel, torch_compile in cases:
        records = [results[name] for results in per_rank]
        # every stage ran its regions, and every parameter was held (so compared) by some rank
        assert [record["regions"] for record in records] == [
            num_regions(plans[name].stages[record["stage"]]) for record in records], (name, records)
        held = {param for record in records for param in record["names"]}
        assert held == set(dict(MODELS[model_name][0]()[0].named_parameters())), name
        assert all(record["fsdp"] == (sharding != "none") for record in records), name
        assert all(record["degree"] == plans[name].stages[record["stage"]].tensor_parallel for record in records), name
        if torch_compile:  # regions compile inside the stage's one graph (they broke it at each region before)
            assert all(record["frames"] == 1 for record in records), (name, [r["frames"] for r in records])
        if sequence_parallel and len(plans[name].stages) > 1:  # token shares crossed between the two SP stages
            assert all(record["split"] for record in records), (name, [r["split"] for r in records])


@pytest.mark.multiprocess
def test_per_block_recompute_trains_as_one_process_on_zero12_tp_sharded_compiled_and_sequence_parallel_stages(
        tmp_path: Path) -> None:
    plans = {name: recomputing_plan(model, layout, sharding, WORLD_SIZE)
             for name, model, layout, sharding, _, _ in CASES}
    for name, _, layout, sharding, _, _ in CASES:  # the layouts and levels asked for, every stage recomputing
        stages = plans[name].stages
        assert layout_of(plans[name]) == layout, (name, stages)
        assert all(s.sharding == sharding and "block" in s.block_recompute for s in stages), name
        assert "attention" in stages[0].block_recompute, name  # a later stage may hold no core (the planner's cut)
    check_cases(CASES, plans, run_ranks(run_cases, WORLD_SIZE, tmp_path, CASES, plans, references_for(CASES),
                                             timeout_s=300.0))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tensor_parallel_member_recomputes_the_blocks_the_plan_names(sequence_parallel: bool) -> None:
    """On a member's shard the split linears and collectives carry new names; each goes with the block of the node
    it was rewritten from, so the member recomputes the plan's blocks: no block found empty (and silently kept), no
    renamed linear of a kept block pulled into the region before it."""
    plan = recomputing_plan("tiny", "1x2:1x2", "none", 4)
    model, example = MODELS["tiny"][0]()
    program = split_for_plan(trace(model, example), plan, example_inputs=example)
    for stage, stage_program in zip(plan.stages, program.stages, strict=True):
        planned = stage_regions(stage_program.module, stage)
        member = shard_stage(copy.deepcopy(stage_program.module), 2, 0, group_key="unused",
                             example_inputs=[torch.zeros(program.values[name].shape, dtype=program.values[name].dtype)
                                             for name in stage_program.input_values],
                             sequence_parallel=sequence_parallel).module
        origin = {node.name: node.meta.get(meta.TP_ORIGIN, node.name) for node in member.graph.nodes}
        on_member = [sorted({origin[name] for name in region}) for region in stage_regions(member, stage, positional=True)]
        assert len(planned) == num_regions(stage) and on_member == [sorted(region) for region in planned], (
            stage.stage_index, on_member, planned)
        assert any(len(region) > 1 for region in stage_regions(member, stage, positional=True))  # collectives inside
