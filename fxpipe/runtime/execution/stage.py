"""One stage's GraphModule on this rank: forward and backward of micro-batch slices, and the weighted loss."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.runtime.autograd.inplace import inputs_changed_in_place
from fxpipe.runtime.autograd.measure import SavedActivationMeter
from fxpipe.runtime.autograd.recompute import checkpointed_call, recomputed_bytes
from fxpipe.runtime.autograd.split_backward import (
    WeightWork,
    backward_inputs,
    backward_weights,
    weight_params,
)
from fxpipe.runtime.execution.device_constants import retarget_device_constants
from fxpipe.runtime.faults.errors import BatchShapeError, PipelineSetupError
from fxpipe.runtime.numerics.loss_probe import LossProbe
from fxpipe.runtime.parallel.sharded_stage import gathered_params

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram, StageProgram
    from fxpipe.runtime.compile.compiled_split import CompiledWeightWork, SplitCompiledStage, SplitSaved
    from fxpipe.runtime.compile.stage_compile import CompiledStage

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class _Saved:
    """What backward of one micro-batch needs: the outputs (or weighted loss) and the input leaves."""

    outputs: dict[str, Any]
    input_leaves: dict[str, torch.Tensor]
    loss: torch.Tensor | None = None
    args: list[Any] | None = None  # a recomputing stage's forward arguments (checkpointing keeps them anyway)
    split: SplitSaved | None = None  # a compiled stage's F under split backward: what its B and W read
    split_inputs: tuple[str, ...] = ()  # ... and the inputs B gives gradients, in order


def rebuild_tree(tree: Any, values: Mapping[str, Any]) -> Any:
    """The model's output structure with each leaf value name replaced by its value."""
    if isinstance(tree, str):
        return values[tree]
    if isinstance(tree, tuple):
        return tuple(rebuild_tree(item, values) for item in tree)
    if isinstance(tree, list):
        return [rebuild_tree(item, values) for item in tree]
    if isinstance(tree, dict):
        return {key: rebuild_tree(item, values) for key, item in tree.items()}
    return tree  # a constant leaf (None, a number) is returned as it is


def autocast_context(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


LOSS_REDUCTIONS = ("auto", "mean", "sum", "token_mean")


def check_loss_reduction(reduction: str) -> str:
    if reduction not in LOSS_REDUCTIONS:
        raise PipelineSetupError(f"loss_reduction={reduction!r} is unknown; choose 'auto' (the first step finds out "
                                 "whether loss_fn is a per-row mean or a sum), 'mean' (loss_fn returns a per-row mean), "
                                 "'sum' (a sum over rows) or 'token_mean' (loss_fn returns (sum, count))")
    return reduction


def split_loss(result: Any, reduction: str) -> tuple[torch.Tensor, torch.Tensor | float]:
    """``(scalar loss, count)`` from what loss_fn returned, checked against the loss_reduction contract.

    A tensor count stays a tensor: reading it here would wait for the device once per micro-batch.
    """
    if reduction == "token_mean":
        if not (isinstance(result, tuple | list) and len(result) == 2 and _is_scalar(result[0])):
            raise TypeError(f"loss_reduction='token_mean' needs loss_fn to return (loss_sum, count), got "
                            f"{type(result).__name__}; e.g. return (F.cross_entropy(..., reduction='sum'), "
                            "(targets != -100).sum())")
        count = result[1]
        return result[0], count.detach() if isinstance(count, torch.Tensor) else float(count)
    if not _is_scalar(result):
        pair = " (a (sum, count) pair needs loss_reduction='token_mean')" if isinstance(result, tuple | list) else ""
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(result).__name__} "
                        f"{getattr(result, 'shape', '')}{pair}; reduce the loss with mean() or sum()")
    return result, 0.0


def _is_scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() == 1


