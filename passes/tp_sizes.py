"""Rewriting helpers of shard_stage: local sizes in shape arguments, and the whole nodes whose gradients are partial."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

from fxpipe.passes.tp_plan import StagePlanTP
from fxpipe.passes.tp_rules import Shard
from fxpipe.passes.tp_shapes import NodeShapes

__all__ = ["local_args", "needs_grad", "parameters_read", "whole_grad_region"]

_SHAPE_LISTS = frozenset({"view", "reshape", "_unsafe_view", "expand"})


def local_args(node: fx.Node, args: list[Any], kwargs: dict[str, Any], name: str, state: Shard,
               shapes: NodeShapes, divide: Callable[..., Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``node``'s (already mapped) args with the split dim's full size replaced by ``divide(size)``: view /
    reshape / expand shapes, unflatten sizes, and (``divide(size, True)``: always) the part sizes of a split
    along the split dim."""
    if name in _SHAPE_LISTS:
        if len(args) == 2 and isinstance(args[1], list | tuple):
            sizes = list(args[1])
            sizes[state.dim] = divide(sizes[state.dim])
            args[1] = type(args[1])(sizes)
        elif "size" in kwargs or "shape" in kwargs:
            key = "size" if "size" in kwargs else "shape"
            sizes = list(kwargs[key])
            sizes[state.dim] = divide(sizes[state.dim])
            kwargs[key] = sizes
        else:  # x.view(a, b, c): sizes as varargs
            args[1 + state.dim] = divide(args[1 + state.dim])
    elif name == "unflatten":
        first = int(args[1]) % len(shapes.get(_source(node)))
        sizes = list(args[2])
        if first <= state.dim < first + len(sizes):
            sizes[state.dim - first] = divide(sizes[state.dim - first])
        args[2] = tuple(sizes)
    elif name in ("split", "split_with_sizes"):
        dim = int(args[2] if len(args) > 2 else kwargs.get("dim", 0)) % len(shapes.get(_source(node)))
        if dim == state.dim:  # fused parts: each member keeps its share of every part
            sizes = args[1]
            args[1] = [divide(size, True) for size in sizes] if isinstance(sizes, list | tuple) \
                else divide(sizes, True)
    return tuple(args), kwargs


def _source(node: fx.Node) -> fx.Node:
    source = node.args[0]
    assert isinstance(source, fx.Node)
    return source


def needs_grad(gm: fx.GraphModule, shapes: NodeShapes) -> set[fx.Node]:
    """Nodes whose value depends on a trainable parameter or a floating-point stage input (through tensors)."""
    found: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attribute(gm, str(node.target))
            if getattr(value, "requires_grad", False):
                found.add(node)
        elif node.op == "placeholder":
            if shapes.floating(node):
                found.add(node)
        elif node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(str(node.target)).parameters()):
            found.add(node)
        elif shapes.floating(node) and any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def _attribute(gm: fx.GraphModule, path: str) -> Any:
    value: Any = gm
    for atom in path.split("."):
        value = getattr(value, atom)
    return value


def whole_grad_region(gm: fx.GraphModule, plan: StagePlanTP, shapes: NodeShapes) -> tuple[set[fx.Node], set[str]]:
    """Whole nodes whose gradient is member-specific: the ones (kv projections kept whole, a norm before them)
    whose every use is inside a split region and that lead to a local slice. Their values from outside enter
    through copy_to_group; the parameters they read have partial gradients (returned as attribute paths)."""
    grads = needs_grad(gm, shapes)
    split = set(plan.states.states) | set(plan.states.rows)
    sliced = {arg for args in plan.local_slices.values() for arg in args}
    region: set[fx.Node] = set()
    for node in reversed(gm.graph.nodes):  # users first: one pass decides every node
        if node in split or node not in grads or node.op in ("placeholder", "get_attr", "output"):
            continue
        leads = node in sliced or any(user in region for user in node.users)
        if leads and all(user in region or user in split for user in node.users):
            region.add(node)
    return region, parameters_read(gm, region)


def parameters_read(gm: fx.GraphModule, nodes: set[fx.Node] | frozenset[fx.Node]) -> set[str]:
    """Attribute paths of the parameters and buffers ``nodes`` read (get_attr arguments, call_module ones)."""
    paths = set()
    for node in nodes:
        if node.op == "call_module":
            paths |= {f"{node.target}.{name}" for name, _ in gm.get_submodule(str(node.target)).named_parameters()}
        paths |= {str(arg.target) for arg in node.all_input_nodes if arg.op == "get_attr"}
    return paths
