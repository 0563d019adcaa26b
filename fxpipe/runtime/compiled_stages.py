"""This rank's compiled stage: set up after the driver (per-stage eager fallback), compiled at setup, stats gathered."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.runtime.compile.compiled_split import SplitCompiledStage
from fxpipe.runtime.compile.stage_compile import CompiledStage, CompileStats
from fxpipe.runtime.execution.stage import rank_runners
from fxpipe.runtime.faults.guard import release_group, setup_group, setup_phase
from fxpipe.runtime.numerics.batchnorm import DeferredBatchNorm

if TYPE_CHECKING:
    from fxpipe.core.program import ValueSpec
    from fxpipe.runtime.execution.driver import PipelineDriver


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
    the stage recomputes, is sharded or runs under autocast, where it runs W inside B (warned, in its stats). A
    tensor-parallel stage splits too: its collectives trace as functional ones (runtime/parallel/traced_collectives)."""
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
    """Every rank's CompileStats (an eager stage's with its reason), by rank (under virtual stages one per chunk of
    each rank, in chunk order); a collective."""
    own = []
    for index, runner in rank_runners(driver).items():
        if runner.split is not None and runner.compiled is not None:
            runner.compiled.stats.num_split_shapes = runner.split.num_shapes
            runner.compiled.stats.num_weight_passes = runner.split.num_weight_passes
        own.append(runner.compiled.stats if runner.compiled is not None
                   else CompileStats(index, eager_reason=runner.eager_reason))
    gathered: list[list[CompileStats] | None] = [None] * driver.context.world_size
    dist.all_gather_object(gathered, own)
    return [stats for part in gathered for stats in part or []]


def warm_compiled_stage(driver: PipelineDriver) -> None:
    """Compile this rank's stage at setup: run it forward and backward once per micro-batch row count of the
    plan's batch, on zeros of the plan's shapes, in a setup phase every rank joins (a collective).

    The phase exchanges over a group of its own whose timeout is ``guard.SETUP_TIMEOUT_S`` (30 min), so a
    rank waiting for a peer's long compile does not trip the step's ``timeout_s``. Everything the run
    touches is put back: parameter gradients, buffers (batch norm's running statistics, its batch count),
    and the random number generators. Skipped (the stage compiles in its first step) for an eager stage,
    a sharded one (FSDP2's wrapper runs it, on sharded weights) and one with non-tensor inputs.
    """
    group = setup_group()
    try:
        with setup_phase("compiling the stages (torch_compile)", group):
            _warm(driver)
    finally:
        release_group(group)


def _warm(driver: PipelineDriver) -> None:
    runner = driver.runner
    if runner.compiled is None or runner.call is not None:
        return
    layout = driver.shapes.plan_step.layout
    specs = [driver.program.values[name] for name in driver.stage.input_values]
    if not all(spec.is_tensor for spec in specs):
        return
    grads = [(param, param.grad) for _, param in runner.parameters()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in runner.module.buffers()]
    device = driver.context.device
    rng = torch.get_rng_state()
    device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        for param, _ in grads:
            param.grad = None
        for rows in sorted({stop - start for start, stop in driver.rows.per_microbatch}):
            inputs = {spec.name: torch.zeros(_shape(layout.shapes[spec.name], spec, rows),
                                             dtype=layout.dtypes.get(spec.name) or spec.dtype, device=device)
                      for spec in specs}
            _forward_backward(driver, inputs)
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
        for param, grad in grads:
            param.grad = grad
        torch.set_rng_state(rng)
        if device_rng is not None:
            torch.cuda.set_rng_state(device_rng, device)


def _shape(shape: tuple[int, ...], spec: ValueSpec, rows: int) -> tuple[int, ...]:
    if not spec.batched:
        return shape
    return (*shape[:spec.batch_dim], rows, *shape[spec.batch_dim + 1:])


def _forward_backward(driver: PipelineDriver, inputs: dict[str, torch.Tensor]) -> None:
    """One micro-batch through the runner as a step runs it (F, then B and W, or the whole backward), with
    gradients of ones at the outputs that take one; its key -1 is no step's micro-batch."""
    runner = driver.runner
    with torch.enable_grad():
        outputs = runner.forward(-1, inputs)
        output_grads = {name: torch.ones_like(value) for name, value in outputs.items()
                        if isinstance(value, torch.Tensor) and value.requires_grad}
        if driver.split_backward:
            runner.backward_input(-1, output_grads)
            runner.backward_weight(-1)
        else:
            runner.backward(-1, output_grads)
