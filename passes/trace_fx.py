"""The torch.fx front end of trace(): symbolic tracing with a leaf policy and module-path tracking."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from fxpipe.core import meta
from fxpipe.passes.trace_inputs import TraceInputs

# Recurrent layers are opaque, fused kernels (and return nested tuples): never trace into them.
DEFAULT_LEAF_TYPES: tuple[type[nn.Module], ...] = (nn.RNNBase,)

# Nodes fx inserts to guard a specialised (concrete) argument; they go when the placeholder goes.
_SPECIALISATION_GUARDS: tuple[Callable[..., Any], ...] = (
    fx._symbolic_trace._assert_is_none,
    torch._assert,
    operator.eq,
)


class FxTraceFailure(Exception):
    """fx could not trace the model; `module_path`/`module_class` name the innermost module that broke."""

    def __init__(self, module_path: str, module_class: str, reason: BaseException) -> None:
        self.module_path = module_path
        self.module_class = module_class
        self.reason = reason
        super().__init__(f"{describe_module(module_path, module_class)}: {reason}")


def describe_module(module_path: str, module_class: str) -> str:
    """'blocks.3 (MyBlock)', or '<root> (MyModel)' for the model itself."""
    return f"{module_path or '<root>'} ({module_class})"


def validate_leaf_modules(leaf_modules: Sequence[object]) -> tuple[type[nn.Module] | str, ...]:
    """leaf_modules entries must be nn.Module subclasses or module-path prefixes."""
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = (leaf_modules,)
    checked: list[type[nn.Module] | str] = []
    for entry in leaf_modules:
        if isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module)):
            checked.append(entry)
        else:
            raise TypeError(
                f"leaf_modules entry {entry!r} is a {type(entry).__name__}; give nn.Module subclasses "
                "(e.g. MyBlock) or module-path prefixes (e.g. 'blocks.3')"
            )
    return tuple(checked)


class PathTracer(fx.Tracer):
    """fx.Tracer that keeps the module path of every node and remembers where tracing broke.

    Leaves: whatever fx treats as a leaf (torch.nn built-ins), recurrent layers, instances of the
    user's leaf classes, and modules at or below one of the user's path prefixes.
    """

    def __init__(self, leaf_modules: tuple[type[nn.Module] | str, ...]) -> None:
        super().__init__()
        self.leaf_types = DEFAULT_LEAF_TYPES + tuple(e for e in leaf_modules if isinstance(e, type))
        self.leaf_prefixes = tuple(e for e in leaf_modules if isinstance(e, str))
        self.path_stack: list[str] = []
        self.failed_at: tuple[str, str] | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_types):
            return True
        if any(_under_prefix(module_qualified_name, prefix) for prefix in self.leaf_prefixes):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        module_path = self.path_of_module(m)
        self.path_stack.append(module_path)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            # The innermost module sees the exception first; outer frames keep its location.
            if self.failed_at is None:
                self.failed_at = (module_path, type(m).__name__)
            raise
        finally:
            self.path_stack.pop()

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta[meta.MODULE_PATH] = self.path_stack[-1] if self.path_stack else ""
        return node


def _under_prefix(module_path: str, prefix: str) -> bool:
    return module_path == prefix or module_path.startswith(prefix + ".")


def trace_fx(
    model: nn.Module, inputs: TraceInputs, leaf_modules: tuple[type[nn.Module] | str, ...]
) -> fx.GraphModule:
    """Symbolically trace `model`; FxTraceFailure names the module that broke."""
    tracer = PathTracer(leaf_modules)
    try:
        graph = tracer.trace(model, concrete_args=dict(inputs.bound))
    except Exception as error:
        module_path, module_class = tracer.failed_at or ("", type(model).__name__)
        raise FxTraceFailure(module_path, module_class, error) from error
    _drop_bound_placeholders(graph, set(inputs.names))
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    return gm


def _drop_bound_placeholders(graph: fx.Graph, input_names: set[str]) -> None:
    """Remove placeholders of specialised arguments and the guards fx added for them.

    Specialised values are inlined as constants, so the placeholders' only users are guard nodes.
    fx names those placeholders `<name>_1`, so they are found as the ones that are not inputs.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and n.target not in input_names]
    doomed: dict[fx.Node, None] = {}
    for placeholder in placeholders:
        _collect_users(placeholder, doomed)
    for node in reversed(list(graph.nodes)):
        if node in doomed:
            assert node.op == "placeholder" or node.target in _SPECIALISATION_GUARDS, node.format_node()
            graph.erase_node(node)


def _collect_users(node: fx.Node, found: dict[fx.Node, None]) -> None:
    found[node] = None
    for user in node.users:
        if user not in found:
            _collect_users(user, found)
