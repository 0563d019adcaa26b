"""Gathering a pipelined model for export: every stage's (or chunk's) trained tensors and train/eval flag, on rank 0."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fxpipe.runtime.execution.stage import rank_runners
from fxpipe.runtime.numerics.batchnorm import original_layers
from fxpipe.runtime.parallel.sharded_stage import plain_copy

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram
    from fxpipe.runtime.execution.driver import PipelineDriver

# (stage index, training flag, tensors by original name) from the first replica of each stage
StageState = tuple[int, bool, dict[str, torch.Tensor]]


def _module_tensors(module: torch.nn.Module, param_names: tuple[tuple[str, str], ...]) -> dict[str, torch.Tensor]:
    tensors = {}
    for path, original in param_names:
        owner_path, _, attribute = path.rpartition(".")
        value = getattr(module.get_submodule(owner_path) if owner_path else module, attribute)
        if isinstance(value, torch.Tensor):
            tensors[original] = value
    return tensors


def gathered_program(driver: PipelineDriver) -> SplitProgram | None:
    """On rank 0, a copy of the program holding every stage's trained tensors and train/eval flag; None elsewhere.

    Collective (every rank calls it). Each rank holds only its own stage's trained tensors and flag (under virtual
    stages, its chunks'); its copies of the other stages keep the weights they were compiled with. The first
    replica of every stage sends its state to rank 0 (a rank-0-only export wrote the other stages' initial weights
    and flags, silently).
    """
    runners = rank_runners(driver)  # a VirtualDriver's chunks, or the one stage
    with contextlib.ExitStack() as stack:
        mine: list[StageState] = []
        for index, runner in runners.items():
            # batch_norm="deferred"/"sync" layers: the model's own ones, same tensors
            stack.enter_context(original_layers(runner.module))
            # every replica gathers a sharded stage's weights (a collective over them); the first one sends
            # a tensor-parallel group gathers its shards (a collective over the group)
            tensors = {k: driver.whole(k, v)
                       for k, v in _module_tensors(runner.module, driver.program.stages[index].param_names).items()}
            if driver.replica_index == 0 and driver.tensor_parallel.member == 0:
                mine.append((index, runner.module.training, {k: v.cpu() for k, v in tensors.items()}))
        gathered: list[list[StageState] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if driver.rank != 0:
            return None
        # a tensor-parallel shard is no stage module: the program's unsharded one takes the gathered tensors
        own = {index: runner.module if driver.tensor_parallel.degree == 1 else driver.program.stages[index].module
               for index, runner in runners.items()}
        return _with_states(driver.program, own, [state for states in gathered for state in states or []])


def _with_states(program: SplitProgram, own: Mapping[int, torch.nn.Module], gathered: list[StageState]) -> SplitProgram:
    """A copy of ``program`` whose stage modules hold each stage's gathered tensors and training flag (``own``: this
    rank's stage modules by index, copied rather than the program's)."""
    states = {state[0]: state for state in gathered}
    missing = sorted(set(range(program.num_stages)) - set(states))
    assert not missing, f"no first replica reported stages {missing}"
    stages = []
    for stage in program.stages:
        module = plain_copy(own[stage.stage_index]) if stage.stage_index in own else copy.deepcopy(stage.module)
        assert isinstance(module, torch.fx.GraphModule), type(module)
        materialize(module)  # a tensor-parallel member's unsharded stage holds placeholders (release_unsharded)
        _, training, tensors = states[stage.stage_index]
        with torch.no_grad():
            for name, tensor in _module_tensors(module, stage.param_names).items():
                tensor.copy_(tensors[name])
        module.train(training)
        stages.append(dataclasses.replace(stage, module=module))
    return dataclasses.replace(program, stages=tuple(stages))


def materialize(module: torch.nn.Module) -> None:
    """Give each meta-device parameter of ``module`` uninitialised CPU storage, in place (the caller fills it)."""
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is not None and param.is_meta:
                submodule._parameters[name] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                                 requires_grad=param.requires_grad)
