"""Split backward for zero-bubble schedules: input gradients now (B), parameter gradients later (W).

B runs ``torch.autograd.grad`` from the stage's outputs (or loss) to its input leaves (and the
vector parameters, see :func:`_vector_groups`), and captures on the way the gradients arriving at
every autograd node where another parameter's path joins the input path; W later runs ``torch.autograd.grad`` from those captured gradients to the
parameters, so no part of the backward runs twice. The graph analysis and the W pass follow
torch.distributed.pipelining's (``_backward``) on public autograd calls only
(:mod:`fxpipe.runtime.autograd.autograd_graph`: its private helpers changed between torch releases);
what this module adds is the check that every parameter the outputs reach is covered, with a
fallback to one whole backward in B otherwise (never a silently missing gradient), and the
bookkeeping for one micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.core.backward_phase import backward_phase
from fxpipe.runtime.autograd.autograd_graph import grad_node, param_groups, reverse_edges, weight_gradients


@dataclass
class WeightWork:
    """What W of one micro-batch needs: the parameter groups with their captured gradients, and the
    parameter behind each gradient accumulator node (found in B's graph walk)."""

    param_groups: list[dict[str, Any]]
    params_by_node: dict[Any, torch.nn.Parameter]


def backward_inputs(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                    input_leaves: Sequence[torch.Tensor],
                    params: Sequence[torch.nn.Parameter]) -> tuple[list[torch.Tensor | None], WeightWork | None]:
    """B: the gradient of every input leaf (None when unused) and the deferred W work.

    Returns ``None`` for the W work when the whole backward already ran here: a stage without
    differentiable inputs (stage 0), or parameters whose path never meets the inputs' path.
    """
    if not outputs:
        return [None] * len(input_leaves), None
    grads = [torch.ones_like(t) if g is None else g for t, g in zip(outputs, output_grads, strict=True)]
    if not input_leaves:
        torch.autograd.backward(list(outputs), grads)
        return [], None
    edges = reverse_edges(grad_node(t) for t in outputs)
    input_nodes = [grad_node(leaf) for leaf in input_leaves]
    param_nodes = [(node, param) for param in params if (node := grad_node(param)) is not None]
    weight_nodes = {node for node, _ in param_nodes}
    # in the parameters' order (not a set's, which differs between processes): W runs the groups in this order, and
    # a join whose backward runs a collective (a sequence-parallel column linear gathers its input again) must meet
    # its peers' in the same order on every member of a tensor-parallel group
    groups = param_groups([n for n in input_nodes if n is not None], list(dict.fromkeys(n for n, _ in param_nodes)),
                          edges)
    reached = {node for node in weight_nodes if node in edges}
    covered = set().union(*(group["params"] for group in groups)) if groups else set()
    if reached - covered:  # a parameter's gradient would not come from the captured values: no split
        torch.autograd.backward(list(outputs), grads)
        return [leaf.grad for leaf in input_leaves], None
    now, groups = _vector_groups(groups, param_nodes)
    handles = [_capture(group, index, node) for group in groups
               for index, node in enumerate(group.setdefault("intermediates_list", list(group["intermediates"])))]
    try:
        with backward_phase("inputs"):
            results = torch.autograd.grad(list(outputs), [*input_leaves, *now], grads, retain_graph=True,
                                          allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    accumulate(now, results[len(input_leaves):])
    for group in groups:
        group["intermediates"] = group.pop("intermediates_list")
        group.setdefault("grads", [None] * len(group["intermediates"]))
    return list(results[:len(input_leaves)]), WeightWork(groups, dict(param_nodes))


def _vector_groups(groups: list[dict[str, Any]], param_nodes: Sequence[tuple[Any, torch.nn.Parameter]],
                   ) -> tuple[list[torch.nn.Parameter], list[dict[str, Any]]]:
    """The parameters (in ``param_nodes`` order) of groups holding only vectors (norms' scales and
    shifts), and the other groups, whose W stays deferred.

    A vector's gradient is a reduction over rows, a few microseconds inside B's own pass, where a W
    pass of its own costs a whole ``autograd.grad`` call (~0.1 ms on a CPU rank).
    """
    is_vector = {node: param.dim() <= 1 for node, param in param_nodes}
    now_nodes: set[Any] = set()
    deferred = []
    for group in groups:
        if all(is_vector[node] for node in group["params"]):
            now_nodes |= group["params"]
        else:
            deferred.append(group)
    return [param for node, param in param_nodes if node in now_nodes], deferred


def accumulate(params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor | None]) -> None:
    """Add each gradient to its parameter's ``.grad`` as backward's accumulation does."""
    with torch.no_grad():
        for param, grad in zip(params, grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:  # a view (of a compiled W's output) is copied: ``+=`` must not write through it
                param.grad = grad if grad._base is None and grad.stride() == param.stride() else \
                    torch.empty_like(param).copy_(grad)
            else:
                param.grad += grad


def _capture(group: dict[str, Any], index: int, node: torch.autograd.graph.Node) -> Any:
    """Keep the gradient arriving at ``node`` (the ``index``-th join of ``group``) for W."""

    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.setdefault("grads", [None] * len(group["intermediates_list"]))[index] = grad_outputs

    return node.register_prehook(hook)


def weight_params(work: WeightWork | None) -> list[torch.nn.Parameter]:
    """The parameters whose gradients W of ``work`` accumulates (none when B did the whole backward)."""
    if work is None:
        return []
    return [work.params_by_node[node] for group in work.param_groups for node in group["params"]]


def backward_weights(work: WeightWork | None,
                     on_gradient: Callable[[torch.nn.Parameter], None] | None = None) -> None:
    """W: accumulate the parameter gradients of one micro-batch into ``.grad`` (as backward would);
    ``on_gradient(param)`` after each parameter's gradient is in (the bucketed allreduce's readiness)."""
    if work is None or not work.param_groups:
        return
    # every join lies on the inputs' path, so B reached it (internal invariant)
    assert all(grads is not None for group in work.param_groups for grads in group["grads"]), \
        "split backward: B did not reach every join of the parameter paths"
    with backward_phase("weights"):
        for group in work.param_groups:
            gradients = weight_gradients(group)
            params = [work.params_by_node[node] for node, _ in gradients]
            accumulate(params, [grad for _, grad in gradients])
            if on_gradient is not None:
                for param in params:
                    on_gradient(param)
