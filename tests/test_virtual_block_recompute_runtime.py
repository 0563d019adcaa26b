"""Per-block recompute on virtual-stage chunks at runtime: a plan the virtual planner emits (gpt-mini on 2:1:1, two
chunks per group, interleaved 1F1B, memory squeezed until chunks recompute some blocks), and the same plan with the
replicated group's chunks at ZeRO-1 and ZeRO-3, each trained on 4 gloo ranks exactly as one process."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import torch

from fxpipe import models as zoo
from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes.partition.selective import with_block_node_counts
from fxpipe.planning import costed_model, plan_chain
from fxpipe.sim.virtual_simulate import group_peak_bytes, virtual_schedule
from tests.exactness_oracle import LEARNING_RATE, mismatches, train_reference
from tests.mp_utils import run_ranks
from tests.test_virtual_runtime import GLOBAL_BATCH, LM, WORLD_SIZE, _batches, _build, _compile, _in_world
from tests.test_virtual_sharded import _whole

NUM_MICROBATCHES = 4


def planned() -> tuple[Plan, int, CostChain]:
    """The planner's plan of gpt-mini on 2:1:1 with v = 2 under memory 4% below what keeping everything needs, that
    memory limit, and the chain it was planned on."""
    model, example = _build(LM)
    inputs = example if isinstance(example, tuple | dict) else (example,)
    cluster = parse_cluster("1x4:cpu")
    targets = _batches(LM, 1)[0][1]
    chain = costed_model(model, inputs, cluster, loss_fn=zoo.get(LM).loss_fn, example_targets=targets).chain

    def plan(limit: int | None, recompute: str) -> Plan:
        net = cluster if limit is None else replace(cluster, device=replace(cluster.device, memory_bytes=limit))
        return plan_chain(chain, net, GLOBAL_BATCH, layout="2:1:1", num_microbatches=NUM_MICROBATCHES,
                          virtual_stages=2, schedule="interleaved", recompute=recompute, sharding="none")

    kept = plan(None, "never")
    schedule = virtual_schedule(kept.schedule, len(kept.stages), kept.num_microbatches, kept.virtual_stages)
    limit = int(max(group_peak_bytes(kept, chain, schedule, g, "adam", cluster) for g in range(kept.num_groups)) * 0.96)
    return plan(limit, "auto"), limit, chain


def with_level(plan: Plan, chain: CostChain, level: str) -> Plan:
    """``plan`` with the replicated group's chunks at ``level``, each recomputing its second and third blocks whole
    (the planner left that group's chunks kept: it fits)."""
    def chosen(stage: StagePlan) -> StagePlan:
        num_blocks = stage.stop_block - stage.first_block
        return replace(stage, sharding=level, block_recompute=tuple(
            "block" if offset in (1, 2) else "keep" for offset in range(num_blocks)))
    stages = tuple(chosen(s) if s.replicas > 1 else s for s in plan.stages)
    return with_block_node_counts(plan.with_updates(stages=stages), chain)


def _exact(plan: Plan, reference: dict[str, Any]) -> dict[str, Any]:
    pipe = _compile(LM, plan)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE)
    problems, losses = [], []
    for step, (inputs, targets) in enumerate(_batches(LM)):
        losses.append(pipe.step(inputs, targets))
        grads = _whole({name: p.grad for name, p in pipe.named_parameters()})
        tolerance = {"rtol": 1e-4, "atol": 1e-6} if step == 0 else {"rtol": 1e-3, "atol": 1e-6, "atol_of_largest": 1e-3}
        problems += mismatches(f"step {step} grad", grads, reference["grads_per_step"][step], **tolerance)
        optimizer.step()
        optimizer.zero_grad()
    params = {name: t for name, t in pipe.state_dict().items() if name in reference["params"]}
    problems += mismatches("param", params, reference["params"], rtol=0.0, atol=1e-4)
    regions = {c: sorted(name for name, _ in runner.module.named_modules() if "fxpipe_recompute_" in name)
               for c, runner in pipe.driver.runners.items()}
    return {"problems": problems, "losses": losses, "reference_losses": reference["losses"], "regions": regions}


def _run(rank: int, world_size: int, store_dir: str, plans: dict[str, Plan]) -> dict[str, Any]:
    torch.set_num_threads(1)
    reference = train_reference(_build(LM)[0], zoo.get(LM).loss_fn, _batches(LM))
    return {name: _in_world(store_dir, f"blockrc-{index}", rank, partial(_exact, plan, reference))
            for index, (name, plan) in enumerate(plans.items())}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Plan], list[dict[str, Any]]]:
    plan, _, chain = planned()
    plans = {"planned": plan, "zero1": with_level(plan, chain, "optimizer"),
             "zero3": with_level(plan, chain, "parameters")}
    return plans, run_ranks(_run, WORLD_SIZE, tmp_path_factory.mktemp("virtual-blockrc"), plans, timeout_s=600.0)


def test_the_planner_gives_chunks_per_block_choices_that_fit() -> None:
    plan, limit, _ = planned()
    assert plan.virtual_stages == 2 and plan.schedule == "interleaved"
    chosen = [stage.stage_index for stage in plan.stages if stage.block_recompute]
    assert chosen and not any(stage.recompute for stage in plan.stages), [s.block_recompute for s in plan.stages]
    assert all(stage.peak_memory_bytes <= limit for stage in plan.stages)
    assert not any(stage.block_recompute for stage in plan.stages if stage.replicas > 1)  # group 0 fits kept


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["planned", "zero1", "zero3"])
def test_chunks_recomputing_per_block_train_exactly_as_one_process(
        setup: tuple[dict[str, Plan], list[dict[str, Any]]], case: str) -> None:
    plans, per_rank = setup
    plan = plans[case]
    for rank, results in enumerate(per_rank):
        record = results[case]
        assert not record["problems"], (rank, record["problems"][:3])
        assert record["losses"] == pytest.approx(record["reference_losses"], rel=1e-5), rank
        # every chunk of this rank whose plan recomputes a block whole runs a checkpointed region, others none
        group = plan.group_of_chunk(plan.stage_of_device(rank)[0])
        for chunk in plan.chunks_of_group(group):
            assert bool(record["regions"][chunk]) == ("block" in plan.stages[chunk].block_recompute), (
                rank, chunk, record["regions"])
    recomputing = {plan.group_of_chunk(s.stage_index) for s in plan.stages if "block" in s.block_recompute}
    assert recomputing == ({1} if case == "planned" else {0, 1}), recomputing
