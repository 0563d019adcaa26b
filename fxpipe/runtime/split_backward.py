"""Split backward for zero-bubble schedules: input gradients now (B), parameter gradients later (W).

B runs ``torch.autograd.grad`` from the stage's outputs (or loss) to its input leaves only, and
captures on the way the gradients arriving at every autograd node where a parameter's path joins
the input path; W later runs ``torch.autograd.grad`` from those captured gradients to the
parameters, so no part of the backward runs twice. The graph analysis and the W pass are
torch.distributed.pipelining's (``_backward``: ``get_param_groups``, ``stage_backward_weight``);
what this module adds is the check that every parameter the outputs reach is covered, with a
fallback to one whole backward in B otherwise (never a silently missing gradient), and the
bookkeeping for one micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining import _backward as pipelining_backward


@dataclass
class WeightWork:
    """What W of one micro-batch needs: the parameter groups with their captured gradients."""

    param_groups: list[dict[str, Any]]


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
    roots = [node for node in map(pipelining_backward._get_grad_fn_or_grad_acc, outputs) if node is not None]
    reverse_edges = pipelining_backward.construct_reverse_graph(roots)
    input_nodes = [pipelining_backward._get_grad_fn_or_grad_acc(leaf) for leaf in input_leaves]
    weight_nodes = {node for node in map(pipelining_backward._get_grad_fn_or_grad_acc, params) if node is not None}
    groups = pipelining_backward.get_param_groups([n for n in input_nodes if n is not None],
                                                  list(weight_nodes), reverse_edges)
    reached = {node for node in weight_nodes if node in reverse_edges}
    covered = set().union(*(group["params"] for group in groups)) if groups else set()
    if reached - covered:  # a parameter's gradient would not come from the captured values: no split
        torch.autograd.backward(list(outputs), grads)
        return [leaf.grad for leaf in input_leaves], None
    handles = [_capture(group, index, node) for group in groups
               for index, node in enumerate(group.setdefault("intermediates_list", list(group["intermediates"])))]
    try:
        input_grads = torch.autograd.grad(list(outputs), list(input_leaves), grads, retain_graph=True,
                                          allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    for group in groups:
        group["intermediates"] = group.pop("intermediates_list")
        group.setdefault("grads", [None] * len(group["intermediates"]))
    return list(input_grads), WeightWork(groups)


def _capture(group: dict[str, Any], index: int, node: torch.autograd.graph.Node) -> Any:
    """Keep the gradient arriving at ``node`` (the ``index``-th join of ``group``) for W."""

    def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
        group.setdefault("grads", [None] * len(group["intermediates_list"]))[index] = grad_outputs

    return node.register_prehook(hook)


def backward_weights(work: WeightWork | None, params: Sequence[torch.nn.Parameter]) -> None:
    """W: accumulate the parameter gradients of one micro-batch into ``.grad`` (as backward would)."""
    if work is None or not work.param_groups:
        return
    # every join lies on the inputs' path, so B reached it (internal invariant)
    assert all(grads is not None for group in work.param_groups for grads in group["grads"]), \
        "split backward: B did not reach every join of the parameter paths"
    pipelining_backward.stage_backward_weight(iter(params), work.param_groups)
