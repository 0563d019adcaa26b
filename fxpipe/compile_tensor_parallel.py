"""The front door's tensor-parallel wiring: shard this rank's stage with the graph pass, give it the runtime's group."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fxpipe.passes.tensor_parallel_ops import register_group
from fxpipe.passes.tp_shard import shard_stage
from fxpipe.runtime.faults.guard import release_group, setup_group, setup_phase
from fxpipe.runtime.parallel.tensor_parallel import GroupCommunicator, TensorParallelParam, check_tied_alike

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram, StageProgram
    from fxpipe.runtime.execution.driver import PipelineDriver


def group_key(stage_index: int, replica_index: int) -> str:
    """The key generated collectives name their group by (one group per stage replica)."""
    return f"stage{stage_index}.replica{replica_index}"


def shard_for_member(module: torch.fx.GraphModule, stage: StageProgram, program: SplitProgram, degree: int,
                     member: int, key: str, sequence_parallel: bool = False,
                     ) -> tuple[torch.fx.GraphModule, list[TensorParallelParam], tuple[str, ...]]:
    """Member ``member``'s module of a ``degree``-way stage (the graph pass ``shard_stage``, on the stage's inputs
    at the plan's shapes), how it holds each parameter under its original name, and the pass's notes. Its
    collectives call group ``key``'s communicator."""
    example = [torch.zeros(spec.shape, dtype=spec.dtype) if spec.is_tensor else None
               for spec in (program.values[name] for name in stage.input_values)]
    # on a copy: the pass shares whole layers with its input, which must stay the program's plain stage (fake-tensor
    # shape runs and export use it) when FSDP2 later turns the member's parameters into DTensors
    sharded = shard_stage(copy.deepcopy(module), degree, member, group_key=key, example_inputs=example,
                          sequence_parallel=sequence_parallel)
    param_names = stage.param_names
    original = dict(param_names)
    params = [TensorParallelParam(original.get(param.path, param.name), param.dim, param.full_shape,
                                  param.partial_grad, param.parts) for param in sharded.parameters]
    described = {param.name for param in params}  # anything the pass did not describe is whole on every member
    params += [param for param in whole_parameters(sharded.module, param_names) if param.name not in described]
    return sharded.module, params, sharded.notes


def whole_parameters(module: torch.nn.Module, param_names: Sequence[tuple[str, str]]) -> list[TensorParallelParam]:
    """Every parameter of ``module`` described as whole on every member, by original name."""
    params = dict(module.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    described = []
    for path, original in param_names:
        if path in params and original not in seen:
            seen.add(original)
            described.append(TensorParallelParam(original, None, tuple(params[path].shape)))
    return described


def apply_tensor_parallel(driver: PipelineDriver, sequence_parallel: bool = False) -> GroupCommunicator | None:
    """Shard this rank's stage over its tensor-parallel group; returns the group's communicator (None at T = 1).

    Every rank of a plan with tensor-parallel stages joins one setup phase: the pass runs no collective, and a
    rank it fails on tells the others instead of leaving them waiting (shards come from the synced whole tensors).
    """
    if all(stage.tensor_parallel == 1 for stage in driver.plan.stages):
        return None
    groups = driver.tensor_parallel
    made = GroupCommunicator(groups.group, groups.degree, groups.member) if groups.degree > 1 else None
    setup = setup_group()
    try:
        with setup_phase("tensor-parallel sharding", setup):
            if made is not None:
                key = group_key(driver.stage_index, driver.replica_index)
                register_group(key, made)
                module = driver.runner.module
                assert isinstance(module, torch.fx.GraphModule), type(module)
                sharded, params, notes = shard_for_member(module, driver.stage, driver.program, groups.degree,
                                                          groups.member, key, sequence_parallel)
                driver.apply_tensor_parallel(sharded, params)
                driver.tp_notes = notes
    finally:
        release_group(setup)
    check_tied_alike(driver.stage_index, driver.tp_params, driver.program.tie_groups)
    driver.tp_communicator = made
    return made
