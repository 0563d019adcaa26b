"""Sharded stage replicas: a stage's replicas split optimizer state, gradients or weights with FSDP2 (ZeRO-1/2/3).

Each block of the stage (a numbered module path, :mod:`fxpipe.runtime.parallel.fsdp_units`) is ``fully_shard``-ed as
its own unit, each unit prefetching the next one forward and the previous one backward (as torchtitan does); then
the stage's GraphModule is wrapped in :class:`ShardedCall` (its forward, recomputed or not) and the wrapper is
``fully_shard``-ed as the root unit (embeddings, head: what no block holds), all over a DeviceMesh of the stage's
replica group (the driver's process group for the stage). A recomputed or compiled stage stays one unit: its
checkpoint or compiled graph spans the whole stage.
The GraphModule keeps its class and paths; its parameters become DTensor shards (``Shard(0)``), so
``pipe.parameters()`` yields them and ``torch.optim.AdamW(pipe.parameters())`` keeps 1/r of the state.

The levels, per step of M micro-batches (docs/sharding.md):

- ``"optimizer"`` (ZeRO-1): weights gathered once per step and kept through every micro-batch; full
  gradients accumulate locally (no gradient sync) until the step's last backward, which reduce-scatters once;
- ``"gradients"`` (ZeRO-2): weights as above; every micro-batch's backward reduce-scatters, so only the
  shard's gradient accumulates;
- ``"parameters"`` (ZeRO-3): weights all-gathered in every micro-batch's forward and again in its backward,
  freed after each; gradients reduce-scattered per micro-batch.

Under a split backward (zero-bubble: B, then W later, :mod:`fxpipe.runtime.autograd.split_backward`) FSDP2's own
post-backward hook fires in B, before W wrote the weight gradients; as torch.distributed.pipelining does, B
and W run with gradient sync off on the gathered weights (the tensors the forward used, whose ``.grad`` FSDP2
reads) and the driver runs FSDP2's post-backward itself after W (:meth:`ShardedStage.after_weights`):
ZeRO-1 once after the step's last W, ZeRO-2 after every micro-batch's W. ZeRO-3 is refused there: a later
forward would free the weights a pending W still needs (``fxpipe.compile_plan.check_sharded_schedule``).

Gradients are summed, not averaged (divide factor 1 over a plain SUM): fxpipe already weights each slice's
loss by its rows over the global batch. Weights tied across stages are left out (``ignored_params``) and
keep fxpipe's own sum over their owners; FSDP reduces every other parameter, so the driver drops the
stage's replica allreduce.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fxpipe.runtime.autograd.recompute import checkpointed_call
from fxpipe.runtime.parallel.fsdp_units import unit_parameters, unit_program, unit_spans
from fxpipe.runtime.parallel.param_precision import ParamCopies, fsdp_policy


class ShardedCall(torch.nn.Module):
    """The stage's forward as one module FSDP2 wraps: ``module(*args)``, under checkpointing when recomputing.

    FSDP's hooks sit outside the checkpoint (as torchtitan applies them), so a recomputed forward in
    backward runs on the weights FSDP's pre-backward hook gathered.
    """

    def __init__(self, module: torch.nn.Module, recompute: bool, call: Callable[..., Any] | None = None,
                 copies: ParamCopies | None = None) -> None:
        super().__init__()
        self.stage = module
        self.recompute = recompute
        self.call = call  # the stage's compiled form (fxpipe.runtime.compile.stage_compile), None: the module itself
        self.copies = copies  # bf16-params: compute copies of the weights FSDP2 leaves out (tied across stages)

    def forward(self, *args: Any) -> Any:
        call = self.call or self.stage
        if self.copies is not None:
            call = self.copies.run_as_call
        if not torch.is_grad_enabled():
            return call(*args)
        results = checkpointed_call(self.stage, args, call) if self.recompute else call(*args)
        # FSDP2 hooks the backward of each output; an in-place op on an output that is a view (a loss_fn's
        # `logits /= t` on the last stage) would drop that hook and with it the gather or the reduction: copy views
        return tuple(value.clone() if isinstance(value, torch.Tensor) and value._is_view() else value
                     for value in results)


class ShardedStage:
    """This rank's stage sharded at ``level`` over ``group``; the driver tells it where each backward falls."""

    def __init__(self, module: torch.nn.Module, level: str, group: dist.ProcessGroup, device: torch.device,
                 recompute: bool, ignored: Sequence[torch.nn.Parameter], call: Callable[..., Any] | None = None,
                 reshard_after_forward: bool | None = None, param_dtype: torch.dtype | None = None) -> None:
        assert level in ("optimizer", "gradients", "parameters"), level
        self.level = level
        self.policy = fsdp_policy(param_dtype)  # bf16-params: bf16 compute weights, fp32 reductions
        # ZeRO-3 frees each unit after its forward unless the plan keeps it until a backward frees it
        self.reshard_after_forward = level == "parameters" if reshard_after_forward is None else reshard_after_forward
        self.mesh = DeviceMesh.from_group(group, device.type)
        units: Sequence[torch.nn.Module] = ()
        if not recompute and call is None and isinstance(module, torch.fx.GraphModule):
            program, units = unit_program(module, unit_spans(module))
            call = program if units else None
        self.units: list[Any] = [self._shard(unit, set(ignored)) for unit in units]
        for before, after in zip(self.units, self.units[1:], strict=False):  # prefetch: next forward, previous backward
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
        copies = None
        if param_dtype is not None and ignored:
            copies = ParamCopies(call if isinstance(call, torch.nn.Module) else module, param_dtype, ignored)
        wrapper = ShardedCall(module, recompute, call, copies)
        self.wrapper: Any = self._shard(wrapper, set(ignored) | unit_parameters(units))

    def _shard(self, module: torch.nn.Module, ignored: set[torch.nn.Parameter]) -> Any:
        fully_shard(module, mesh=self.mesh, reshard_after_forward=self.reshard_after_forward, mp_policy=self.policy,
                    ignored_params={param for param in ignored if any(param is own for own in module.parameters())}
                    or None)
        assert isinstance(module, FSDPModule)
        # a plain SUM: the slices' losses are weighted already (a factor alone asks for PREMUL_SUM, which gloo lacks)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
        return module

    def __call__(self, args: Sequence[Any]) -> Any:
        return self.wrapper(*args)

    @property
    def largest_unit_bytes(self) -> int:
        """The whole (gathered) bytes of the largest block unit (0: the stage is one unit)."""
        return max((sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in self.units), default=0)

    @property
    def num_units(self) -> int:
        """FSDP2 units holding parameters: the blocks, and the root where anything is left for it."""
        root = fully_shard.state(self.wrapper)._fsdp_param_group  # type: ignore[attr-defined]
        return len(self.units) + (root is not None)

    def before_backward(self, last: bool) -> None:
        """Before each micro-batch's backward; ``last``: the step's last one (sync and free the weights).

        ZeRO-1 syncs gradients only in the last backward; ZeRO-1/2 keep the gathered weights until it.
        """
        self.wrapper.set_is_last_backward(last)
        self.wrapper.set_requires_gradient_sync(last or self.level != "optimizer")
        self.wrapper.set_reshard_after_backward(last or self.level == "parameters")

    def before_split_backward(self) -> None:
        """Before each B of a split backward: FSDP2's post-backward hook (which fires in B, before W wrote
        the weight gradients) neither reduces nor frees the weights; :meth:`after_weights` does both."""
        self.wrapper.set_is_last_backward(False)
        self.wrapper.set_requires_gradient_sync(False)
        self.wrapper.set_reshard_after_backward(False)

    def after_weights(self, last: bool) -> None:
        """After W of one micro-batch (``last``: the step's last W on this rank): reduce-scatter the gathered
        weights' gradients into the shards' ``.grad`` (ZeRO-2: every micro-batch; ZeRO-1: the last), and after
        the last free the weights and end FSDP2's backward."""
        assert self.level != "parameters", "ZeRO-3 under a split backward is refused at compile"
        if not last and self.level == "optimizer":
            return
        self.wrapper.set_is_last_backward(last)
        self.wrapper.set_requires_gradient_sync(True)
        self.wrapper.set_reshard_after_backward(last)
        run_post_backward(self.wrapper)  # the next B sets the flags back (before_split_backward)

    def reshard(self) -> None:
        """Free gathered weights a forward-only pass kept (ZeRO-1/2 keep them after forward)."""
        for unit in (*self.units, self.wrapper):  # FSDPModule.reshard is not recursive
            unit.reshard()


