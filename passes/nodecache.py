"""Node signatures and recorded costs that let a fake run replay a repeated node instead of running it."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import sympy
import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.passes.fakerun import Recipe, RunState, SymbolicCost


class _Uncacheable(Exception):
    """A node argument or module attribute has no safe signature: the node is costed afresh."""


_PLAIN = (int, float, bool, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.layout, torch.memory_format)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def node_signature(
    gm: fx.GraphModule, node: fx.Node, arguments: Any, storage_keys: Sequence[int], state: RunState
) -> Hashable | None:
    """What a node's costs depend on, or None if that cannot be told safely (the node is then run).

    The op and target (for ``call_module`` the module's classes, public attributes and parameter
    shapes), the argument structure, per argument its symbolic shape, strides, offset, storage
    size, dtype, requires_grad and whether it is a weight (tensors) or its value (everything
    else), and which arguments share a storage (``storage_keys``, one per leaf, 0 for non-tensors).
    """
    leaves, spec = tree_flatten(arguments)
    try:
        keys = tuple(_leaf_key(leaf, state) for leaf in leaves)
        target = _module_key(gm.get_submodule(str(node.target)), state) if node.op == "call_module" else node.target
        sharing = tuple(storage_keys.index(key) if key else -1 for key in storage_keys)
        signature = node.op, target, str(spec), keys, sharing
        hash(signature)
    except (_Uncacheable, TypeError):  # TypeError: an unhashable target or attribute
        return None
    return signature


def _leaf_key(value: Any, state: RunState) -> Hashable:
    if isinstance(value, torch.Tensor):
        sizes = (*value.shape, *value.stride(), value.storage_offset(), value.untyped_storage().nbytes())
        sizes = tuple(_leaf_key(size, state) for size in sizes)
        return "tensor", value.dim(), sizes, value.dtype, value.requires_grad, value._is_view(), id(value) in state.fake_ids
    if isinstance(value, _SYMBOLIC):
        return type(value).__name__, value.node.expr
    if isinstance(value, _PLAIN):
        return type(value).__name__, value
    if isinstance(value, tuple | list):
        return type(value).__name__, tuple(_leaf_key(item, state) for item in value)
    if isinstance(value, slice):
        return "slice", tuple(_leaf_key(item, state) for item in (value.start, value.stop, value.step))
    raise _Uncacheable(type(value).__name__)


def _module_key(module: torch.nn.Module, state: RunState) -> Hashable:
    """Classes and public attributes of a module and its children, and its parameter/buffer metadata."""
    if id(module) not in state.module_keys:
        parts: list[Hashable] = []
        for name, sub in module.named_modules(remove_duplicate=False):
            attributes = sorted((key, _attribute_key(value)) for key, value in vars(sub).items() if not key.startswith("_"))
            parts.append((name, type(sub), tuple(attributes)))
        parts.extend((name, tuple(t.shape), t.dtype, t.requires_grad) for name, t in module_tensors(module))
        state.module_keys[id(module)] = tuple(parts)
    return state.module_keys[id(module)]


def _attribute_key(value: Any) -> Hashable:
    """Plain values by value; anything else (a config object, a function) by identity."""
    if isinstance(value, _PLAIN):
        return type(value).__name__, value
    if isinstance(value, tuple) and all(isinstance(item, _PLAIN) for item in value):
        return "tuple", value
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype, value.requires_grad
    return "object", id(value)


def input_key(leaf: Any, key: Any, state: RunState) -> int:
    """The storage key of one argument leaf (0 for non-tensors; constants in node.args have none recorded)."""
    if not isinstance(leaf, torch.Tensor):
        return 0
    return key if type(key) is int and key != 0 else state.storage_key(leaf)


def materialize(leaf: Any, key: int, state: RunState) -> Any:
    """A fresh fake of ``leaf`` on a storage keyed ``key`` when ``leaf`` is a replayed node's shared output."""
    if not isinstance(leaf, torch.Tensor) or state.storage_key(leaf) == key:
        return leaf
    storage_numel = leaf.untyped_storage().nbytes() // leaf.element_size()
    base = torch.empty((storage_numel,), dtype=leaf.dtype, device=leaf.device, requires_grad=leaf.requires_grad)
    state.storage_alias[int(base.untyped_storage()._cdata)] = key
    state.keep_alive.append(base)
    return base.as_strided(leaf.shape, leaf.stride(), leaf.storage_offset())


def record_recipe(
    output: Any, cost: SymbolicCost, saved: Sequence[torch.Tensor], input_keys: Sequence[int], state: RunState
) -> Recipe | None:
    """The recipe of a measured node, or None if its output holds values a replay cannot share."""
    out_leaves, _ = tree_flatten(output)
    if not all(isinstance(leaf, (torch.Tensor, *_SYMBOLIC, *_PLAIN)) for leaf in out_leaves):
        return None
    fresh: dict[int, int] = {}

    def storage(key: int, output_keys: Sequence[int]) -> tuple[str, int]:
        if key in input_keys:
            return "input", list(input_keys).index(key)
        if key in output_keys:
            return "output", list(output_keys).index(key)
        return "fresh", fresh.setdefault(key, len(fresh))

    out_keys = [state.storage_key(leaf) if isinstance(leaf, torch.Tensor) else 0 for leaf in out_leaves]
    output_storages = tuple(storage(key, ()) if key else None for key in out_keys)
    saved_storages = tuple(
        (storage(key, out_keys), state.expr(tensor.untyped_storage().nbytes()))
        for tensor in saved
        if isinstance(tensor, torch.Tensor) and (key := state.storage_key(tensor)) not in state.weight_keys
    )
    return Recipe(cost=cost, output=output, output_storages=output_storages, saved=saved_storages)


def replay(
    node: fx.Node, recipe: Recipe, input_keys: Sequence[int], state: RunState, param_bytes: int
) -> tuple[Any, SymbolicCost]:
    """A repeat of a measured node: its output and costs, with saved bytes redone here and ``param_bytes`` its own."""
    fresh: dict[int, int] = {}

    def key_of(storage: tuple[str, int]) -> int:
        kind, index = storage
        if kind == "input":
            return input_keys[index]
        if kind == "output":
            return output_keys[index]
        return fresh.setdefault(index, state.new_key())

    output_keys = [0 if storage is None else key_of(storage) for storage in recipe.output_storages]
    leaves, spec = tree_flatten(recipe.output)
    state.keys[node.name] = tree_unflatten(output_keys, spec)
    saved_bytes = sympy.Integer(0)
    resaved: list[tuple[str, sympy.Expr]] = []
    for storage, num_bytes in recipe.saved:
        saved_bytes += state.note_saved(key_of(storage), num_bytes, node.name, resaved)
    return recipe.output, dataclasses.replace(recipe.cost, saved_bytes=sympy.expand(saved_bytes),
                                              resaved=tuple(resaved), param_bytes=param_bytes)


def module_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and buffers with their names, duplicates (tied weights) included."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
