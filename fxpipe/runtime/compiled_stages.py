"""This rank's compiled stage: set up after the driver (with a per-stage eager fallback), and its compile stats gathered."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from fxpipe.runtime.batchnorm import DeferredBatchNorm
from fxpipe.runtime.compiled_split import SplitCompiledStage
from fxpipe.runtime.stage_compile import CompiledStage, CompileStats

if TYPE_CHECKING:
    from fxpipe.runtime.driver import PipelineDriver


class CompileFallbackWarning(UserWarning):
    """A stage runs eager although ``torch_compile`` asked for it to be compiled; the message says why."""


def compile_stage(driver: PipelineDriver, settings: Mapping[str, Any] | None, batch_norm: str) -> None:
    """Compile this rank's stage (``settings``: parsed ``torch_compile``; None leaves it eager).

    Called after the deferred batch norm layers are in: they keep sums in Python lists and (``sync``)
    run collectives inside forward, which dynamo cannot put in a graph, so such a stage stays eager,
    with a :class:`CompileFallbackWarning` naming it.
    """
    if settings is None:
        return
    runner = driver.runner
    deferred = [name for name, layer in runner.module.named_modules() if isinstance(layer, DeferredBatchNorm)]
    if deferred:
        reason = (f"batch_norm={batch_norm!r} keeps statistics outside the graph (layer {deferred[0]!r}); "
                  "pass batch_norm='microbatch' to compile it")
        warnings.warn(f"stage {driver.stage_index} runs eager: {reason}", CompileFallbackWarning, stacklevel=3)
        runner.compiled = None
        runner.eager_reason = reason
        return
    program = driver.program
    dims = [program.values[name].batch_dim if program.values[name].batched else None
            for name in driver.stage.input_values]
    runner.compiled = CompiledStage(runner.module, dims, settings, driver.stage_index)
    if driver.split_backward:
        _split_stage(driver, runner.compiled)


def _split_stage(driver: PipelineDriver, compiled: CompiledStage) -> None:
    """Under a split-backward schedule: cut the stage's joint graph into F, B and W (compiled_split), unless
    the stage recomputes, is sharded or runs under autocast, where it runs W inside B (warned, in its stats)."""
    runner = driver.runner
    stage_plan = driver.plan.stages[driver.stage_index]

    def fall_back(reason: str) -> None:
        compiled.stats.w_in_b_reason = reason
        warnings.warn(f"stage {driver.stage_index} runs its whole backward in B (zero-bubble's W does no work): "
                      f"{reason}", CompileFallbackWarning, stacklevel=4)

    if stage_plan.recompute:
        fall_back("the stage recomputes its forward in backward; plan it without recompute to split it")
    elif stage_plan.sharding != "none" and driver.groups[driver.stage_index] is not None:
        fall_back(f"sharding={stage_plan.sharding!r}: FSDP2 runs the stage's backward; plan it unsharded to split it")
    elif runner.autocast_dtype is not None:
        fall_back(f"autocast ({runner.autocast_dtype}) is not traced into the split graphs; train in float32 to "
                  "split it")
    else:
        runner.split = SplitCompiledStage(runner.module, compiled.compile_part, fall_back)


def gather_compile_stats(driver: PipelineDriver) -> list[CompileStats]:
    """Every rank's CompileStats (an eager stage's with its reason), by rank; a collective."""
    runner = driver.runner
    if runner.split is not None and runner.compiled is not None:
        runner.compiled.stats.num_split_shapes = runner.split.num_shapes
        runner.compiled.stats.num_weight_passes = runner.split.num_weight_passes
    own = runner.compiled.stats if runner.compiled is not None else CompileStats(driver.stage_index,
                                                                                 eager_reason=runner.eager_reason)
    gathered: list[CompileStats | None] = [None] * driver.context.world_size
    dist.all_gather_object(gathered, own)
    return [stats for stats in gathered if stats is not None]
