"""Which inputs of a stage its code changes in place (torchvision's ``ReLU(inplace=True)``, ``out += identity``).

A stage receives activations as fresh autograd leaves, and autograd refuses an in-place op on a leaf that
requires grad. The stage runner hands those inputs to the stage as a copy (a ``clone``, through which the
gradient still reaches the leaf); every other input goes as it is, with no copy.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

# ops that return a view of their first argument: writing into the view writes into the input
_VIEW_METHODS = frozenset({"view", "view_as", "reshape", "flatten", "transpose", "permute", "squeeze", "unsqueeze",
                           "narrow", "expand", "t", "contiguous", "unflatten", "split", "chunk", "unbind"})
_VIEW_FUNCTIONS = frozenset({operator.getitem, torch.flatten, torch.reshape, torch.transpose, torch.permute,
                             torch.squeeze, torch.unsqueeze, torch.narrow, torch.split, torch.chunk, torch.unbind})
_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                                operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                                operator.ilshift, operator.irshift, operator.imatmul, operator.setitem})


def inputs_changed_in_place(module: fx.GraphModule) -> frozenset[str]:
    """Names of the placeholders that ``module``'s code writes into, directly or through a view."""
    changed = set()
    for node in module.graph.nodes:
        if node.op == "placeholder" and any(_writes(module, user, node) for user in _aliases(node)):
            changed.add(node.name)
    return frozenset(changed)


def _aliases(node: fx.Node) -> list[fx.Node]:
    """The users of ``node`` and, through view ops, of every view of it."""
    seen: list[fx.Node] = []
    pending = list(node.users)
    while pending:
        user = pending.pop()
        if user in seen:
            continue
        seen.append(user)
        if _is_view(user):
            pending.extend(user.users)
    return seen


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCTIONS


def _writes(module: fx.GraphModule, node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument (a view of ``source`` or ``source`` itself)."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    first = node.args[0]
    if first is not source and not _is_view(first):
        return False
    if node.op == "call_module":
        return bool(getattr(module.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_") and not str(node.target).startswith("_")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS or node.kwargs.get("inplace") is True:
            return True
        name = getattr(node.target, "__name__", "")
        return name.split(".")[0].endswith("_") and not name.startswith("_")
    return False
