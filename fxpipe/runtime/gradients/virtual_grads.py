"""Gradient sums and the start-up parameter sync of a rank running several chunks: per device group, per tied weight."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.core.plan import Plan
from fxpipe.runtime.parallel.tensor_parallel import TensorParallelGroups, _members, _tied_degree
from fxpipe.runtime.transport.comm import PeerExchange, Pending, allreduce_async, new_groups, unflatten_into

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram

Named = Sequence[tuple[str, torch.nn.Parameter]]


def tied_rank_sets(plan: Plan, program: SplitProgram) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, ranks)`` of every tied weight: all devices of all chunks holding it, sorted by name."""
    return sorted((name, tuple(sorted({d for c in chunks for d in plan.stages[c].devices})))
                  for name, chunks in program.tie_groups)


@dataclass
class VirtualGroups:
    """The process groups of a virtual-stage job. Per device group: ``devices`` (all its ranks: the start-up sync,
    gradients partial over a tensor-parallel group) and ``replicas`` (what every chunk of the group sums its
    gradients over: its replicas, or on T-way groups member ``j`` of every replica); per tied weight ``tied`` (the
    ranks of every chunk holding it, member-wise under T > 1: each shard sums with its own kind) and ``tied_all``
    (all those ranks: the start-up sync); and ``tensor_parallel``, this rank's T-way group (degree 1 at T = 1).
    Every rank creates every group in the same order (torch.distributed requires it); identical rank lists share one
    group; None where this rank is not a member or alone."""

    replicas: dist.ProcessGroup | None  # this rank's device group (member-wise under T > 1)
    tied: dict[str, tuple[dist.ProcessGroup | None, tuple[int, ...]]]
    devices: dist.ProcessGroup | None = None
    tied_all: dict[str, tuple[dist.ProcessGroup | None, tuple[int, ...]]] = field(default_factory=dict)
    tensor_parallel: TensorParallelGroups = TensorParallelGroups(1, 0, None, None, ())

    @classmethod
    def make(cls, plan: Plan, program: SplitProgram, group_index: int) -> VirtualGroups:
        rank = dist.get_rank()
        firsts = [plan.stages[plan.chunks_of_group(g)[0]] for g in range(plan.num_groups)]
        tied = tied_rank_sets(plan, program)
        tied_chunks = dict(program.tie_groups)
        mine = firsts[group_index]
        degree, member = mine.tensor_parallel, mine.devices.index(rank) % mine.tensor_parallel
        replica = mine.devices.index(rank) // degree
        # per group: all devices, each replica's T members, member j of every replica; per tied weight: all its
        # ranks, then member j of every replica of every chunk holding it (one T: _tied_degree refuses others)
        lists = [list(s.devices) for s in firsts] + [list(ranks) for _, ranks in tied]
        lists += [list(mine.replica_devices(replica)), _member_ranks(plan, (mine.stage_index,), member)]
        lists += [_member_ranks(plan, tied_chunks[name], member % _tied_degree(plan, tied_chunks[name])) for name, _ in tied]
        made = _distinct_groups(lists, plan, tied_chunks)
        num_groups, num_tied = plan.num_groups, len(tied)
        per_member = made[num_groups + num_tied:]
        return cls(per_member[1], {name: (per_member[2 + i], tuple(lists[num_groups + num_tied + 2 + i]))
                                   for i, (name, _) in enumerate(tied)},
                   made[group_index], {name: (made[num_groups + i], ranks) for i, (name, ranks) in enumerate(tied)},
                   TensorParallelGroups(degree, member, per_member[0], per_member[1], ()))


def _member_ranks(plan: Plan, chunks: Sequence[int], member: int) -> list[int]:
    """Ranks of group member ``member`` over every replica of ``chunks`` (chunks of one group share their ranks)."""
    return sorted(set(_members(plan, chunks, member)))


def _distinct_groups(lists: Sequence[Sequence[int]], plan: Plan,
                     tied: Mapping[str, Sequence[int]]) -> list[dist.ProcessGroup | None]:
    """One group per rank list, identical lists sharing one. The lists differ per rank (its own replica and
    member), so every rank creates, in one sorted order, every rank's lists: each device group's replica and
    member lists and each tied weight's member lists; then it picks its own."""
    every: set[tuple[int, ...]] = {tuple(sorted(ranks)) for ranks in lists}
    for g in range(plan.num_groups):
        first = plan.stages[plan.chunks_of_group(g)[0]]
        every |= {tuple(sorted(first.replica_devices(r))) for r in range(first.replicas)}
        every |= {tuple(_member_ranks(plan, (first.stage_index,), j)) for j in range(first.tensor_parallel)}
    for chunks in tied.values():
        every |= {tuple(_member_ranks(plan, chunks, j)) for j in range(_tied_degree(plan, chunks))}
    ordered = sorted(every)
    created = dict(zip(ordered, new_groups([list(ranks) for ranks in ordered]), strict=True))
    return [created[tuple(sorted(ranks))] for ranks in lists]


def sum_gradients(named: Named, groups: VirtualGroups, exchange: PeerExchange, what: str,
                  partial: frozenset[str] = frozenset()) -> None:
    """Sum this step's gradients as one process would have them: each untied parameter over its group's replicas
    (one allreduce; a tensor-parallel shard with its own kind, a gradient ``partial`` over a tensor-parallel group
    over all the group's devices), each tied weight first over its copies on this rank (a V holds the first and
    last chunk on one group) and then over every rank holding one; every copy then holds the sum. A parameter
    without a gradient counts as zeros (the flat buffers must match across ranks)."""
    tied: dict[str, list[torch.nn.Parameter]] = {}
    plain: list[torch.nn.Parameter] = []
    summed_whole: list[torch.nn.Parameter] = []
    for name, param in named:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        (tied.setdefault(name, []) if name in groups.tied else summed_whole if name in partial else plain).append(param)
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor], bool]] = []  # (work, flat, into, each copy whole)
    for group, params in ((groups.replicas, plain), (groups.devices, summed_whole)):
        if group is not None and params:
            grads = [p.grad for p in params if p.grad is not None]
            work, flat = allreduce_async(grads, group)
            pending.append((work, flat, grads, False))
    for name in sorted(tied):  # every member walks the tied weights in the same order
        copies = [p.grad for p in tied[name] if p.grad is not None]
        total = copies[0] if len(copies) == 1 else torch.stack(copies).sum(0)
        group = groups.tied[name][0]
        if group is not None:
            work, flat = allreduce_async([total], group)
            pending.append((work, flat, copies, True))
        else:
            for grad in copies if len(copies) > 1 else []:  # one copy alone holds its sum already
                grad.copy_(total)
    for work, flat, into, whole in pending:
        exchange.wait([Pending(work, -1, f"gradient allreduce of {what}", flat)])
        for tensors in ([[t] for t in into] if whole else [into]):
            unflatten_into(flat, tensors)
