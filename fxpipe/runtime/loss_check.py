"""``loss_fn`` checked at compile on fake outputs of the model's output shapes: signature and return value."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.core.fake_log import quiet_fake_tensor_log
from fxpipe.core.program import SplitProgram, tree_leaves
from fxpipe.runtime.execution.stage import rebuild_tree, split_loss
from fxpipe.runtime.faults.errors import LossFunctionError


def check_loss_fn(loss_fn: Callable[..., Any], program: SplitProgram, loss_reduction: str) -> None:
    """Raise :class:`LossFunctionError` when ``loss_fn(output, targets)`` cannot be the loss.

    ``loss_fn`` must take two positional arguments. It is then called on fake tensors (no memory, no
    compute) shaped as the model's output at the example batch, with guessed targets: class ids (the
    output's shape less its last dim), then a tensor like the output. When a guess runs, what
    ``loss_fn`` returns must fit ``loss_reduction``: a scalar tensor, or a ``(sum, count)`` pair for
    ``"token_mean"``. When no guess runs (targets of another shape, a loss that reads values) nothing
    more can be told here: the first step's checks apply. Decided from the program: alike on every rank.
    """
    _check_signature(loss_fn)
    specs = [program.values[name] for name in tree_leaves(program.output_tree)]
    if not all(spec.is_tensor for spec in specs):  # a Python value in the output: known at the first step only
        return
    problems: list[str] = []
    with FakeTensorMode(), warnings.catch_warnings(), quiet_fake_tensor_log():
        warnings.simplefilter("ignore")  # e.g. mse_loss's broadcasting warning for a wrong guess
        output = rebuild_tree(program.output_tree, {spec.name: _fake(spec.shape, spec.dtype) for spec in specs})
        for targets in _guessed_targets(output):
            try:
                result = loss_fn(output, targets)
            except Exception:  # noqa: BLE001  (this guess of the targets does not fit; try the next)
                continue
            try:
                split_loss(result, loss_reduction)
                return
            except TypeError:
                problems.append(_described(result, loss_reduction))
    if problems:
        raise LossFunctionError(f"{problems[0]} (found at compile: loss_fn called on the model's example output"
                                f"{_shapes(output)} and guessed targets)")


def _check_signature(loss_fn: Callable[..., Any]) -> None:
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return
    try:
        signature.bind(object(), object())
    except TypeError as error:
        name = getattr(loss_fn, "__qualname__", type(loss_fn).__name__)
        raise LossFunctionError(
            f"loss_fn {name}{signature} cannot be called as loss_fn(output, targets) ({error}); fxpipe calls it with "
            "the model's output and the targets passed to step(): give a function of exactly those two, e.g. "
            "lambda output, targets: F.cross_entropy(output.flatten(0, -2), targets.flatten())") from None


def _fake(shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or torch.float32)


def _guessed_targets(output: Any) -> Iterator[Any]:
    tensors = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)]
    if tensors and all(t.is_floating_point() and t.dim() >= 2 for t in tensors):
        yield tree_map(lambda t: torch.zeros(t.shape[:-1], dtype=torch.int64) if isinstance(t, torch.Tensor) else t,
                       output)
    yield tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, output)


def _described(result: Any, loss_reduction: str) -> str:
    got = f"a tensor of shape {tuple(result.shape)}" if isinstance(result, torch.Tensor) else type(result).__name__
    if loss_reduction == "token_mean":
        return (f"loss_fn returned {got}; loss_reduction='token_mean' needs a (loss_sum, count) "
                "pair, e.g. (F.cross_entropy(..., reduction='sum'), (targets != -100).sum())")
    pair = "; a (sum, count) pair needs loss_reduction='token_mean'" if isinstance(result, tuple | list) else ""
    return (f"loss_fn returned {got}, but the loss must be a scalar tensor{pair}; reduce it "
            f"with .mean() (a per-row mean) or .sum(), e.g. F.cross_entropy(..., reduction='mean')")


def _shapes(tree: Any) -> str:
    shapes = [tuple(leaf.shape) for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]
    if not shapes:
        return ""
    return f" of shape {shapes[0]}" if len(shapes) == 1 else f" of shapes {shapes}"
