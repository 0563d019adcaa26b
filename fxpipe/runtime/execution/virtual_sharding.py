"""Sharded chunks of a virtual-stage rank: each chunk's replicas sharded as one stage's are (ShardedStage per chunk).

Every chunk of a device group has the same replicas, so each sharded chunk gets its own
:class:`fxpipe.runtime.parallel.sharded_stage.ShardedStage` (FSDP2 units per block, the chunk's GraphModule as
the root) over the group's replica process group. FSDP2 then reduces those chunks' gradients (per chunk, in
the chunk's last backward for ZeRO-1, every backward for ZeRO-3); the virtual driver's allreduce keeps the
unsharded chunks' parameters and the tied weights, which stay whole (``ignored_params``) and keep their sum
over every chunk holding them, as on one-stage sharded runs.

"Last" is per chunk: a rank runs several chunks' backwards interleaved, and FSDP2 must reduce (ZeRO-1) and free
a chunk's gathered weights only after that chunk's last backward of the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fxpipe.core import schedule as schedules
from fxpipe.core.plan import Plan
from fxpipe.runtime.execution.stage import StageRunner
from fxpipe.runtime.gradients.virtual_grads import VirtualGroups
from fxpipe.runtime.parallel.sharded_stage import ShardedStage

Op = schedules.Op


class ChunkSharding:
    """The sharded chunks of one rank (none when the plan shards nothing or the group has one replica)."""

    def __init__(self, plan: Plan, runners: Mapping[int, StageRunner], groups: VirtualGroups,
                 device: torch.device, partial: frozenset[str] = frozenset(),
                 param_dtype: torch.dtype | None = None) -> None:
        self.stages: dict[int, ShardedStage] = {}
        # tied weights and gradients partial over a T-way group keep the driver's sums (fxpipe.runtime.gradients.virtual_grads)
        self.runners, self.tied = runners, set(groups.tied) | set(partial)
        for chunk, runner in runners.items():
            stage_plan = plan.stages[chunk]
            if stage_plan.sharding == "none" or groups.replicas is None:
                continue
            ignored = [param for name, param in runner.parameters() if name in self.tied]
            sharded = ShardedStage(runner.module, stage_plan.sharding, groups.replicas, device,
                                   stage_plan.recompute, ignored, runner.compiled, stage_plan.reshard_after_forward,
                                   param_dtype)
            runner.call = sharded
            self.stages[chunk] = sharded
        self._last: dict[int, int] = {}  # chunk -> micro-batch of its last gradient-writing action this step

    def reduced_by_fsdp(self) -> set[int]:
        """ids of the parameters FSDP2 reduces (every parameter of a sharded chunk but the tied weights)."""
        return {id(param) for chunk in self.stages for name, param in self.runners[chunk].parameters()
                if name not in self.tied}

    def start_step(self, actions: Sequence[schedules.Action], split_backward: bool) -> None:
        """Note each sharded chunk's last backward (W under a split backward) in this step's action list."""
        op = Op.WEIGHT if split_backward else Op.BACKWARD
        self._last = {a.chunk_index: a.microbatch_index for a in actions if a.op is op and a.chunk_index in self.stages}

    def before_backward(self, chunk: int, m: int) -> None:
        if chunk in self.stages:
            self.stages[chunk].before_backward(self._last.get(chunk) == m)

    def before_split_backward(self, chunk: int) -> None:
        if chunk in self.stages:
            self.stages[chunk].before_split_backward()

    def after_weights(self, chunk: int, m: int) -> None:
        if chunk in self.stages:
            self.stages[chunk].after_weights(self._last.get(chunk) == m)

    def reshard(self) -> None:
        """Free the gathered weights a forward-only pass kept (ZeRO-1 keeps them after forward)."""
        with torch.no_grad():
            for sharded in self.stages.values():
                sharded.reshard()
