"""A step's gradient sums over replicas and tied copies: the process groups and what each sums, earlier steps'
gradients set aside, this step's all-reduced (the overlapped buckets' rest and the reduce sets), then the
earlier ones added back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.core.plan import Plan
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.gradients.buckets import OverlappedAllreduce, Reduction
from fxpipe.runtime.parallel.tensor_parallel import TensorParallelGroups
from fxpipe.runtime.transport.comm import allreduce_async, new_groups

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram

Params = Sequence[tuple[str, torch.nn.Parameter]]
ReduceSets = list[tuple[dist.ProcessGroup, list[torch.nn.Parameter]]]


def tied_stage_sets(program: SplitProgram) -> list[tuple[int, ...]]:
    """The sets of stages sharing a tied weight, sorted (the order their groups are created in)."""
    return sorted({tuple(sorted(stages)) for _, stages in program.tie_groups})


def reduce_groups(plan: Plan, program: SplitProgram) -> list[Any]:
    """Process groups over every stage's devices, then one per set of tied stages over all their devices (None
    where this rank is not a member). Every rank creates every group in the same order (torch.distributed
    requires it)."""
    stage_ranks = [list(stage.devices) for stage in plan.stages]
    tied_ranks = [sorted(d for s in stages for d in plan.stages[s].devices) for stages in tied_stage_sets(program)]
    return new_groups(stage_ranks + tied_ranks)


def reduce_sets(plan: Plan, program: SplitProgram, stage_index: int, params: Params, groups: Sequence[Any],
                tensor_parallel: TensorParallelGroups, partial: frozenset[str] = frozenset()) -> ReduceSets:
    """The (group, parameters) this rank's stage sums its gradients in.

    Tied parameters skip the replica group: one SUM over all ranks of all owner stages already adds
    every replica's and every owner's contribution. On a tensor-parallel stage the sums run per group member
    (``tensor_parallel.replica_sum``, ``tied_sums``: each shard with its own kind), except parameters whose
    gradient is ``partial`` over the group, which sum over all the stage's devices.
    """
    tied_sets = tied_stage_sets(program)
    tied_names = {name: tuple(sorted(stages)) for name, stages in program.tie_groups}
    per_member = tensor_parallel.degree > 1
    sets: ReduceSets = []
    replica_group = tensor_parallel.replica_sum if per_member else groups[stage_index]
    plain = [p for name, p in params if name not in tied_names and name not in partial]
    if replica_group is not None and plain:
        sets.append((replica_group, plain))
    summed_whole = [p for name, p in params if name not in tied_names and name in partial]
    if groups[stage_index] is not None and summed_whole:
        sets.append((groups[stage_index], summed_whole))
    for index, stages in enumerate(tied_sets):
        tied = [p for name, p in params if tied_names.get(name) == stages]
        tied_partial = sorted(name for name, _ in params if tied_names.get(name) == stages and name in partial)
        if tied_partial:
            raise PipelineSetupError(f"tied weights {tied_partial} have gradients partial over "
                                     f"a tensor-parallel group on stage {stage_index}; untie them or use T = 1 there")
        group = tensor_parallel.tied_sums[index] if per_member else groups[len(plan.stages) + index]
        if tied and group is not None:
            sets.append((group, tied))
    return sets


def stash_grads(params: Params) -> dict[int, torch.Tensor | None]:
    """Set aside gradients from earlier steps so the allreduce sums only this step's."""
    stash = {}
    for _, param in params:
        stash[id(param)] = param.grad
        param.grad = None
    return stash


def start_allreduces(overlap: OverlappedAllreduce | None, sets: ReduceSets) -> list[Reduction]:
    """The overlapped buckets not yet launched, then one flat allreduce per (group, dtype) of the reduce sets
    (a parameter without a gradient contributes zeros)."""
    reductions = list(overlap.launch_rest()) if overlap is not None else []
    for group, params in sets:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for tensors in by_dtype.values():
            work, flat = allreduce_async(tensors, group)
            reductions.append((work, flat, tensors))
    return reductions


def restore_stashed(params: Params, stash: dict[int, torch.Tensor | None], keep_this_step: bool) -> None:
    """Add the earlier steps' gradients back; without ``keep_this_step`` this step's are dropped instead."""
    for _, param in params:
        earlier = stash[id(param)]
        if not keep_this_step:
            param.grad = earlier
        elif earlier is not None:
            param.grad = earlier if param.grad is None else param.grad + earlier
