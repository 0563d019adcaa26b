"""Walks over an autograd graph for split backward, on torch's public ``Node`` API only.

Zero-bubble's B and W need the nodes where a parameter's gradient path joins the path from the
stage's outputs to its inputs. torch.distributed.pipelining computes the same in private helpers
whose signatures and semantics changed between torch releases (the W pass in 2.4 took one gradient
per join, in 2.13 one per output of the join); this module keeps fxpipe on public calls only:
``Node.next_functions``, ``Node.register_prehook``, ``torch.autograd.graph.get_gradient_edge`` and
``torch.autograd.grad`` over ``GradientEdge`` outputs and inputs.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

ReverseEdges = dict[Node, list[Node]]


def grad_node(tensor: torch.Tensor) -> Node | None:
    """The node backward reaches for ``tensor``: its ``grad_fn``, or a leaf's gradient accumulator (None
    when it needs no gradient)."""
    if not tensor.requires_grad:
        return None
    return tensor.grad_fn if tensor.grad_fn is not None else get_gradient_edge(tensor).node


def reverse_edges(roots: Iterable[Node | None]) -> ReverseEdges:
    """For every node backward from ``roots`` reaches: the nodes that feed it a gradient (its consumers)."""
    edges: ReverseEdges = defaultdict(list)
    queue = _start(roots, set())
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if not edges[child]:
                queue.append(child)
            edges[child].append(node)
    return edges


def _start(nodes: Iterable[Node | None], seen: set[Node]) -> deque[Node]:
    """A walk's first queue: each distinct node once, added to ``seen``."""
    queue: deque[Node] = deque()
    for node in nodes:
        if node is not None and node not in seen:
            seen.add(node)
            queue.append(node)
    return queue


def _closure(starts: Iterable[Node | None], stop_at: set[Node], edges: ReverseEdges) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` along ``edges`` (toward the outputs), and those of ``stop_at`` met on the way
    (not walked past)."""
    closure: set[Node] = set()
    met: set[Node] = set()
    queue = _start(starts, closure)
    while queue:
        for consumer in edges[queue.popleft()]:
            if consumer in closure:
                continue
            if consumer in stop_at:
                met.add(consumer)
                continue
            closure.add(consumer)
            queue.append(consumer)
    return closure, met


def param_groups(input_nodes: Sequence[Node], param_nodes: Sequence[Node], edges: ReverseEdges) -> list[dict[str, Any]]:
    """Parameters grouped by the joins their gradient paths share with the inputs' path.

    Each group is ``{"params": set of accumulator nodes, "intermediates": set of join nodes}``: the
    gradient arriving at the joins (captured in B) is all W needs to compute the group's parameter
    gradients. Parameters whose paths meet at a join land in one group. The groups come in the order of their
    first parameter in ``param_nodes`` (the same on every process given the same parameters), whatever order the
    walks meet the joins in.
    """
    inputs_path, _ = _closure(input_nodes, set(), edges)
    by_join: dict[Node, dict[str, Any]] = {}
    for param in param_nodes:
        _, joins = _closure([param], inputs_path, edges)
        group: dict[str, Any] = {"params": {param}, "intermediates": set(joins)}
        for join in joins:
            existing = by_join.get(join)
            if existing is not None:
                existing["params"] = existing["params"] | group["params"]
                existing["intermediates"] = existing["intermediates"] | group["intermediates"]
                group = existing
            else:
                by_join[join] = group
    unique: dict[int, dict[str, Any]] = {}
    for group in by_join.values():
        unique.setdefault(id(group), group)
    position = {node: index for index, node in enumerate(param_nodes)}
    return sorted(unique.values(), key=lambda group: min(position[node] for node in group["params"]))


def weight_gradients(group: dict[str, Any]) -> list[tuple[Node, torch.Tensor]]:
    """W for one group: ``(accumulator node, gradient)`` of each parameter, from the gradients captured at the
    group's joins (``group["grads"][i]``: the tuple that arrived at ``group["intermediates"][i]``).

    When a group has several joins, one join can feed another; each join's prehook then hands back the
    captured value so that nothing is counted twice on the way.
    """
    edges: list[GradientEdge] = []
    outputs: list[torch.Tensor] = []
    for grads, join in zip(group["grads"], group["intermediates"], strict=True):
        for index, grad in enumerate(grads):
            if grad is not None:
                edges.append(GradientEdge(join, index))
                outputs.append(grad)
    if not edges:
        return []
    handles = []
    if len(group["intermediates"]) > 1:
        handles = [join.register_prehook(lambda _, captured=grads: captured)
                   for grads, join in zip(group["grads"], group["intermediates"], strict=True)]
    del group["intermediates"], group["grads"]  # the prehooks hold what they need; free the rest now
    try:
        params = list(group["params"])
        results = torch.autograd.grad(edges, [GradientEdge(node, 0) for node in params], grad_outputs=outputs)
    finally:
        for handle in handles:
            handle.remove()
    return list(zip(params, results, strict=True))
