"""BatchNorm under micro-batching: the compile-time warning and deferred running statistics (torchgpipe's idea).

Micro-batching cannot reproduce full-batch normalisation in train mode: each micro-batch slice is
normalised with its own statistics. What can be exact is the running statistics: ``batch_norm=
"deferred"`` normalises each slice as before but accumulates sums over every micro-batch and every
replica of the stage, and updates ``running_mean``/``running_var``/``num_batches_tracked`` once per
step from the whole global batch (momentum applied once, variance over all rows, every replica
alike). For a batch norm whose input does not pass through an earlier batch norm in train mode, the
running statistics then equal the unsplit model's, and so do eval-mode results; a later one sees
activations normalised per slice, so its statistics are the pipeline's own (docs/exactness.md).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from fxpipe.core.plan import Plan
from fxpipe.runtime.faults.errors import PipelineSetupError

BATCH_NORM_MODES = ("microbatch", "deferred", "sync")


class BatchNormWarning(UserWarning):
    """The model has batch norm and the plan micro-batches or replicates it: train mode is not exact."""


def check_batch_norm_mode(mode: str) -> str:
    if mode not in BATCH_NORM_MODES:
        raise PipelineSetupError(f"batch_norm={mode!r} is unknown; choose 'microbatch' (each slice updates the "
                                 "running statistics, as DDP per replica), 'deferred' (once per step over the "
                                 "whole global batch) or 'sync' (deferred, and each micro-batch normalised with "
                                 "statistics over all replicas of the stage, as SyncBatchNorm)")
    return mode


def warn_batch_norm(model: torch.nn.Module, plan: Plan, mode: str) -> None:
    """One warning when batch statistics are computed per slice (micro-batches or replicas)."""
    names = [name for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    replicated = any(stage.replicas > 1 for stage in plan.stages) and mode != "sync"
    if not names or (plan.num_microbatches == 1 and not replicated):
        return  # every batch norm sees the whole batch: exact
    fix = (f"running statistics are updated once per step over the whole batch (batch_norm={mode!r})"
           if mode != "microbatch" else
           "pass batch_norm='deferred' to update running statistics once per step over the whole batch")
    warnings.warn(
        f"the model has batch norm ({len(names)} layers, e.g. {names[0]!r}) and plan {plan.layout!r} splits each "
        f"step into {plan.num_microbatches} micro-batches over the replicas: in train mode every slice is "
        f"normalised with its own statistics, so losses and gradients differ from the unsplit model; {fix}. "
        "See docs/exactness.md", BatchNormWarning, stacklevel=3)


def check_layers_kept(model: torch.nn.Module, stage_modules: Sequence[torch.nn.Module], mode: str) -> None:
    """``deferred``/``sync`` replace batch norm modules in the stage code; refuse if tracing dissolved them."""
    if mode == "microbatch" or not any(isinstance(m, _BatchNorm) for m in model.modules()):
        return
    if not any(isinstance(m, _BatchNorm) for module in stage_modules for m in module.modules()):
        raise PipelineSetupError(f"batch_norm={mode!r} needs batch norm layers as modules in the stage code, but "
                                 "tracing turned them into functional ops (torch.export fallback); make the model "
                                 "traceable by torch.fx or use batch_norm='microbatch'")


class DeferredBatchNorm(_BatchNorm):
    """Normalises each slice with its own statistics; running statistics wait for :meth:`commit`."""

    _sum: torch.Tensor
    _sum_squares: torch.Tensor
    _count: torch.Tensor
    group: dist.ProcessGroup | None = None  # set: normalise over the stage's replicas (batch_norm="sync")

    @classmethod
    def replacing(cls, original: _BatchNorm, group: dist.ProcessGroup | None = None) -> DeferredBatchNorm:
        """A deferred layer sharing ``original``'s parameters and buffers (the same tensor objects)."""
        layer = cls(original.num_features, original.eps, original.momentum, original.affine,
                    original.track_running_stats)
        layer.group = group
        layer.__dict__["original"] = original  # kept out of the module tree; see original_layers
        for name, param in original.named_parameters(recurse=False):
            setattr(layer, name, param)
        for name, buffer in original.named_buffers(recurse=False):
            setattr(layer, name, buffer)
        layer.train(original.training)
        layer.reset_sums()
        return layer

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (batch, channels, ...), got {input.dim()}D")

    def reset_sums(self) -> None:
        device = self.running_mean.device if self.running_mean is not None else torch.device("cpu")
        self._sum = torch.zeros(self.num_features, dtype=torch.float64, device=device)
        self._sum_squares = torch.zeros_like(self._sum)
        self._count = torch.zeros(1, dtype=torch.float64, device=device)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)  # running statistics (or, without them, the slice's own)
        self._check_input_dim(input)
        if self.track_running_stats:
            with torch.no_grad():
                values = input.detach().double()
                sums = _channel_sums(values, values * values)
                self._sum += sums[0]
                self._sum_squares += sums[1]
                self._count += input.numel() // input.size(1)
        if self.group is not None:  # as SyncBatchNorm: in train mode, statistics over the replica group
            return _SyncedNorm.apply(input, self.weight, self.bias, self.eps, self.group)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def sums(self) -> torch.Tensor:
        return torch.cat([self._sum, self._sum_squares, self._count])

    @torch.no_grad()
    def commit(self, sums: torch.Tensor) -> None:
        """Update the running statistics once from ``[sum, sum of squares, count]`` of the whole batch."""
        count = float(sums[-1])
        self.reset_sums()
        if count == 0 or self.running_mean is None or self.running_var is None:
            return
        if count == 1:
            raise ValueError(f"batch norm over {count:.0f} value per channel: the unbiased variance is undefined "
                             "(torch raises the same for a batch of one); use a larger batch")
        mean = sums[:self.num_features] / count
        variance = (sums[self.num_features:-1] / count - mean * mean) * (count / (count - 1))  # unbiased, as torch
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(variance.to(self.running_var.dtype), alpha=factor)


