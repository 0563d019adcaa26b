"""A pipeline driver's tensor-parallel part: its group layout, the shard it runs, and whole/part tensors by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from fxpipe.runtime.parallel.sharded_stage import ShardedStage, full_value
from fxpipe.runtime.parallel.tensor_parallel import (
    GroupCommunicator,
    TensorParallelGroups,
    TensorParallelParam,
    gather_full,
    shard_slice,
)


class TensorParallelDriver:
    """Mixin of fxpipe.runtime.execution.driver.PipelineDriver: what a tensor-parallel stage adds to a driver. The
    driver supplies ``_use_stage_module`` (run a new module) and ``_set_reductions`` (its gradient sums)."""

    tensor_parallel: TensorParallelGroups  # T-way groups of tensor-parallel stages (tensor_parallel.py)
    sharded: ShardedStage | None
    tp_params: dict[str, TensorParallelParam]  # by original name, once apply_tensor_parallel ran
    tp_communicator: GroupCommunicator | None  # what the stage's generated collectives call
    tp_notes: tuple[str, ...]  # what the tensor-parallel pass split and kept whole on this stage
    token_split: Mapping[str, int] = MappingProxyType({})  # value -> T of boundary values sent and received as token shares
    _precisions: dict[Any, Any]  # the driver's layouts per autocast dtype
    autocast_dtype: torch.dtype | None

    def _init_tensor_parallel(self, groups: TensorParallelGroups) -> None:
        self.tensor_parallel = groups
        self.tp_params = {}
        self.tp_communicator = None
        self.tp_notes = ()
        self.token_split = {}

    def _use_stage_module(self, module: torch.fx.GraphModule) -> None:
        raise NotImplementedError

    def _set_reductions(self, partial: frozenset[str]) -> None:
        raise NotImplementedError

    def use_autocast(self, dtype: torch.dtype | None) -> None:
        raise NotImplementedError

    def apply_tensor_parallel(self, module: torch.fx.GraphModule, params: Sequence[TensorParallelParam],
                              token_split: Mapping[str, int] | None = None) -> None:
        """Run this group member's shard of the stage (``module``, the same attribute paths; ``params`` says how
        each parameter is held): after the parameter sync, which runs on whole tensors. ``token_split``: value ->
        T of the boundary values the shard takes or leaves split over the tokens (its messages carry 1/T)."""
        assert self.tensor_parallel.degree > 1 and self.sharded is None
        self._use_stage_module(module)  # a compiled stage is compiled again on the shard (fxpipe.api)
        self.tp_params = {param.name: param for param in params}
        self._set_reductions(frozenset(param.name for param in params if param.partial))
        if token_split:  # the layouts made so far carry whole values: make them again
            self.token_split = dict(token_split)
            self._precisions.clear()
            self.use_autocast(self.autocast_dtype)

    def whole(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Stage tensor ``name`` (original name) whole, detached: gathered over a sharded stage's replicas or a
        tensor-parallel group (a collective there, every member calls it)."""
        param = self.tp_params.get(name)  # a tensor-parallel shard may be FSDP2-sharded over the replicas too
        return gather_full(full_value(tensor), param, self.tensor_parallel) if param is not None else full_value(tensor)

    def part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This group member's part of whole tensor ``name`` (the whole tensor unless tensor-parallel sharded)."""
        param = self.tp_params.get(name)
        return shard_slice(full, param, self.tensor_parallel.degree, self.tensor_parallel.member) if param else full
