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

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from fxpipe.plan import Plan
from fxpipe.runtime.errors import PipelineSetupError

BATCH_NORM_MODES = ("microbatch", "deferred")


class BatchNormWarning(UserWarning):
    """The model has batch norm and the plan micro-batches or replicates it: train mode is not exact."""


def check_batch_norm_mode(mode: str) -> str:
    if mode not in BATCH_NORM_MODES:
        raise PipelineSetupError(f"batch_norm={mode!r} is unknown; choose 'microbatch' (each slice updates the "
                                 "running statistics, as DDP per replica) or 'deferred' (once per step over the "
                                 "whole global batch)")
    return mode


def warn_batch_norm(model: torch.nn.Module, plan: Plan, mode: str) -> None:
    """One warning when batch statistics are computed per slice (micro-batches or replicas)."""
    names = [name for name, module in model.named_modules() if isinstance(module, _BatchNorm)]
    if not names or (plan.num_microbatches == 1 and all(stage.replicas == 1 for stage in plan.stages)):
        return
    fix = ("running statistics are updated once per step over the whole batch (batch_norm='deferred')"
           if mode == "deferred" else
           "pass batch_norm='deferred' to update running statistics once per step over the whole batch")
    warnings.warn(
        f"the model has batch norm ({len(names)} layers, e.g. {names[0]!r}) and plan {plan.layout!r} splits each "
        f"step into {plan.num_microbatches} micro-batches over the replicas: in train mode every slice is "
        f"normalised with its own statistics, so losses and gradients differ from the unsplit model; {fix}. "
        "See docs/exactness.md", BatchNormWarning, stacklevel=3)


class DeferredBatchNorm(_BatchNorm):
    """Normalises each slice with its own statistics; running statistics wait for :meth:`commit`."""

    _sum: torch.Tensor
    _sum_squares: torch.Tensor
    _count: torch.Tensor

    @classmethod
    def replacing(cls, original: _BatchNorm) -> DeferredBatchNorm:
        """A deferred layer sharing ``original``'s parameters and buffers (the same tensor objects)."""
        layer = cls(original.num_features, original.eps, original.momentum, original.affine,
                    original.track_running_stats)
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
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        with torch.no_grad():
            dims = [0, *range(2, input.dim())]
            values = input.detach().double()
            self._sum += values.sum(dims)
            self._sum_squares += (values * values).sum(dims)
            self._count += input.numel() // input.size(1)
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


def install_deferred(module: torch.nn.Module) -> list[DeferredBatchNorm]:
    """Replace every batch norm layer inside ``module`` (a stage) by a deferred one; the model's own stay."""
    layers = []
    for name, child in list(module.named_modules()):
        if isinstance(child, _BatchNorm) and not isinstance(child, DeferredBatchNorm):
            owner_path, _, attribute = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            layer = DeferredBatchNorm.replacing(child)
            setattr(owner, attribute, layer)
            layers.append(layer)
    return layers


class DeferredCommit:
    """The end-of-step hook: sum the layers' statistics over the stage's replicas, then commit them."""

    def __init__(self, layers: Sequence[DeferredBatchNorm], group: dist.ProcessGroup | None) -> None:
        self.layers = list(layers)
        self.group = group

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
