"""Mixed-precision parameters (precision ``bf16-params``) as data: its names, the bytes per parameter each sharding
level holds (fp32 master 4 + bf16 copy 2 + fp32 gradient 4 + Adam 8), the all-gather moving bf16 weights, and the
planner and the simulator charging the same figures for a plan in that precision."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from test_oracle_simulate import assert_agrees, rich_setup

from fxpipe.cli import _build_parser as build_parser
from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.precision import (
    PrecisionError,
    autocast_dtype_name,
    param_copy_fraction,
    param_dtype_name,
    precision_of_dtype,
)
from fxpipe.core.sharding import SHARDING_LEVELS
from fxpipe.planning import plan_chain
from fxpipe.sim.sharding_cost import sharding_comm
from fxpipe.sim.sharding_memory import model_state_bytes
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import optimizer_factor

ADAM = optimizer_factor("adam")  # bytes kept per weight byte: weights, gradients, two moments


def test_bf16_params_is_bf16_autocast_with_bf16_copies_of_fp32_masters() -> None:
    assert autocast_dtype_name("bf16-params") == autocast_dtype_name("bf16") == "bfloat16"
    assert param_dtype_name("bf16-params") == "bfloat16" and param_dtype_name("bf16") is None
    assert param_copy_fraction("bf16-params") == 2 / 4 and param_copy_fraction("fp32") == 0.0
    assert precision_of_dtype("bfloat16") == "bf16"
    assert precision_of_dtype("bfloat16", "bfloat16") == "bf16-params"
    with pytest.raises(PrecisionError, match="param_dtype=torch.bfloat16 with autocast_dtype=torch.bfloat16"):
        precision_of_dtype(None, "bfloat16")
    for command in (["plan", "gpt-mini", "--cluster", "local:2", "--global-batch", "4"],):
        assert build_parser().parse_args([*command, "--precision", "bf16-params"]).precision == "bf16-params"


def test_bytes_per_parameter_of_each_level() -> None:
    """N parameters, P = 4 N bytes of fp32 masters, Adam: unsharded 4 + 2 + 4 + 8 = 18 bytes per parameter (16
    without the copy); a sharded level keeps the fp32 shards and state (16 N / r) plus what it gathers in bf16."""
    num_params, replicas = 1000, 4
    masters = 4.0 * num_params
    assert model_state_bytes(masters, ADAM, "none", param_copy_fraction=0.5) == 18 * num_params
    assert model_state_bytes(masters, ADAM, "none") == 16 * num_params
    assert model_state_bytes(masters, ADAM, "parameters", 1, 3, param_copy_fraction=0.5) == 18 * num_params
    unit = masters / 8  # eight blocks
    # ZeRO-3, M >= 2: fp32 shards + state 16 N / r, four bf16 unit buffers (2 bytes) and one fp32 reduce-scatter input
    zero3 = model_state_bytes(masters, ADAM, "parameters", replicas, 3, unit, param_copy_fraction=0.5)
    assert zero3 == 16 * num_params / replicas + 4 * 2 * num_params / 8 + 4 * num_params / 8
    # ZeRO-1, M >= 2: bf16 weights (2 N) and fp32 accumulated gradients (4 N) whole, shards + state 12 N / r,
    # one unit's bf16 gradients
    zero1 = model_state_bytes(masters, ADAM, "optimizer", replicas, 3, unit, param_copy_fraction=0.5)
    assert zero1 == 6 * num_params + 12 * num_params / replicas + 2 * num_params / 8
    # without copies the fp32 tables are unchanged (fxpipe.sim.sharding_memory)
    assert model_state_bytes(masters, ADAM, "parameters", replicas, 3, unit) == \
        16 * num_params / replicas + 5 * 4 * num_params / 8


def _net(memory_bytes: int = 2**40) -> Cluster:
    device = DeviceSpec("dev", memory_bytes, (("float32", 1e13), ("bfloat16", 1e14)), 1e12)
    return Cluster("net", 1, 4, device, LinkSpec(1e9, 1e-5), LinkSpec(1e8, 1e-4))


def test_the_all_gather_moves_bf16_weights_and_the_reduce_scatter_fp32_gradients() -> None:
    net = _net()
    for level in ("optimizer", "gradients", "parameters"):
        mixed = sharding_comm(net, level, (0, 1, 2, 3), 4e8, 4e8, 4, param_copy_fraction=0.5)
        assert mixed == sharding_comm(net, level, (0, 1, 2, 3), 2e8, 4e8, 4)  # half the weight bytes gathered
        assert mixed != sharding_comm(net, level, (0, 1, 2, 3), 4e8, 4e8, 4)


def _layers(num_blocks: int, param_bytes: int) -> CostChain:
    blocks = tuple(Block(f"b{i}", (f"n{i}",), Affine(0.0, 1e-3), Affine(0.0, 2e-3), param_bytes, Affine(0.0, 1e3))
                   for i in range(num_blocks))
    return CostChain(blocks, tuple(Affine(0.0, 1e3) for _ in range(num_blocks - 1)), Affine(0, 1e3), Affine(0, 1e2))


@pytest.mark.parametrize("level", ["none", "optimizer", "gradients", "parameters"])
def test_the_planner_and_the_simulator_charge_the_policy(level: str) -> None:
    """A plan made in bf16-params predicts what the simulator gives for it, on the chain as measured (the
    simulator takes the precision from the plan); its weights' bytes are the policy's, not fp32's."""
    chain, net = _layers(4, 10**8), _net()
    plan = plan_chain(chain, net, 16, precision="bf16-params", layout="dp", sharding=level, num_microbatches=4)
    assert plan.precision == "bf16-params" and plan.stages[0].sharding == level
    simulated = simulate(plan, chain, net)
    assert plan.predicted is not None
    assert [stage.peak_memory_bytes for stage in plan.stages] == list(simulated.peak_memory_bytes)
    assert plan.predicted.iteration_time_s == pytest.approx(simulated.iteration_time_s, rel=1e-9)
    fp32 = simulate(plan.with_updates(precision="fp32"), chain, net)
    masters, unit = 4e8, 1e8
    kept = plan.stages[0].reshard_after_forward  # a forced ZeRO-3 stage keeps its weights where they fit
    state = {fraction: model_state_bytes(masters, ADAM, level, 4, 4, unit, kept, param_copy_fraction=fraction)
             for fraction in (0.0, 0.5)}
    assert simulated.peak_memory_bytes[0] - fp32.peak_memory_bytes[0] == pytest.approx(state[0.5] - state[0.0], abs=1)
    if level != "none":  # the all-gathers move half the bytes
        assert simulated.iteration_time_s < fp32.iteration_time_s


@pytest.mark.parametrize("first_seed", [0, 100])
def test_the_simulator_matches_the_reference_under_the_policy(first_seed: int) -> None:
    """Random hybrid plans with random levels, in bf16-params: the simulator against tests/reference_sim.py (its
    memory itemised buffer by buffer with their dtypes in tests/reference_mixed_memory.py) on time and memory."""
    for seed in range(first_seed, first_seed + 40):
        plan, chain, net, options = rich_setup(seed)
        pick = random.Random(seed + 7 * 10**6)
        stages = tuple(replace(stage, sharding=pick.choice(SHARDING_LEVELS) if stage.replicas > 1 else "none")
                       for stage in plan.stages)
        plan = plan.with_updates(stages=stages, precision="bf16-params")
        mixed_chain = replace(chain, param_copy_fraction=0.5)
        where = f"seed {seed}: {plan.layout} {[s.sharding for s in stages]} {plan.schedule}, {options}"
        assert_agrees(plan, mixed_chain, net, where, **options)
        assert simulate(plan, chain, net).peak_memory_bytes == simulate(plan, mixed_chain, net).peak_memory_bytes
