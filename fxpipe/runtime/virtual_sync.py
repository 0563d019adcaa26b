"""The start-up parameter sync of a virtual-stage rank (``sync_params``): the one-stage sets, per device group and tied weight."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fxpipe.core.plan import Plan
from fxpipe.runtime.gradients.virtual_grads import VirtualGroups
from fxpipe.runtime.sync import SyncSet, check_sync_mode, synchronize


def virtual_sync_sets(named: Sequence[tuple[str, torch.Tensor]], groups: VirtualGroups, plan: Plan,
                      group_index: int) -> list[SyncSet]:
    """Every untied tensor of this rank's chunks over its device group's ranks, then each tied weight over every
    rank of a chunk holding it (the first copy on this rank; :func:`synchronize_chunks` handles the others)."""
    ranks = tuple(sorted(plan.stages[plan.chunks_of_group(group_index)[0]].devices))
    firsts = dict(reversed(named))  # name -> its first tensor on this rank (reversed: the first wins)
    plain = sorted(name for name in firsts if name not in groups.tied_all)
    sets = [SyncSet(f"device group {group_index} (chunks {list(plan.chunks_of_group(group_index))})", ranks,
                    groups.devices, tuple(plain), tuple(firsts[name] for name in plain))]
    for name in sorted(n for n in groups.tied_all if n in firsts):
        group, tied_ranks = groups.tied_all[name]
        sets.append(SyncSet(f"weight {name!r} tied across chunks", tuple(sorted(tied_ranks)), group, (name,),
                            (firsts[name],)))
    return sets


def synchronize_chunks(named: Sequence[tuple[str, torch.Tensor]], groups: VirtualGroups, plan: Plan,
                       group_index: int, mode: str) -> None:
    """Make this rank's chunks start from the same values as its replicas and every holder of a tied weight:
    broadcast from the lowest rank, or (``"verify"``) raise ReplicaMismatchError on every rank of a set that differs,
    as the one-stage runtime does (fxpipe.runtime.sync). Several copies of a tied weight on one rank (chunks of a V)
    start from the first."""
    if check_sync_mode(mode) == "off":
        return
    synchronize(virtual_sync_sets(named, groups, plan, group_index), mode)
    if mode != "broadcast":  # copies on one rank were cut from one Parameter of the caller's model: alike
        return
    firsts: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor in named:
            first = firsts.setdefault(name, tensor)
            if tensor is not first:
                tensor.copy_(first)
