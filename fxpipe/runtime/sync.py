"""One starting point: every stage's replicas and every tie group take parameters and buffers from one rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.transport.batchcheck import data_digest

if TYPE_CHECKING:
    from fxpipe.runtime.execution.driver import PipelineDriver

SYNC_MODES = ("broadcast", "verify", "off")


class ReplicaMismatchError(PipelineSetupError):
    """``sync_params="verify"``: replicas of a stage (or owners of a tied weight) hold different values."""


@dataclass(frozen=True)
class SyncSet:
    """Tensors (sorted by original name) that ``ranks`` must hold alike, over ``group`` (None: this rank alone)."""

    what: str
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]


def check_sync_mode(mode: str) -> str:
    if mode not in SYNC_MODES:
        raise PipelineSetupError(f"sync_params={mode!r} is unknown; choose 'broadcast' (copy from the lowest "
                                 "rank, as DDP does), 'verify' (fail on any difference) or 'off'")
    return mode


def sync_sets(named: Sequence[tuple[str, torch.Tensor]], tied: dict[str, tuple[int, ...]],
              stage_index: int, stage_ranks: Sequence[Sequence[int]],
              groups: Sequence[dist.ProcessGroup | None]) -> list[SyncSet]:
    """The stage's own set (every untied tensor, over the replica group), then one set per tied stage set.

    ``groups`` are the driver's process groups: one per stage, then one per sorted tuple of tied
    stages in sorted order (see ``PipelineDriver._make_reduce_sets``).
    """
    tied_sets = sorted(set(tied.values()))
    by_name = dict(sorted(named))
    plain = [name for name in by_name if name not in tied]
    sets = [SyncSet(f"stage {stage_index}", tuple(stage_ranks[stage_index]), groups[stage_index],
                    tuple(plain), tuple(by_name[name] for name in plain))]
    for index, stages in enumerate(tied_sets):
        names = [name for name in by_name if tied.get(name) == stages]
        if names:
            ranks = tuple(sorted(r for s in stages for r in stage_ranks[s]))
            sets.append(SyncSet(f"weights tied across stages {list(stages)}", ranks,
                                groups[len(stage_ranks) + index], tuple(names), tuple(by_name[n] for n in names)))
    return sets


def synchronize(sets: Sequence[SyncSet], mode: str) -> None:
    """Broadcast each set from its lowest rank, or (``verify``) raise on every rank of a set that differs.

    ``verify`` gathers every set before raising, so a rank that also belongs to a later set (a tie
    group) is never left waiting in it.
    """
    problems = []
    for item in sets:
        if item.group is None or not item.tensors:
            continue
        if mode == "broadcast":
            _broadcast(item)
        elif mode == "verify":
            problems += _differences(item)
    if problems:
        raise ReplicaMismatchError(problems[0] + (f" ({len(problems) - 1} more sets differ)" if len(problems) > 1
                                                  else ""))


def _broadcast(item: SyncSet) -> None:
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in item.tensors:
        by_dtype.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = _flatten_dense_tensors([t.detach() for t in tensors])
            dist.broadcast(flat, src=min(item.ranks), group=item.group)
            for tensor, value in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                tensor.copy_(value)


def _differences(item: SyncSet) -> list[str]:
    """All-gather per-tensor digests over the set's ranks; a message for the first tensor that differs."""
    mine = torch.tensor([data_digest([t]) for t in item.tensors], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in item.ranks]
    dist.all_gather(gathered, mine, group=item.group)
    source = gathered[0]
    for position, name in enumerate(item.names):
        differing = [rank for rank, digests in zip(item.ranks, gathered, strict=True)
                     if digests[position] != source[position]]
        if differing:
            return [f"{item.what}: {name!r} on ranks {differing} differs from rank {item.ranks[0]} (ranks "
                    f"{list(item.ranks)} must start equal); seed every rank alike before building the model, or "
                    f"compile with sync_params='broadcast' to copy rank {item.ranks[0]}'s values"]
    return []


def stage_state(module: torch.nn.Module, param_names: Sequence[tuple[str, str]]) -> list[tuple[str, torch.Tensor]]:
    """``(original name, tensor)`` of every parameter and buffer of a stage module, each tensor once."""
    seen: set[int] = set()
    named = []
    for path, original in param_names:
        owner_path, _, attribute = path.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        value = getattr(owner, attribute, None)
        if isinstance(value, torch.Tensor) and id(value) not in seen:
            seen.add(id(value))
            named.append((original, value))
    return named


def synchronize_driver(driver: PipelineDriver, mode: str) -> None:
    """Make this rank's stage start from the same values as its replicas and tied owners (all ranks call it)."""
    if check_sync_mode(mode) == "off":
        return
    named = stage_state(driver.runner.module, driver.stage.param_names)
    stage_ranks = [list(stage.devices) for stage in driver.plan.stages]
    sets = sync_sets(named, dict(driver.program.tie_groups), driver.stage_index, stage_ranks, driver.groups)
    synchronize(sets, mode)
