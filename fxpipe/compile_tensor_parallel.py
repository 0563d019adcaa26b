"""The front door's tensor-parallel wiring: shard this rank's stage with the graph pass, give it the runtime's group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fxpipe.runtime.parallel.tensor_parallel import GroupCommunicator, TensorParallelParam

if TYPE_CHECKING:
    from fxpipe.runtime.execution.driver import PipelineDriver


def group_key(stage_index: int, replica_index: int) -> str:
    """The key generated collectives name their group by (one group per stage replica)."""
    return f"stage{stage_index}.replica{replica_index}"


# The communicators generated collectives find by group key (the pass's ``register_group`` once it lands).
_COMMUNICATORS: dict[str, GroupCommunicator] = {}


def communicator(key: str) -> GroupCommunicator:
    """The communicator registered for group ``key`` (KeyError naming the keys there are)."""
    if key not in _COMMUNICATORS:
        raise KeyError(f"no tensor-parallel group {key!r} on this rank; registered: {sorted(_COMMUNICATORS)}")
    return _COMMUNICATORS[key]


def shard_for_member(module: torch.fx.GraphModule, param_names: Sequence[tuple[str, str]], degree: int,
                     member: int, key: str) -> tuple[torch.fx.GraphModule, list[TensorParallelParam]]:
    """Member ``member``'s module of a ``degree``-way stage and how it holds each parameter (original names;
    ``param_names``: the stage's (attribute path, original name) pairs; ``key``: its group's communicator).

    Until the graph pass lands this is its trivially correct form: every parameter whole on every member,
    the module unchanged (each member computes the whole stage).
    """
    del degree, member, key
    return module, whole_parameters(module, param_names)


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


def apply_tensor_parallel(driver: PipelineDriver) -> GroupCommunicator | None:
    """Shard this rank's stage over its tensor-parallel group (nothing at T = 1); returns the group's communicator.

    Collective over the group (the shards come from whole tensors every member holds alike after the sync).
    """
    groups = driver.tensor_parallel
    if groups.degree == 1:
        return None
    key = group_key(driver.stage_index, driver.replica_index)
    made = GroupCommunicator(groups.group, groups.degree, groups.member)
    module = driver.runner.module
    assert isinstance(module, torch.fx.GraphModule), type(module)
    _COMMUNICATORS[key] = made
    sharded, params = shard_for_member(module, driver.stage.param_names, groups.degree, groups.member, key)
    driver.apply_tensor_parallel(sharded, params)
    driver.tp_communicator = made
    return made