def run_post_backward(module: FSDPModule) -> None:
    """FSDP2's post-backward for every parameter group of ``module`` (reduce-scatter of the gathered weights'
    ``.grad`` into the shards', then reshard as ``set_reshard_after_backward`` says), then its end-of-backward
    callback (which, on the step's last backward, waits for the reductions): what torch's own backward hooks
    would have run.

    Mirrors ``_PipelineStageBase.perform_reduce_grad`` in torch/distributed/pipelining/stage.py (FSDP2's
    ``FSDPParamGroup.post_backward`` in torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py and
    ``FSDPState._root_post_backward_final_callback`` in _fsdp_state.py): private attributes, not public API,
    so their absence is a clear error instead of gradients silently left unreduced.
    """
    get_state = getattr(fully_shard, "state", None)
    state = get_state(module) if callable(get_state) else None
    context = getattr(state, "_state_ctx", None)
    states = getattr(context, "all_states", None)
    final_callback = getattr(state, "_root_post_backward_final_callback", None)
    groups = [getattr(each, "_fsdp_param_groups", None) for each in states or ()]
    if states is None or final_callback is None or any(
            found is None or not all(callable(getattr(group, "post_backward", None)) for group in found)
            for found in groups):
        raise RuntimeError(f"torch {torch.__version__}: FSDP2's state (fully_shard.state) lacks _state_ctx.all_states, "
                           "_fsdp_param_groups[].post_backward or _root_post_backward_final_callback, which fxpipe "
                           "calls to reduce a sharded stage's gradients after zero-bubble's W pass (as "
                           "torch/distributed/pipelining/stage.py does); use the torch release fxpipe supports, "
                           "or schedule='dapple'/'gpipe' with sharding")
    for found in groups:
        for group in found or ():
            group.post_backward()
    final_callback()


