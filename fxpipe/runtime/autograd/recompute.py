"""Activation recomputation at run time: a stage's forward under non-reentrant checkpointing, exactly."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from fxpipe.core.interleaved_schedules import SPLIT_BACKWARD_SCHEDULES
from fxpipe.core.plan import Plan
from fxpipe.runtime.faults.errors import PipelineSetupError


def checkpointed_call(module: torch.nn.Module, args: Sequence[Any], call: Callable[..., Any] | None = None) -> Any:
    """``module(*args)`` keeping only ``args`` for backward, which runs the forward again first.

    ``call``: what runs the module (its compiled form, fxpipe.runtime.compile.stage_compile); default ``module``.

    Non-reentrant checkpointing restores the RNG state (dropout draws the same masks) and the
    autocast state; buffers the forward updates (BatchNorm running statistics) are put back after
    the recomputation, so each micro-batch updates them once, as without recomputation.
    """
    return checkpoint(call or module, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: (contextlib.nullcontext(), _buffers_restored(module)))


def recomputed_bytes(module: torch.nn.Module, args: Sequence[Any]) -> int:
    """Bytes autograd saves in one forward of ``module`` on ``args``: what a recomputing stage holds again
    while its backward runs (measured by running that forward once more, outside the step's graph; the
    random number generators and buffers are left as they were)."""
    from fxpipe.runtime.autograd.measure import SavedActivationMeter

    meter = SavedActivationMeter.for_parameters(module.parameters())
    with torch.random.fork_rng(devices=_cuda_devices(args)), _buffers_restored(module), torch.enable_grad():
        with meter.measure():
            outputs = module(*args)
        del outputs
    return meter.peak_bytes


def _cuda_devices(args: Sequence[Any]) -> list[torch.device]:
    return sorted({a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"}, key=str)


@contextlib.contextmanager
def _buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def check_recompute_batch_norm(plan: Plan, stage_modules: Sequence[torch.nn.Module], batch_norm: str) -> None:
    """Deferred/synchronised batch norm (collectives and sums per forward) cannot run twice per micro-batch; nor can
    a split backward (zero_bubble, interleaved_zero_bubble, zbv) rerun a checkpoint; nor can a whole recomputed block hold batch norm. Per-block
    recompute runs on sharded stages (each region inside its block's FSDP unit) and on tensor-parallel members (the
    regions placed on each member's shard, rerunning its collectives).

    Decided from the plan and every stage's module, so every rank raises alike.
    """
    recomputing = [stage.stage_index for stage in plan.stages if stage.recompute or set(stage.block_recompute) - {"keep"}]
    if recomputing and plan.schedule in SPLIT_BACKWARD_SCHEDULES:
        fix = "'early_backward' (or 'auto')" if plan.virtual_stages == 1 else "'interleaved'"
        raise PipelineSetupError(
            f"stages {recomputing} recompute their activations, which {plan.schedule}'s split backward (B, then W "
            f"on the same autograd graph) cannot run; use schedule={fix} with recomputation, or "
            f"recompute='never' with {plan.schedule}")
    for stage, module in zip(plan.stages, stage_modules, strict=True):
        names = [name for name, layer in module.named_modules() if isinstance(layer, _BatchNorm)]
        if "block" in stage.block_recompute and names:  # a checkpointed block would update their statistics twice
            raise PipelineSetupError(f"stage {stage.stage_index} recomputes blocks whole (block_recompute) and holds "
                                     f"batch norm {names[0]!r}; recompute that stage whole or not at all")
        if batch_norm == "microbatch":
            continue
        if stage.stage_index in recomputing and names:
            raise PipelineSetupError(
                f"stage {stage.stage_index} recomputes its activations but holds batch norm {names[0]!r} and "
                f"batch_norm={batch_norm!r} sums statistics in every forward; pass recompute='never' (or "
                "per stage, keeping that stage's activations) or batch_norm='microbatch'")
