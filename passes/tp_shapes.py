"""Concrete output shapes of a graph's nodes for the tensor-parallel pass (from cost meta, export meta or a fake run)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpipe.core import meta

__all__ = ["NodeShapes", "node_shapes"]

Shape = tuple[Any, ...]  # ints, or for a multi-output node a tuple of int tuples


class NodeShapes:
    """``get(node)``: the node's output shape (a tuple of shapes for a tuple output); KeyError for non-tensors."""

    def __init__(self, shapes: dict[fx.Node, Shape], floating: set[fx.Node] | None = None) -> None:
        self._shapes = shapes
        self._floating = floating or set()

    def floating(self, node: fx.Node) -> bool:
        """Whether the node's output is a floating-point tensor (one that can carry a gradient)."""
        return node in self._floating

    def get(self, node: fx.Node) -> Shape:
        return self._shapes[node]

    def find(self, node: fx.Node) -> Shape | None:
        return self._shapes.get(node)


def _size(value: Any) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else -1
    return int(value)


def _from_value(value: Any) -> Shape | None:
    if isinstance(value, torch.Tensor):
        return tuple(_size(size) for size in value.shape)
    if isinstance(value, list | tuple) and value and all(isinstance(item, torch.Tensor) for item in value):
        return tuple(tuple(_size(size) for size in item.shape) for item in value)
    return None


def _from_cost(node: fx.Node, hint: int) -> Shape | None:
    cost = node.meta.get(meta.COST)
    if cost is None or not cost.is_tensor or not cost.output_shapes:
        return None
    shapes = tuple(tuple(int(sympy.sympify(size).subs(sympy.Symbol("B", integer=True, positive=True), hint))
                         for size in shape) for shape in cost.output_shapes)
    if len(shapes) == 1 and _is_single_tensor(node):
        return shapes[0]
    return shapes


def _is_single_tensor(node: fx.Node) -> bool:
    value = node.meta.get("val", node.meta.get("tensor_meta"))
    if value is not None:
        return not isinstance(value, list | tuple)
    return node.target not in (torch.split, torch.chunk, "split", "chunk")


def node_shapes(gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None) -> NodeShapes:
    """Every tensor node's concrete shape at the example inputs."""
    hint = int(gm.meta.get(meta.COST_BATCH_HINT, 2))
    shapes: dict[fx.Node, Shape] = {}
    floating: set[fx.Node] = set()
    missing = False
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        shape = _from_value(node.meta["val"]) if "val" in node.meta else _from_cost(node, hint)
        if shape is not None:
            shapes[node] = shape
            if _is_floating(node.meta["val"] if "val" in node.meta else node.meta[meta.COST].output_dtypes):
                floating.add(node)
        elif node.op != "get_attr" and _maybe_tensor(node):
            missing = True
    if missing:
        shapes, floating = _fake_run(gm, example_inputs)
    return NodeShapes(shapes, floating)


def _is_floating(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype.is_floating_point
    if isinstance(value, list | tuple) and value:
        return _is_floating(value[0])
    return isinstance(value, str) and ("float" in value or value in ("half", "bfloat16"))


def _maybe_tensor(node: fx.Node) -> bool:
    """Nodes without any shape meta that could still be tensors (size reads never are)."""
    cost = node.meta.get(meta.COST)
    return cost is None and node.target not in ("size", "dim")


def _fake_run(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> tuple[dict[fx.Node, Shape], set[fx.Node]]:
    inputs = example_inputs if example_inputs is not None else gm.meta.get(meta.EXAMPLE_INPUTS)
    if inputs is None:
        raise ValueError("the tensor-parallel pass needs the graph's shapes: pass example_inputs, or trace with "
                         "fxpipe.passes.trace (it records them) or annotate costs first")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(value) if isinstance(value, torch.Tensor) else value for value in inputs]
    had = {node: {key: node.meta[key] for key in ("val", "tensor_meta") if key in node.meta}
           for node in gm.graph.nodes}
    FakeTensorProp(gm, mode).propagate(*fakes)
    shapes: dict[fx.Node, Shape] = {}
    floating: set[fx.Node] = set()
    for node in gm.graph.nodes:
        value = node.meta.pop("val", None)  # FakeTensorProp writes meta; the pass must not leave it changed
        node.meta.pop("tensor_meta", None)
        node.meta.update(had[node])
        shape = _from_value(value)
        if shape is not None:
            shapes[node] = shape
            if _is_floating(value):
                floating.add(node)
    return shapes, floating