def gathered_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The trained parameters a sharded stage's module holds now: in a split backward, the whole weights FSDP2
    gathered for the forward (whose ``.grad`` its post-backward reduce-scatters), never the shards."""
    params = [param for param in module.parameters() if param.requires_grad]
    if any(isinstance(param, DTensor) for param in params):
        raise RuntimeError("a sharded stage's split backward (B) found its weights resharded (FSDP2 freed the "
                           "gathered weights the forward used): W would write gradients FSDP2 never reduces; "
                           "ZeRO-3 (sharding='parameters') cannot run under schedule='zero_bubble', use 'optimizer' "
                           "or 'gradients' there")
    return params


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writes land in it), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, detached: a DTensor gathered over its mesh (collective: every replica calls it alike)."""
    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach()
    return tensor.detach()


def shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` cut as ``like`` (a DTensor) is: this rank's rows, as a DTensor of the same mesh; else ``full``."""
    if not isinstance(like, DTensor):
        return full
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a tensor of shape {tuple(full.shape)} cannot fill a sharded parameter of shape "
                         f"{tuple(like.shape)}; the checkpoint or state dict holds another model's tensor")
    # each rank holds the whole tensor: every rank cuts its own rows, no collective (src_data_rank=None)
    return distribute_tensor(full.to(device=like.device), like.device_mesh, like.placements, src_data_rank=None)


def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole tensor into ``target``: all of it, or this rank's shard when ``target`` is a DTensor."""
    with torch.no_grad():
        if isinstance(target, DTensor):
            sharded = shard_of(full, target)
            assert isinstance(sharded, DTensor)
            target.to_local().copy_(sharded.to_local())
        else:
            target.copy_(full)


def plain_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of a stage module whose parameters are plain, uninitialised ones of the full shape (for
    export: the caller fills every tensor with the gathered values). The live parameters are never copied:
    a sharded one's storage belongs to FSDP2."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=param.device),
                                             requires_grad=param.requires_grad)
    return copy.deepcopy(module, memo)