class StageRunner:
    """Runs stage ``stage.stage_index`` on micro-batch slices, keeping outputs and input leaves for backward.

    With ``recompute`` the stage keeps only its inputs per micro-batch and runs its forward again in
    backward (:func:`fxpipe.runtime.autograd.recompute.checkpointed_call`).
    """

    def __init__(self, stage: StageProgram, program: SplitProgram, device: torch.device, *,
                 loss_fn: LossFn | None, autocast_dtype: torch.dtype | None, loss_reduction: str = "auto",
                 recompute: bool = False, target_batch_dim: int = 0) -> None:
        self.stage = stage
        self.program = program
        self.device = device
        self.module = stage.module.to(device)
        retarget_device_constants(self.module, device)  # a CPU trace's device constants (torch.export) follow
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype
        self.loss_reduction = check_loss_reduction(loss_reduction)
        # on every rank (each folds the same values into the step's loss allreduce); probes on the last stage
        self.probe = LossProbe(self.loss_reduction, {name: program.values[name].batch_dim if program.values[name].batched
                                                     else None for name in stage.output_values}, target_batch_dim)
        self.is_last = stage.stage_index == len(program.stages) - 1
        self.recompute = recompute
        self._copied_inputs = inputs_changed_in_place(self.module)  # leaves these would write into
        self._saved: dict[int, _Saved] = {}
        self._weight_work: dict[int, WeightWork | CompiledWeightWork | None] = {}  # split backward: W still to run, per micro-batch
        self._trained: list[torch.nn.Parameter] | None = None
        # set by the driver for a step measured with saved-activation bytes (MeasureMode.FULL)
        self.meter: SavedActivationMeter | None = None
        # a sharded stage runs its forward through FSDP2 (fxpipe.runtime.parallel.sharded_stage): call(args), recompute inside
        self.call: Callable[[Sequence[Any]], Any] | None = None
        # torch_compile: set after setup (fxpipe.runtime.compile.stage_compile.compile_stage); None runs the module eager
        self.compiled: CompiledStage | None = None
        self.eager_reason: str | None = None  # why a stage asked to compile runs eager
        # a compiled stage under a split-backward schedule: F, B and W cut from its joint graph (compiled_split)
        self.split: SplitCompiledStage | None = None
        self.scaler: torch.amp.GradScaler | None = None  # pipe.grad_scaler(): scales each slice's loss (grad_scaler)

    def use_module(self, module: torch.fx.GraphModule) -> None:
        """Run ``module`` from now on (a tensor-parallel shard of the stage, with the same attribute paths)."""
        self.module = module.to(self.device)
        retarget_device_constants(self.module, self.device)
        self._copied_inputs = inputs_changed_in_place(self.module)
        self._trained = None
        self.compiled = self.split = None  # compiled for the module it replaces

    def parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """``(original name, parameter)`` for every parameter of this stage."""
        for path, original in self.stage.param_names:
            value = self.module.get_parameter(path) if _is_parameter(self.module, path) else None
            if value is not None:
                yield original, value

    def forward(self, microbatch_index: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Run the stage on one slice; received tensors that need gradients become leaves."""
        with autocast_context(self.device, self.autocast_dtype):
            return self._forward(microbatch_index, inputs)

    def _takes_gradient(self, name: str, value: Any) -> bool:
        """Whether input ``name`` becomes a leaf whose gradient backward sends to its producer."""
        return (self.program.producers[name] >= 0 and self.program.values[name].requires_grad
                and isinstance(value, torch.Tensor))

    def _forward(self, microbatch_index: int, inputs: Mapping[str, Any]) -> dict[str, Any]:
        if self.split is not None and self.call is None and not self.recompute:
            outputs = self._split_forward(microbatch_index, inputs)
            if outputs is not None:
                return outputs
        leaves: dict[str, torch.Tensor] = {}
        args = []
        for name in self.stage.input_values:
            value = inputs[name]
            if self._takes_gradient(name, value):
                value = value.detach().requires_grad_(True)
                leaves[name] = value
                if name in self._copied_inputs:  # autograd refuses in-place ops on a leaf; the copy carries them
                    value = value.clone()
            args.append(value)
        if self.call is not None:  # sharded: FSDP2's wrapper runs the compiled or eager module, recompute inside
            results = self.call(args)
        else:
            call = self.compiled or self.module
            results = checkpointed_call(self.module, args, call) if self.recompute else call(*args)
        outputs = dict(zip(self.stage.output_values, results, strict=True))
        self._saved[microbatch_index] = _Saved(outputs, leaves, args=args if self.recompute else None)
        return outputs

    def _split_forward(self, microbatch_index: int, inputs: Mapping[str, Any]) -> dict[str, Any] | None:
        """F of a compiled stage's split backward (None: its joint graph cannot be cut, run it whole).

        The outputs that take a gradient become leaves, so that the last stage's loss can be
        differentiated down to them in B.
        """
        assert self.split is not None
        args = [inputs[name] for name in self.stage.input_values]
        differentiable = [self._takes_gradient(name, value) for name, value in zip(self.stage.input_values, args,
                                                                                   strict=True)]
        copied = [name in self._copied_inputs for name in self.stage.input_values]
        ran = self.split.forward(args, differentiable, copied)
        if ran is None:
            return None
        results, saved = ran
        for index in saved.graphs.differentiable_outputs:
            results[index] = results[index].detach().requires_grad_(True)
        outputs = dict(zip(self.stage.output_values, results, strict=True))
        names = tuple(name for name, grad in zip(self.stage.input_values, differentiable, strict=True) if grad)
        self._saved[microbatch_index] = _Saved(outputs, {}, split=saved, split_inputs=names)
        return outputs

    def forward_loss(self, microbatch_index: int, inputs: Mapping[str, Any], targets: Any, rows: int,
                     global_rows: int) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Last stage: forward, then the weighted loss of this slice of ``rows`` rows; returns it detached
        and the slice's count (``loss_reduction="token_mean"``: the loss_fn returns ``(sum, count)``; else 0).

        A per-row mean is weighted by ``rows / global_rows``, a sum (or token_mean's sum) by 1. Under
        ``"auto"`` the loss probe reads the first step's slices before their weight is chosen
        (fxpipe.runtime.numerics.loss_probe). One autocast region for forward and loss, as an eager loop writes
        it (entering one costs, and leaving it drops its cache of cast weights); once the probe is
        settled nothing here waits for the device.
        """
        with autocast_context(self.device, self.autocast_dtype):
            outputs = self._forward(microbatch_index, inputs)
            loss, count = self._evaluate_loss(outputs, targets)
            reduction = self.probe.observe(self._evaluate_loss, outputs, targets, rows, loss, count)
        weight = rows / global_rows if reduction == "mean" else 1.0
        # each op skipped when it would change nothing: they cost a dispatch here and in backward
        weighted = loss if loss.dtype == torch.float32 else loss.float()
        weighted = weighted if weighted.dim() == 0 else weighted.reshape(())
        if weight != 1.0:  # one micro-batch on one replica: x * 1.0 == x, skip the op and its backward
            weighted = weighted * weight
        # every backward of this slice (whole, or B of a split one) starts from the saved loss: scale it there, once
        self._saved[microbatch_index].loss = weighted if self.scaler is None else self.scaler.scale(weighted)
        return weighted.detach(), count

    def _evaluate_loss(self, outputs: Mapping[str, Any], targets: Any) -> tuple[torch.Tensor, torch.Tensor | float]:
        """loss_fn on a slice's outputs (by value name) and targets, as ``(loss, count)``."""
        assert self.loss_fn is not None, "the driver checks loss_fn before running a last stage"
        return split_loss(self.loss_fn(rebuild_tree(self.program.output_tree, outputs), targets), self.loss_reduction)

    def infer(self, inputs: Mapping[str, Any], targets: Any = None, rows: int = 0,
              global_rows: int = 1) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | float]:
        """Forward of one slice for evaluate/predict (the caller runs it under no_grad): nothing is saved.

        Returns the outputs and, on the last stage with ``targets``, the slice's weighted loss and count,
        weighted as :meth:`forward_loss` weights them (an open loss probe looks at this slice too).
        """
        args = [inputs[name] for name in self.stage.input_values]
        with autocast_context(self.device, self.autocast_dtype):
            results = self.call(args) if self.call is not None else (self.compiled or self.module)(*args)
            outputs = dict(zip(self.stage.output_values, results, strict=True))
            if targets is None or not self.is_last:
                return outputs, None, 0.0
            loss, count = self._evaluate_loss(outputs, targets)
            reduction = self.probe.observe(self._evaluate_loss, outputs, targets, rows, loss, count)
        weighted = loss.float().reshape(())
        return outputs, weighted * (rows / global_rows) if reduction == "mean" else weighted, count

    def evaluated_loss(self, loss_sum: float, count: float) -> float:
        """The global batch's loss of a forward-only pass (gradients untouched; ``token_mean``: sum / count)."""
        if self.loss_reduction != "token_mean":
            return loss_sum
        if count <= 0:
            raise BatchShapeError(f"loss_fn counted {count} tokens over the whole batch; a token_mean loss needs at "
                                  "least one counted target (are all targets ignore_index?)")
        return loss_sum / count

    def batch_loss(self, loss_sum: float, count: float, params: Sequence[torch.nn.Parameter]) -> float:
        """The global batch's loss from the summed slice losses (and counts, for ``token_mean``).

        ``token_mean``: the slices' losses were sums; this step's gradients (already summed over
        ranks) are divided by the global count here, as one process dividing by it would.
        """
        if self.loss_reduction != "token_mean":
            return loss_sum
        if count <= 0:
            raise BatchShapeError(f"loss_fn counted {count} tokens over the whole batch; a token_mean loss needs at "
                                  "least one counted target (are all targets ignore_index?)")
        with torch.no_grad():
            for param in params:
                if param.grad is not None:
                    param.grad.div_(count)
        return loss_sum / count

    def backward(self, microbatch_index: int, output_grads: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Backward of one micro-batch; returns the gradient of every input leaf (None when unused)."""
        saved = self._saved.pop(microbatch_index)
        outputs, grads = _roots(saved, output_grads)
        if self.meter is not None and saved.args is not None:  # the forward rebuilt inside this backward
            with autocast_context(self.device, self.autocast_dtype):
                self.meter.note_transient(recomputed_bytes(self.module, saved.args))
        if outputs:
            with self.compiled.booking() if self.compiled is not None else contextlib.nullcontext():
                torch.autograd.backward(outputs, grads)
        return {name: leaf.grad for name, leaf in saved.input_leaves.items()}

    def backward_input(self, microbatch_index: int, output_grads: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """B of a split backward: the input leaves' gradients now, the parameter gradients kept for
        :meth:`backward_weight` (stage 0, without differentiable inputs, does its whole backward here).

        A compiled stage runs the B graph cut from its joint graph (:mod:`fxpipe.runtime.compile.compiled_split`);
        one that could not be cut (warned) runs its whole compiled backward here and W has no work.
        """
        saved = self._saved[microbatch_index]
        if saved.split is not None:
            return self._split_backward_input(microbatch_index, output_grads)
        if self.compiled is not None:  # a compiled stage run whole (its joint graph could not be cut)
            self._weight_work[microbatch_index] = None
            return self.backward(microbatch_index, output_grads)
        saved = self._saved.pop(microbatch_index)
        outputs, grads = _roots(saved, output_grads)
        names = list(saved.input_leaves)
        input_grads, work = backward_inputs(outputs, grads, [saved.input_leaves[n] for n in names],
                                            self._trained_params())
        self._weight_work[microbatch_index] = work
        return dict(zip(names, input_grads, strict=True))

    def _split_backward_input(self, microbatch_index: int, output_grads: Mapping[str, torch.Tensor]
                              ) -> dict[str, Any]:
        """B of a compiled stage's split backward: its B graph on the gradients of its differentiable
        outputs (the last stage's from its loss; an output without a received gradient gets zeros)."""
        saved = self._saved.pop(microbatch_index)
        assert saved.split is not None and self.split is not None
        outputs = [saved.outputs[self.stage.output_values[i]] for i in saved.split.graphs.differentiable_outputs]
        if saved.loss is not None:
            grads: list[torch.Tensor | None] = list(torch.autograd.grad(saved.loss, outputs, allow_unused=True))
        else:
            grads = [output_grads.get(self.stage.output_values[i])
                     for i in saved.split.graphs.differentiable_outputs]
        ready = [torch.zeros_like(out) if grad is None else grad for out, grad in zip(outputs, grads, strict=True)]
        input_grads, work = self.split.backward_input(saved.split, ready)
        if not saved.split_inputs:  # nothing to send back (stage 0): the whole backward here, as eager does
            self.split.backward_weight(work, None, deferred=False)
            self._weight_work[microbatch_index] = None
        else:
            self._weight_work[microbatch_index] = work
        return dict(zip(saved.split_inputs, input_grads, strict=True))

    def backward_weight(self, microbatch_index: int,
                        on_gradient: Callable[[torch.nn.Parameter], None] | None = None) -> None:
        """W of a split backward: accumulate this micro-batch's parameter gradients into ``.grad``
        (``on_gradient(param)`` after each: :func:`fxpipe.runtime.autograd.split_backward.backward_weights`)."""
        work = self._weight_work.pop(microbatch_index)
        if isinstance(work, WeightWork) or work is None:
            backward_weights(work, on_gradient)
        else:
            assert self.split is not None
            self.split.backward_weight(work, on_gradient)

    def weight_params(self, microbatch_index: int) -> list[torch.nn.Parameter]:
        """The parameters W of this micro-batch will give gradients (the others had theirs in B)."""
        work = self._weight_work.get(microbatch_index)
        if isinstance(work, WeightWork) or work is None:
            return weight_params(work)
        return list(work.params)

    def _trained_params(self) -> list[torch.nn.Parameter]:
        if self.call is not None:  # sharded: FSDP2 swaps in the gathered weights the forward used, read them now
            return gathered_params(self.module)
        if self._trained is None:  # walking parameters by path costs; the set never changes
            self._trained = [p for _, p in self.parameters() if p.requires_grad]
        return self._trained

    def reset(self) -> None:
        """Drop state a failed step may have left behind."""
        self._saved.clear()
        self._weight_work.clear()
        self.probe.start_step()


def _roots(saved: _Saved, output_grads: Mapping[str, torch.Tensor]
           ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Where backward of one micro-batch starts: the weighted loss (last stage) or the outputs that
    need gradients, with their received gradients."""
    if saved.loss is not None:
        return [saved.loss], [None]
    pairs = [(saved.outputs[name], grad) for name, grad in output_grads.items()
             if isinstance(saved.outputs[name], torch.Tensor) and saved.outputs[name].requires_grad]
    return [t for t, _ in pairs], [g for _, g in pairs]


def _is_parameter(module: torch.nn.Module, path: str) -> bool:
    owner_path, _, attribute = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return attribute in owner._parameters and owner._parameters[attribute] is not None


def read_local_loss(loss_parts: list[torch.Tensor], count_parts: list[Any]) -> tuple[float, float]:
    """This rank's summed slice losses and counts as floats, with one wait for the device.

    Summed on the host in micro-batch order in float64, so the result does not depend on where it is read.
    """
    tensors = loss_parts + [c for c in count_parts if isinstance(c, torch.Tensor)]
    if not tensors:
        return 0.0, 0.0
    if len(tensors) == 1:
        read = [float(tensors[0].item())]
    else:
        # a count may sit on another device than the loss (torch.tensor(n) next to a CUDA loss)
        device = tensors[0].device
        read = torch.stack([t.reshape(()).to(device=device, dtype=torch.float64) for t in tensors]).tolist()
    loss_sum, count = 0.0, 0.0
    for value in read[:len(loss_parts)]:
        loss_sum += value
    tensor_counts = iter(read[len(loss_parts):])
    for part in count_parts:
        count += next(tensor_counts) if isinstance(part, torch.Tensor) else part
    return loss_sum, count


def rank_runners(driver: Any) -> dict[int, StageRunner]:
    """This rank's runners by stage index: a VirtualDriver's chunks, or a PipelineDriver's one stage."""
    return getattr(driver, "runners", None) or {driver.stage_index: driver.runner}


def unique_params(named: Any) -> list[tuple[str, torch.nn.Parameter]]:
    """Each trainable parameter once (tied ones appear under several names), with its first name."""
    seen: set[int] = set()
    result = []
    for name, param in named:
        if id(param) not in seen and param.requires_grad:
            seen.add(id(param))
            result.append((name, param))
    return result

