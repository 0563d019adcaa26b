"""A step's gradient sums over replicas and tied copies: earlier steps' gradients set aside, this step's
all-reduced (the overlapped buckets' rest and the reduce sets), then the earlier ones added back."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fxpipe.runtime.buckets import OverlappedAllreduce, Reduction
from fxpipe.runtime.comm import allreduce_async

Params = Sequence[tuple[str, torch.nn.Parameter]]


def stash_grads(params: Params) -> dict[int, torch.Tensor | None]:
    """Set aside gradients from earlier steps so the allreduce sums only this step's."""
    stash = {}
    for _, param in params:
        stash[id(param)] = param.grad
        param.grad = None
    return stash


def start_allreduces(overlap: OverlappedAllreduce | None,
                     reduce_sets: Sequence[tuple[dist.ProcessGroup, list[torch.nn.Parameter]]]) -> list[Reduction]:
    """The overlapped buckets not yet launched, then one flat allreduce per (group, dtype) of the reduce sets
    (a parameter without a gradient contributes zeros)."""
    reductions = list(overlap.launch_rest()) if overlap is not None else []
    for group, params in reduce_sets:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
        for tensors in by_dtype.values():
            work, flat = allreduce_async(tensors, group)
            reductions.append((work, flat, tensors))
    return reductions


def restore_stashed(params: Params, stash: dict[int, torch.Tensor | None], keep_this_step: bool) -> None:
    """Add the earlier steps' gradients back; without ``keep_this_step`` this step's are dropped instead."""
    for _, param in params:
        earlier = stash[id(param)]
        if not keep_this_step:
            param.grad = earlier
        elif earlier is not None:
            param.grad = earlier if param.grad is None else param.grad + earlier
