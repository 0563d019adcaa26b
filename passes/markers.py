"""``pipe_split()`` markers (torch.distributed.pipelining's cut points): the compute nodes of each marked stage.

The marker is recognised by name, never imported (only ``fxpipe/runtime`` may import
torch.distributed): a function ``pipe_split`` from ``torch.distributed.pipelining`` (fx front end)
or the ``pippy::_pipe_split`` operator (export front end).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from torch import fx, nn

from fxpipe.core.chain import CostChain
from fxpipe.passes.trace_fx import PathTracer
from fxpipe.passes.trace_inputs import normalize_inputs

MARKER_PACKAGE = "torch.distributed.pipelining"
MARKER_FUNCTION = "pipe_split"
MARKER_OPERATOR = "pippy._pipe_split"
_NOT_COMPUTE = ("placeholder", "output", "get_attr")


class MarkerError(ValueError):
    """``plan="markers"`` cannot be served: no markers, or a marker where the graph cannot be cut."""


def is_marker(target: Any) -> bool:
    """Whether an fx node target is a ``pipe_split()`` marker (the function or its export operator)."""
    if str(target).startswith(MARKER_OPERATOR):
        return True
    module = getattr(target, "__module__", None) or ""
    return getattr(target, "__name__", None) == MARKER_FUNCTION and module.startswith(MARKER_PACKAGE)


def _marker_modules() -> list[ModuleType]:
    """Loaded modules that define or re-export ``pipe_split`` (so ``pipelining.pipe_split()`` is seen too)."""
    return [module for name, module in sorted(sys.modules.items())
            if name.startswith(MARKER_PACKAGE) and module is not None
            and is_marker(getattr(module, MARKER_FUNCTION, None))]


class _MarkerTracer(PathTracer):
    """The fx front end's tracer with ``pipe_split`` recorded as a graph node (fx runs argument-less calls
    eagerly, so the markers are swapped, for the trace only, for a function that adds the node)."""

    def __init__(self, modules: list[ModuleType]) -> None:
        super().__init__(())
        self.marker_modules = modules

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        marker = getattr(self.marker_modules[0], MARKER_FUNCTION)

        def record_marker() -> None:
            self.create_proxy("call_function", marker, (), {})

        scopes = [module.__dict__ for module in self.marker_modules]
        scopes += [getattr(type(module).forward, "__globals__", {}) for module in root.modules()]
        swapped = [(scope, name) for scope in {id(s): s for s in scopes}.values()
                   for name, value in scope.items() if value is marker]
        for scope, name in swapped:
            scope[name] = record_marker
        try:
            return super().trace(root, concrete_args)
        finally:
            for scope, name in swapped:
                scope[name] = marker


def _split_at_markers(nodes: Sequence[fx.Node]) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    for node in nodes:
        if node.op == "call_function" and is_marker(node.target):
            groups.append([])
        elif node.op not in _NOT_COMPUTE:
            groups[-1].append(node.name)
    return groups


def marker_stages(model: nn.Module, example_inputs: Any, gm: fx.GraphModule) -> list[list[str]]:
    """Compute-node names of ``gm`` (``trace(model, example_inputs)``) per marker-delimited stage.

    ``gm`` from the export front end keeps the marker operators; from the fx front end the model is
    traced once more with the markers wrapped, and the node names are matched to ``gm``'s.
    """
    if any(node.op == "call_function" and is_marker(node.target) for node in gm.graph.nodes):
        groups = _split_at_markers(list(gm.graph.nodes))
    else:
        modules = _marker_modules()
        if not modules:
            raise MarkerError("plan='markers' but the model calls no pipe_split(); add "
                              "torch.distributed.pipelining.pipe_split() calls to forward() where stages end, "
                              "or use plan='auto'")
        inputs = normalize_inputs(model, example_inputs)
        graph = _MarkerTracer(modules).trace(model, concrete_args=dict(inputs.bound))
        wanted = {node.name for node in gm.graph.nodes if node.op not in _NOT_COMPUTE}
        groups = [[name for name in group if name in wanted] for group in _split_at_markers(list(graph.nodes))]
        found = [name for group in groups for name in group]
        expected = [node.name for node in gm.graph.nodes if node.op not in _NOT_COMPUTE]
        if found != expected:
            raise MarkerError("the pipe_split() markers could not be matched to the traced graph "
                              f"({len(found)} of {len(expected)} nodes); use plan='auto' or a layout")
    if len(groups) == 1:
        raise MarkerError("plan='markers' but the model calls no pipe_split() in the traced forward(); add "
                          "torch.distributed.pipelining.pipe_split() calls where stages end, or use plan='auto'")
    empty = [index for index, group in enumerate(groups) if not group]
    if empty:
        raise MarkerError(f"pipe_split() markers leave stage(s) {empty} without any computation (two markers in "
                          "a row, or one at the start or end of forward()); remove the extra markers")
    return groups


def marker_stops(chain: CostChain, groups: Sequence[Sequence[str]]) -> list[int]:
    """Block stops of ``chain`` where the marker stages end; MarkerError if a marker splits a block."""
    group_of = {name: index for index, group in enumerate(groups) for name in group}
    owned: list[int | None] = []
    for block in chain.blocks:
        owners = sorted({group_of[name] for name in block.node_names if name in group_of})
        if len(owners) > 1:
            raise MarkerError(f"pipe_split() marker {owners[0]} sits inside chain block {block.name!r}, whose "
                              "nodes must stay on one stage (a non-tensor value crosses there); move the marker "
                              "before or after that code")
        owned.append(owners[0] if owners else None)
    # Blocks of parameter reads only (get_attr) go with the computation after them, trailing ones before.
    following = [group for group in owned if group is not None]
    if not following:
        raise MarkerError("the marked stages' nodes are not in the cost chain; use plan='auto' or a layout")
    block_groups: list[int] = []
    for group in owned:
        if group is not None:
            following.pop(0)
        block_groups.append(group if group is not None else (following[0] if following else block_groups[-1]))
    if block_groups != sorted(block_groups) or set(block_groups) != set(range(len(groups))):
        raise MarkerError(f"the pipe_split() markers do not cut the graph into {len(groups)} ordered stages "
                          f"(stage of each block: {block_groups}); use plan='auto' or a layout")
    last = chain.num_blocks - 1
    return [index + 1 for index in range(last) if block_groups[index] != block_groups[index + 1]] + [last + 1]
