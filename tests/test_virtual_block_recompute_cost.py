"""Per-block recompute on virtual-stage chunks: the virtual simulator against tests/reference_virtual_sim.py and
against the same blocks as a stage without virtual stages, and the virtual planner's per-chunk choices."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from reference_virtual_sim import reference_virtual_run
from test_virtual_sharded_cost import SCHEDULES, _chain, _cluster, _durations, _plans
from test_virtual_simulate import random_virtual_setup

from fxpipe.core.chain import CostChain
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan
from fxpipe.sim.simulate import simulate
from fxpipe.sim.virtual_simulate import simulate_virtual

CHOICES = ("keep", "attention", "block")


def with_cores(chain: CostChain, seed: int) -> CostChain:
    """``chain`` whose blocks have an attention core of a random share of their saved bytes and forward time."""
    rng = random.Random(seed)
    blocks = []
    for block in chain.blocks:
        share = rng.choice([0.0, 0.3, 0.6])
        blocks.append(replace(block, attention_core_bytes=Affine(0.0, block.saved_bytes.per_sample * share),
                              attention_core_s=Affine(0.0, block.forward_s.per_sample * share)))
    return replace(chain, blocks=tuple(blocks))


def with_block_choices(plan: Plan, seed: int) -> Plan:
    """``plan`` whose chunks that do not recompute whole take random per-block choices (some chunks none)."""
    rng = random.Random(seed)
    stages = []
    for stage in plan.stages:
        choices = tuple(rng.choice(CHOICES) for _ in range(stage.stop_block - stage.first_block))
        if stage.recompute or rng.random() < 0.25 or set(choices) == {"keep"}:
            stages.append(stage)
            continue
        stages.append(replace(stage, block_recompute=choices))
    return plan.with_updates(stages=tuple(stages))


def test_simulator_charges_chunk_block_recompute_as_the_reference_does() -> None:
    chosen = 0
    for seed in range(60):
        plan, chain, net, options = random_virtual_setup(seed)
        chain = with_cores(chain, seed)
        plan = with_block_choices(plan, seed)
        chosen += sum(bool(stage.block_recompute) for stage in plan.stages)
        weight_share = float(options.pop("weight_fraction"))
        optimizer = str(options["optimizer"])
        expected = reference_virtual_run(plan, chain, net, optimizer=optimizer, weight_share=weight_share)
        result = simulate_virtual(plan, chain, net, optimizer=optimizer, weight_fraction=weight_share)
        where = f"seed {seed}: {plan.schedule} {plan.layout} {[s.block_recompute for s in plan.stages]}"
        assert result.iteration_time_s == pytest.approx(expected.iteration_time_s, rel=1e-9), where
        assert dict(zip(result.devices, result.busy_s, strict=True)) == pytest.approx(expected.busy, rel=1e-9), where
        assert list(result.peak_memory_bytes) == expected.peak_memory_bytes, where
    assert chosen > 60  # the draws give chunks choices


@pytest.mark.parametrize("level", ["none", "optimizer", "parameters"])
@pytest.mark.parametrize("degree", [1, 2])
@pytest.mark.parametrize("choice", ["block", "attention"])
def test_a_chunk_with_block_choices_is_priced_as_the_same_stage(level: str, degree: int, choice: str) -> None:
    """Chunks 0 and 2 (group 0) recompute per block: each F and B takes what the same blocks' stage of a plan without
    virtual stages takes with the same choices, and the choices add time and take memory off group 0 alike."""
    chain = with_cores(_chain(degree > 1), 1)
    chain = replace(chain, blocks=tuple(replace(b, attention_core_bytes=Affine(0.0, 4e3), attention_core_s=Affine(
        0.0, 4e-4)) for b in chain.blocks))
    net = _cluster()
    virtual, plain = _plans(level, degree, SCHEDULES[0])

    def chosen(plan: Plan) -> Plan:
        return plan.with_updates(stages=tuple(replace(s, block_recompute=(choice,)) if s.stage_index % 2 == 0 else s
                                              for s in plan.stages))

    chunked, flat = simulate_virtual(chosen(virtual), chain, net), simulate(chosen(plain), chain, net)
    kept = simulate_virtual(virtual, chain, net)
    for chunk in (0, 2):
        mine = _durations(chunked, 0)
        theirs = _durations(flat, chunk * 2 * degree)
        for op in ("F", "B"):
            assert mine[chunk, op] == theirs[chunk, op], (chunk, op)
        assert max(mine[chunk, "B"]) > max(_durations(kept, 0)[chunk, "B"])
    assert chunked.peak_memory_bytes[0] < kept.peak_memory_bytes[0]
    assert chunked.peak_memory_bytes[1] == kept.peak_memory_bytes[1]
