"""Gradient sums and the start-up parameter sync of a rank running several chunks: per device group, per tied weight."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.core.plan import Plan
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
    """The process groups of a virtual-stage job: one per device group (its replicas: every chunk of the group
    sums over it), then one per tied weight over the devices of every chunk holding it. Every rank creates every
    group in the same order (torch.distributed requires it); None where this rank is not a member or alone."""

    replicas: dist.ProcessGroup | None  # this rank's device group
    tied: dict[str, tuple[dist.ProcessGroup | None, tuple[int, ...]]]

    @classmethod
    def make(cls, plan: Plan, program: SplitProgram, group_index: int) -> VirtualGroups:
        per_group = [list(plan.stages[plan.chunks_of_group(g)[0]].devices) for g in range(plan.num_groups)]
        tied = tied_rank_sets(plan, program)
        made = new_groups(per_group + [list(ranks) for _, ranks in tied])
        return cls(made[group_index], {name: (made[plan.num_groups + i], ranks) for i, (name, ranks) in enumerate(tied)})


def sum_gradients(named: Named, groups: VirtualGroups, exchange: PeerExchange, what: str) -> None:
    """Sum this step's gradients as one process would have them: each untied parameter over its group's replicas
    (one allreduce), each tied weight first over its copies on this rank (a V holds the first and last chunk on
    one group) and then over every rank holding one; every copy then holds the sum. A parameter without a
    gradient counts as zeros (the flat buffers must match across ranks)."""
    tied: dict[str, list[torch.nn.Parameter]] = {}
    plain: list[torch.nn.Parameter] = []
    for name, param in named:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        (tied.setdefault(name, []) if name in groups.tied else plain).append(param)
    pending: list[tuple[Any, torch.Tensor, list[torch.Tensor], bool]] = []  # (work, flat, into, each copy whole)
    if groups.replicas is not None and plain:
        grads = [p.grad for p in plain if p.grad is not None]
        work, flat = allreduce_async(grads, groups.replicas)
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


def broadcast_state(named: Sequence[tuple[str, torch.Tensor]], groups: VirtualGroups, plan: Plan,
                    group_index: int) -> None:
    """Start every replica from its group's first device's values, and every copy of a tied weight from the lowest
    rank holding one (``sync_params="broadcast"``; all ranks call it)."""
    ranks = plan.stages[plan.chunks_of_group(group_index)[0]].devices
    with torch.no_grad():
        plain = [tensor for name, tensor in named if name not in groups.tied]
        if groups.replicas is not None and plain:
            flat = torch.cat([t.detach().reshape(-1).to(plain[0].dtype) for t in plain]) if _one_dtype(plain) else None
            if flat is None:
                for tensor in plain:
                    dist.broadcast(tensor.data, src=min(ranks), group=groups.replicas)
            else:
                dist.broadcast(flat, src=min(ranks), group=groups.replicas)
                unflatten_into(flat, [t.data for t in plain])
        for name in sorted(groups.tied):
            copies = [tensor for n, tensor in named if n == name]
            group, tied_ranks = groups.tied[name]
            if group is not None and copies:
                dist.broadcast(copies[0].data, src=min(tied_ranks), group=group)
            for tensor in copies[1:]:
                tensor.data.copy_(copies[0].data)


def _one_dtype(tensors: Sequence[torch.Tensor]) -> bool:
    return len({t.dtype for t in tensors}) == 1
