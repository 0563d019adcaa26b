"""The loss in the cost model: ``loss_fn`` run on the model's output as fake tensors, or the documented estimate."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.core.fake_log import quiet_fake_tensor_log
from fxpipe.passes.fakerun import RunState, SymbolicCost
from fxpipe.passes.flops import fake_input, local_copy, run_counted

__all__ = ["ESTIMATE", "LossRun", "estimated_loss_cost"]

LossFn = Callable[[Any, Any], Any]

# The estimate without a loss_fn (docs/clusters.md, "The loss"): cross entropy over the last dim of each
# floating output. Forward: max, subtract, exp, sum, log, gather (~5 FLOPs per element); backward: softmax
# minus one-hot (~3). Autograd keeps the log-softmax result, the output's size, for backward.
ESTIMATE = "estimate (cross entropy over the output: log-softmax saved = output bytes)"
_ESTIMATE_FORWARD_FLOPS, _ESTIMATE_BACKWARD_FLOPS = 5, 3
_ESTIMATE_FORWARD_KERNELS, _ESTIMATE_BACKWARD_KERNELS = 4, 3
LOSS_NODE_NAME = "loss"  # the loss's name in the cost graph (fxpipe.passes.costs) and as a saver in a fake run


class LossRun:
    """The ``finish`` step of one fake cost run (:func:`fxpipe.passes.flops.run_fake`): costs the loss.

    After the run, ``cost`` is the loss's SymbolicCost, ``source`` says whether ``loss_fn`` gave it
    (``"loss_fn"``) or the estimate did (and why), and ``input_saved_bytes`` / ``target_saved_bytes``
    count the model's inputs / the targets autograd saves. Without ``example_targets`` the targets are guessed from the output: class ids
    (the output's shape less its last dim, int64), then a tensor like the output; the first that
    ``loss_fn`` accepts at two batch sizes is used. Targets hold the batch in dim 0.
    """

    def __init__(self, loss_fn: LossFn | None, example_targets: Any, batch_size: Any) -> None:
        self.loss_fn, self.example_targets, self.batch_size = loss_fn, example_targets, batch_size
        self.cost: SymbolicCost | None = None
        self.source = ESTIMATE if loss_fn is None else "loss_fn"
        self.input_saved_bytes: sympy.Expr = sympy.Integer(0)
        self.target_saved_bytes: sympy.Expr = sympy.Integer(0)

    def __call__(self, output_node: fx.Node, values: dict[str, Any], state: RunState) -> None:
        self.input_saved_bytes = _input_saved_bytes(output_node.graph, values, state)
        outputs = fx.node.map_arg(output_node.args[0], lambda node: values[node.name])
        if self.loss_fn is not None:
            try:
                self.cost = self._run_loss(self.loss_fn, outputs, state)
                return
            except (RuntimeError, ValueError, TypeError, IndexError) as error:
                self.source = f"estimate (loss_fn failed on fake outputs: {type(error).__name__}: {error})"[:300]
        self.cost = estimated_loss_cost(outputs, state)

    def _run_loss(self, loss_fn: LossFn, outputs: Any, state: RunState) -> SymbolicCost:
        targets = self._targets(loss_fn, outputs)
        leaves: list[torch.Tensor] = []
        local = tree_map(lambda value: local_copy(value, state, leaves), outputs)
        _, cost, saved = run_counted(loss_fn, (local, targets), {}, leaves, state, saver=LOSS_NODE_NAME)
        target_keys = {state.storage_key(t) for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor)}
        sizes = {state.storage_key(t): t.untyped_storage().nbytes() for t in saved
                 if isinstance(t, torch.Tensor) and state.storage_key(t) in target_keys}
        self.target_saved_bytes = sympy.expand(sum((state.expr(size) for size in sizes.values()), sympy.Integer(0)))
        return cost

    def _targets(self, loss_fn: LossFn, outputs: Any) -> Any:
        if self.example_targets is not None:
            return tree_map(lambda value: fake_input(value, self.batch_size, 0), self.example_targets)
        for make in _target_candidates(outputs):
            if _accepts(loss_fn, outputs, make):
                return make(outputs)
        raise ValueError("no guessed targets (class ids, or a tensor like the output) fit loss_fn; "
                         "pass example_targets")


def _input_saved_bytes(graph: fx.Graph, values: dict[str, Any], state: RunState) -> sympy.Expr:
    """Bytes of the tensor inputs (placeholders) some node saved for backward."""
    total = sympy.Integer(0)
    for node in graph.nodes:
        value = values.get(node.name) if node.op == "placeholder" else None
        if isinstance(value, torch.Tensor) and state.storage_key(value) in state.saved_keys:
            total += state.expr(value.untyped_storage().nbytes())
    return sympy.expand(total)


def _target_candidates(outputs: Any) -> Iterator[Callable[[Any], Any]]:
    def class_ids(tree: Any) -> Any:
        return tree_map(lambda t: torch.empty(t.shape[:-1], dtype=torch.int64, device=t.device), tree)

    def like(tree: Any) -> Any:
        return tree_map(lambda t: torch.empty_like(t), tree)

    tensors = [leaf for leaf in tree_flatten(outputs)[0] if isinstance(leaf, torch.Tensor)]
    if tensors and all(t.is_floating_point() and t.dim() >= 2 for t in tensors):
        yield class_ids
    yield like


def _accepts(loss_fn: LossFn, outputs: Any, make: Callable[[Any], Any]) -> bool:
    """Whether ``loss_fn(outputs, make(outputs))`` runs on concrete fakes at the example batch and one row more
    (two sizes, so a target shape that fits by coincidence is not taken), away from the cost run's shape env."""
    for extra_rows in (0, 1):
        with FakeTensorMode(), warnings.catch_warnings(), quiet_fake_tensor_log():  # a wrong guess logs nothing
            warnings.simplefilter("ignore")  # e.g. mse_loss's broadcasting warning for a wrong guess
            probe = tree_map(functools.partial(_concrete_like, extra_rows=extra_rows), outputs)
            try:
                loss_fn(probe, make(probe))
            except Exception:  # noqa: BLE001  (any failure means: not this guess)
                return False
    return True


def _concrete_like(value: Any, extra_rows: int) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    sizes = [_hint(size) for size in value.shape]
    if sizes:
        sizes[0] += extra_rows
    return torch.empty(sizes, dtype=value.dtype)


def _hint(size: Any) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def estimated_loss_cost(outputs: Any, state: RunState) -> SymbolicCost:
    """The documented estimate (:data:`ESTIMATE`) for the model's floating outputs."""
    tensors = [leaf for leaf in tree_flatten(outputs)[0] if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]
    elements = sympy.expand(sum((state.expr(t.numel()) for t in tensors), sympy.Integer(0)))
    num_bytes = sympy.expand(sum((state.expr(t.numel()) * t.element_size() for t in tensors), sympy.Integer(0)))
    return SymbolicCost(
        output_shapes=((),), output_dtypes=("float32",), output_bytes=sympy.Integer(4),
        forward_flops=_ESTIMATE_FORWARD_FLOPS * elements, backward_flops=_ESTIMATE_BACKWARD_FLOPS * elements,
        saved_bytes=num_bytes, param_bytes=0, is_tensor=True,
        forward_bytes_moved=2 * num_bytes, backward_bytes_moved=2 * num_bytes,
        num_forward_kernels=_ESTIMATE_FORWARD_KERNELS if tensors else 0,
        num_backward_kernels=_ESTIMATE_BACKWARD_KERNELS if tensors else 0,
    )
