"""The front door's tensor-parallel wiring: shard this rank's stage with the graph pass, give it the runtime's group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fxpipe.runtime.execution.stage import unique_params
from fxpipe.runtime.parallel.tensor_parallel import GroupCommunicator, TensorParallelParam

if TYPE_CHECKING:
    from fxpipe.runtime.execution.driver import PipelineDriver


def group_key(stage_index: int, replica_index: int) -> str:
    """The key generated collectives name their group by (one group per stage replica)."""
    return f"stage{stage_index}.replica{replica_index}"


def shard_for_member(module: torch.fx.GraphModule, named: Sequence[tuple[str, torch.nn.Parameter]], degree: int,
                     member: int, key: str) -> tuple[torch.fx.GraphModule, list[TensorParallelParam]]:
    """Member ``member``'s module of a ``degree``-way stage and how it holds each parameter (original names).

    Until the graph pass lands this is its trivially correct form: every parameter whole on every member,
    the module unchanged (each member computes the whole stage).
    """
    del degree, member, key
    return module, [TensorParallelParam(name, None, tuple(param.shape)) for name, param in named]


def apply_tensor_parallel(driver: PipelineDriver) -> GroupCommunicator | None:
    """Shard this rank's stage over its tensor-parallel group (nothing at T = 1); returns the group's communicator.

    Collective over the group (the shards come from whole tensors every member holds alike after the sync).
    """
    groups = driver.tensor_parallel
    if groups.degree == 1:
        return None
    key = group_key(driver.stage_index, driver.replica_index)
    communicator = GroupCommunicator(groups.group, groups.degree, groups.member)
    module = driver.runner.module
    assert isinstance(module, torch.fx.GraphModule), type(module)
    named = unique_params(driver.runner.parameters())
    sharded, params = shard_for_member(module, named, groups.degree, groups.member, key)
    driver.apply_tensor_parallel(sharded, params)
    driver.tp_communicator = communicator
    return communicator
