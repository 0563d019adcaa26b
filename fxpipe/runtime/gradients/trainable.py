"""Which of a stage's parameters train is fixed at compile: the replica and tied-weight gradient sums follow it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fxpipe.runtime.faults.errors import TrainableSetChangedError


class TrainableSet:
    """``requires_grad`` of every parameter of this rank's stage as it was when the sums were set up.

    A parameter unfrozen later would train on each replica by its own gradient (the replicas drift apart); one
    frozen later would keep its gradient out of nothing the optimizer sees, but still be summed. Both are silent,
    so every step compares (one attribute read per parameter) and raises on the rank that sees a change.
    """

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        seen: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for name, param in named:
            seen.setdefault(id(param), (name, param))
        self.params = list(seen.values())
        self.trains = [param.requires_grad for _, param in self.params]

    def check(self, rank: int, stage_index: int) -> None:
        """Raise TrainableSetChangedError naming the parameters whose ``requires_grad`` changed since setup."""
        changed = [(name, param.requires_grad) for (name, param), trains in zip(self.params, self.trains, strict=True)
                   if param.requires_grad != trains]
        if not changed:
            return
        unfrozen = [name for name, now in changed if now]
        frozen = [name for name, now in changed if not now]
        what = "; ".join(part for part in (f"unfrozen {unfrozen}" if unfrozen else "",
                                           f"frozen {frozen}" if frozen else "") if part)
        raise TrainableSetChangedError(
            f"rank {rank} (stage {stage_index}): parameters changed requires_grad after fxpipe.compile ({what}); the "
            "gradient sums over replicas and tied copies were set up for the parameters that trained then. Set "
            "requires_grad before fxpipe.compile (and build the optimizer over the parameters that require grad), "
            "or compile again after changing it")
