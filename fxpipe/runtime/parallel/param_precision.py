"""Mixed-precision parameters (precision ``bf16-params``): fp32 master weights, bf16 compute copies, fp32 gradient sums.

The user's optimizer keeps seeing the fp32 masters (``pipe.parameters()``). A stage sharded with FSDP2 gets
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (:func:`fsdp_policy`): FSDP2 casts the shards to
bf16 before its all-gather (half the bytes), computes with the gathered bf16 weights, and reduce-scatters the
gradients in fp32 into the fp32 shards' ``.grad`` (accumulating in fp32 across micro-batches that do not sync).

An unsharded stage (and the tied weights FSDP2 leaves out) gets the same by :class:`ParamCopies`: the stage
runs with a bf16 copy of each master, made by a differentiable cast (``master.to(bf16)``) once per change of
the masters (the optimizer step or a load bumps their version counters) and reused by every micro-batch of the
step. Each micro-batch's gradient is bf16 at the copy, as at FSDP2's gathered weight, and autograd's cast
backward adds it to the master's fp32 ``.grad``: gradients accumulate and are all-reduced over the replicas in
fp32 by the driver's usual sums, untouched. The cast saves no tensor, so one copy serves many backwards.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.func import functional_call

from fxpipe.core.program import SplitProgram
from fxpipe.runtime.autograd.recompute import checkpointed_call


def fsdp_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``param_dtype`` (None: its default, no casting). Inputs are not cast: a stage's values keep
    the dtypes autocast gives them, which the receivers expect (fxpipe.runtime.transport.fake_run)."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


class ParamCopies:
    """Low-precision compute copies of ``module``'s parameters (those in ``only`` when given), as its attribute
    paths; made again whenever a master changed in place (version counter) or autograd was switched on or off."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype,
                 only: Collection[torch.nn.Parameter] | None = None) -> None:
        keep = None if only is None else {id(param) for param in only}
        self.module, self.dtype = module, dtype
        self.params = [(name, param) for name, param in module.named_parameters(remove_duplicate=False)
                       if param.is_floating_point() and (keep is None or id(param) in keep)]
        self._key: tuple[Any, ...] | None = None
        self._copies: dict[str, torch.Tensor] = {}

    def copies(self) -> dict[str, torch.Tensor]:
        """``{path: copy}``; a parameter under two paths (tied inside the stage) has one copy, so its two uses'
        gradients meet in bf16 at the copy, as they do at FSDP2's gathered weight."""
        key = (torch.is_grad_enabled(), *(param._version for _, param in self.params))
        if key != self._key:
            made: dict[int, torch.Tensor] = {}
            self._copies = {}
            for name, param in self.params:
                if id(param) not in made:
                    made[id(param)] = param.to(self.dtype)
                self._copies[name] = made[id(param)]
            self._key = key
        return self._copies

    def run(self, args: Sequence[Any]) -> Any:
        """``module(*args)`` on the copies."""
        if not self.params:
            return self.module(*args)
        return functional_call(self.module, self.copies(), tuple(args), strict=False, tie_weights=False)

    def run_as_call(self, *args: Any) -> Any:
        return self.run(args)


class ParamCopiesCall:
    """An unsharded stage's forward on bf16 copies (the runner's ``call``), recomputed in backward when asked:
    the checkpoint runs the forward again on the same copies."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, recompute: bool) -> None:
        self.copies = ParamCopies(module, dtype)
        self.recompute = recompute

    def __call__(self, args: Sequence[Any]) -> Any:
        module = self.copies.module
        if self.recompute and torch.is_grad_enabled():
            return checkpointed_call(module, args, lambda *inputs: self.copies.run(inputs))
        return self.copies.run(args)


def with_param_dtype(program: SplitProgram, param_dtype: torch.dtype | None) -> SplitProgram:
    """``program`` noting the dtype its stages compute their weights in: every rank's fake-tensor run of the stages
    (fxpipe.runtime.transport.fake_run) then expects the dtypes the bf16 copies give (a bf16 residual stream)."""
    if param_dtype is None:
        return program
    return replace(program, param_dtype=str(param_dtype).removeprefix("torch."))


def unsharded_call(module: torch.nn.Module, param_dtype: torch.dtype | None, recompute: bool) -> ParamCopiesCall | None:
    """The runner's ``call`` for an unsharded stage, tensor-parallel or not (a member's copies are of its shards):
    None (the module itself) without ``param_dtype``."""
    if param_dtype is None:
        return None
    return ParamCopiesCall(module, param_dtype, recompute)