@contextlib.contextmanager
def original_layers(module: torch.nn.Module) -> Iterator[None]:
    """Put the model's own batch norm layers back for the block (for export, which traces into them).

    They share the deferred layers' tensors, so they hold the trained values; their training flag
    is set to the deferred layer's.
    """
    swapped = []
    for name, child in list(module.named_modules()):
        if isinstance(child, DeferredBatchNorm):
            owner_path, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            original = child.__dict__["original"]
            original.train(child.training)
            setattr(owner, attribute, original)
            swapped.append((owner, attribute, child))
    try:
        yield
    finally:
        for owner, attribute, child in swapped:
            setattr(owner, attribute, child)


def install_deferred(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> list[DeferredBatchNorm]:
    """Replace every batch norm layer inside ``module`` (a stage) by a deferred one; the model's own stay.

    ``group``: the stage's replica group, to normalise each micro-batch over all replicas (``sync``).
    """
    layers = []
    for name, child in list(module.named_modules()):
        if isinstance(child, _BatchNorm) and not isinstance(child, DeferredBatchNorm):
            owner_path, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            layer = DeferredBatchNorm.replacing(child, group)
            setattr(owner, attribute, layer)
            layers.append(layer)
    return layers


class DeferredCommit:
    """The end-of-step hook: sum the layers' statistics over the stage's replicas, then commit them."""

    def __init__(self, layers: Sequence[DeferredBatchNorm], group: dist.ProcessGroup | None) -> None:
        self.layers = list(layers)
        self.group = group

    def reset(self) -> None:
        """Drop sums a failed step left behind (the start-of-step hook)."""
        for layer in self.layers:
            layer.reset_sums()

    def __call__(self) -> None:
        if not any(layer.training for layer in self.layers):
            return  # eval steps track nothing; every replica of a stage is in the same mode
        sums = [layer.sums() for layer in self.layers]
        flat = torch.cat(sums)
        if self.group is not None:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for layer, own in zip(self.layers, sums, strict=True):
            layer.commit(flat[offset:offset + own.numel()])
            offset += own.numel()


def _channel_sums(*tensors: torch.Tensor) -> torch.Tensor:
    """Per-channel sums of each tensor (over every dimension but 1), stacked."""
    dims = [0, *range(2, tensors[0].dim())]
    return torch.stack([t.sum(dims) for t in tensors])


class _SyncedNorm(torch.autograd.Function):
    """Train-mode batch norm whose statistics (and their gradients) are summed over a process group.

    The replicas of a stage run the same schedule, so they reach each micro-batch's forward and
    backward in the same order and the collectives pair up. Legend: x input, n values per channel
    over the group, x_hat normalised input, dy output gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                group: dist.ProcessGroup) -> torch.Tensor:
        values = x.double()
        sums = torch.cat([_channel_sums(values, values * values).reshape(-1),
                          torch.tensor([x.numel() // x.size(1)], dtype=torch.float64, device=x.device)])
        dist.all_reduce(sums, group=group)
        channels = x.size(1)
        n = float(sums[-1])
        mean = sums[:channels] / n
        variance = sums[channels:2 * channels] / n - mean * mean  # biased, as batch norm normalises
        shape = [1, channels, *([1] * (x.dim() - 2))]
        invstd = torch.rsqrt(variance + eps).to(x.dtype).reshape(shape)
        x_hat = (x - mean.to(x.dtype).reshape(shape)) * invstd
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.group, ctx.n = group, n
        out = x_hat if weight is None else x_hat * weight.reshape(shape)
        return out if bias is None else out + bias.reshape(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_hat, invstd, weight = ctx.saved_tensors
        local = _channel_sums(dy, dy * x_hat)  # [sum dy, sum dy * x_hat] of this replica's rows
        total = local.clone()
        dist.all_reduce(total, group=ctx.group)
        shape = invstd.shape
        scale = invstd if weight is None else invstd * weight.reshape(shape)
        dx = scale * (dy - total[0].reshape(shape) / ctx.n - x_hat * total[1].reshape(shape) / ctx.n)
        grad_weight = local[1] if weight is not None else None  # summed over replicas with the other grads
        grad_bias = local[0] if ctx.needs_input_grad[2] else None
        return dx, grad_weight, grad_bias, None, None
