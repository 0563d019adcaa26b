"""Tensor-parallel stage replicas: the process groups, the communicator generated collectives call, and shards.

A stage of ``replicas`` x ``T`` devices runs each replica as a T-way group (``StagePlan.replica_devices``).
Every member receives the whole stage inputs and returns the whole outputs (under sequence parallelism, values between
stages of the same T may cross as token shares: fxpipe/compile_sequence_boundary.py), so stages of different T exchange
values as before (:mod:`fxpipe.runtime.transport.group_routes`). Gradient sums: member ``j`` of every replica
sums with member ``j`` of the others (its own shard, or a whole copy); a replicated parameter whose gradient is
partial over the group (sequence-parallel norms) sums over all the stage's devices instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.core.plan import Plan
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.parallel.traced_collectives import is_fake, traced_all_gather, traced_all_reduce
from fxpipe.runtime.transport.comm import PeerExchange, Pending, new_groups


@dataclass(frozen=True)
class TensorParallelParam:
    """How one parameter of a tensor-parallel stage is held: ``dim`` it is split along (None: whole on every
    member), its ``full_shape``, and whether its gradient is ``partial`` over the group (summed over it)."""

    name: str  # the original model's name
    dim: int | None
    full_shape: tuple[int, ...]
    partial: bool = False
    parts: tuple[int, ...] | None = None  # fused q/k/v: the whole parts' sizes along dim; a member holds 1/T of each


@dataclass(frozen=True)
class TensorParallelGroups:
    """This rank's place in the tensor-parallel layout: ``degree`` T of its stage, its ``member`` index, its
    replica's ``group``, ``replica_sum`` (member ``member`` of every replica of the stage) and per tied stage set
    ``tied_sums`` (member ``member`` of every replica of every owner stage). Single-rank groups are None."""

    degree: int
    member: int
    group: dist.ProcessGroup | None
    replica_sum: dist.ProcessGroup | None
    tied_sums: tuple[dist.ProcessGroup | None, ...]

    @classmethod
    def make(cls, plan: Plan, rank: int, tied_sets: Sequence[tuple[int, ...]]) -> TensorParallelGroups:
        """Every rank creates every group, in the same order (torch.distributed requires it); nothing for T = 1."""
        lists: list[list[int]] = []
        for stage in plan.stages:
            if stage.tensor_parallel > 1:
                lists += [list(stage.replica_devices(r)) for r in range(stage.replicas)]
                lists += [_members(plan, (stage.stage_index,), j) for j in range(stage.tensor_parallel)]
        tied_first = []  # per tied set, the index of its member-0 list (-1: T = 1, no groups)
        for stages in tied_sets:
            degree = _tied_degree(plan, stages)
            tied_first.append(len(lists) if degree > 1 else -1)
            lists += [_members(plan, stages, j) for j in range(degree)] if degree > 1 else []
        created = new_groups(lists)
        stage_index, _ = plan.stage_of_device(rank)
        stage = plan.stages[stage_index]
        if stage.tensor_parallel == 1:
            return cls(1, 0, None, None, ())
        member = stage.devices.index(rank) % stage.tensor_parallel
        first = lists.index(list(stage.replica_devices(0)))  # this stage's lists: R groups, then T member lists
        replica_group = created[first + stage.devices.index(rank) // stage.tensor_parallel]
        tied = tuple(created[index + member] if index >= 0 and stage_index in stages else None
                     for index, stages in zip(tied_first, tied_sets, strict=True))
        return cls(stage.tensor_parallel, member, replica_group, created[first + stage.replicas + member], tied)


def _members(plan: Plan, stages: Sequence[int], member: int) -> list[int]:
    """Ranks of group member ``member`` over every replica of ``stages``."""
    return sorted(plan.stages[s].replica_devices(r)[member] for s in stages for r in range(plan.stages[s].replicas))


def _tied_degree(plan: Plan, stages: Sequence[int]) -> int:
    degrees = sorted({plan.stages[s].tensor_parallel for s in stages})
    if len(degrees) > 1:
        raise PipelineSetupError(
            f"weights are tied across stages {list(stages)} whose tensor-parallel degrees differ "
            f"({[plan.stages[s].tensor_parallel for s in stages]}); a tied weight is summed shard by shard, so give "
            "those stages the same T (layout 'RxT' per stage), or untie the weights")
    return degrees[0]


@dataclass
class GroupCommunicator:
    """The collectives a tensor-parallel GraphModule calls (``fxpipe.passes.tensor_parallel_ops``) over one group.

    Each returns a new tensor; ``counts`` tallies calls by kind (a test compares them with the graph's nodes).
    gloo has no reduce-scatter, so there it is an all-reduce and this member's chunk. With an ``exchange`` (the
    driver's), each collective is waited on there, so stall detection watches it: a member that stops makes the
    others raise naming it instead of blocking in the collective.
    """

    group: dist.ProcessGroup | None
    size: int
    rank: int
    counts: dict[str, int] = field(default_factory=dict)
    exchange: PeerExchange | None = None

    def _count(self, kind: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def _wait(self, work: dist.Work | None, kind: str, tensor: torch.Tensor) -> None:
        if work is not None and self.exchange is not None:
            ranks = dist.get_process_group_ranks(self.group) if self.group is not None else []
            self.exchange.wait([Pending(work, -1, f"tensor-parallel {kind} over ranks {ranks}", tensor)])

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1 and is_fake(tensor):
            return traced_all_reduce(tensor, self.group)
        self._count("all_reduce")
        result = tensor.contiguous().clone()
        if self.size > 1:
            self._wait(dist.all_reduce(result, group=self.group, async_op=self.exchange is not None),
                       "all_reduce", result)
        return result

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return tensor.clone()
        if is_fake(tensor):
            return traced_all_gather(tensor, dim, self.group)
        self._count("all_gather")
        parts = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in range(self.size)]
        self._wait(dist.all_gather(parts, tensor.contiguous(), group=self.group, async_op=self.exchange is not None),
                   "all_gather", parts[0])
        return torch.cat(parts, dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return tensor.clone()
        if is_fake(tensor):
            return traced_all_reduce(tensor, self.group).chunk(self.size, dim)[self.rank].contiguous()
        self._count("reduce_scatter")
        if dist.get_backend(self.group) == "gloo":
            total = tensor.contiguous().clone()
            self._wait(dist.all_reduce(total, group=self.group, async_op=self.exchange is not None),
                       "reduce_scatter", total)
            return total.chunk(self.size, dim)[self.rank].contiguous()
        chunks = [chunk.contiguous() for chunk in tensor.chunk(self.size, dim)]
        result = torch.empty_like(chunks[self.rank])
        self._wait(dist.reduce_scatter(result, chunks, group=self.group, async_op=self.exchange is not None),
                   "reduce_scatter", result)
        return result


def shard_slice(full: torch.Tensor, param: TensorParallelParam, degree: int, member: int) -> torch.Tensor:
    """Member ``member``'s part of a whole tensor (the tensor itself when the parameter is whole everywhere)."""
    if tuple(full.shape) != param.full_shape:
        raise ValueError(f"{param.name!r} has shape {tuple(full.shape)} but the stage holds it as "
                         f"{param.full_shape}; load a state dict of the same model")
    if param.dim is None:
        return full
    parts = full.split(param.parts, param.dim) if param.parts else (full,)
    return torch.cat([part.chunk(degree, param.dim)[member] for part in parts], param.dim)


def gather_full(shard: torch.Tensor, param: TensorParallelParam, groups: TensorParallelGroups) -> torch.Tensor:
    """The whole tensor from every member's shard (a collective over the group; the shard itself when whole)."""
    if param.dim is None or groups.group is None:
        return shard.detach()
    shards = [torch.empty_like(shard, memory_format=torch.contiguous_format) for _ in range(groups.degree)]
    dist.all_gather(shards, shard.detach().contiguous(), group=groups.group)
    return assemble(shards, param)


def assemble(shards: Sequence[torch.Tensor], param: TensorParallelParam) -> torch.Tensor:
    """The whole tensor from every member's :func:`shard_slice`, in member order (fused parts put back part by part)."""
    assert param.dim is not None
    degree = len(shards)
    local_sizes = [size // degree for size in param.parts] if param.parts else [shards[0].shape[param.dim]]
    pieces = [member.split(local_sizes, param.dim) for member in shards]  # per member, its share of each part
    full = torch.cat([piece[index] for index in range(len(local_sizes)) for piece in pieces], param.dim)
    assert tuple(full.shape) == param.full_shape, (param, tuple(full.shape))
    return full


def counts_in_norm(param: TensorParallelParam | None, member: int) -> bool:
    """Whether this member's copy of a parameter enters the whole model's gradient norm: each shard once
    (every member), a whole parameter once (member 0)."""
    return member == 0 or (param is not None and param.dim is not None)


def check_layout_options(plan: Plan, batch_norm: str) -> None:
    """Refuse, on every rank alike, what tensor-parallel stages do not run yet (never a silently wrong result)."""
    stages = [stage.stage_index for stage in plan.stages if stage.tensor_parallel > 1]
    if not stages:
        return
    if batch_norm != "microbatch":
        raise PipelineSetupError(f"batch_norm={batch_norm!r} with tensor-parallel stages {stages} is not supported "
                                 "yet; use batch_norm='microbatch'")


def check_tied_alike(held: Sequence[tuple[int, Mapping[str, TensorParallelParam]]],
                     tie_groups: Sequence[tuple[str, Sequence[int]]]) -> None:
    """Weights tied across stages must be split alike on every owner (their gradients sum shard by shard): one
    gather of every rank's (stage, tied name -> split dim, parts) for each stage it ``held`` (a virtual-stage rank
    holds several chunks); PipelineSetupError on every rank otherwise."""
    tied = {name for name, _ in tie_groups}
    if not tied:
        return
    mine = [(stage_index, {name: (param.dim, param.parts) for name, param in params.items() if name in tied})
            for stage_index, params in held]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    differing = tied_split_differences([item for described in gathered for item in described], tie_groups)
    if differing:
        name, ways = differing[0]
        raise PipelineSetupError(
            f"weight {name!r} is tied across stages {sorted(ways)} but split differently there (stage: (dim, parts) "
            f"{ways}); its gradients sum shard by shard, so untie it or give those stages T = 1")


def tied_split_differences(gathered: Sequence[tuple[int, Mapping[str, Any]]],
                           tie_groups: Sequence[tuple[str, Sequence[int]]]) -> list[tuple[str, dict[int, Any]]]:
    """Tied weights whose owner stages hold them split differently: (name, {stage: (dim, parts)}), by name.
    ``gathered``: every rank's (stage index, {tied name: (dim, parts)}) (a name it lacks: whole)."""
    owners = {name: set(stages) for name, stages in tie_groups}
    held: dict[str, dict[int, Any]] = {}
    for stage, described in gathered:
        for name, stages in owners.items():
            if stage in stages:
                held.setdefault(name, {})[stage] = described.get(name, (None, None))
    return sorted((name, dict(sorted(ways.items()))) for name, ways in held.items() if len(set(ways.values())) > 1)
