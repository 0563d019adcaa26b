"""The torch.export front end of trace(): non-strict export, unlifted to a plain fx.GraphModule."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import fx, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import TreeSpec

from fxpipe.core import meta
from fxpipe.passes.batchdims import default_batch_dims
from fxpipe.passes.trace_inputs import TraceInputs
from fxpipe.passes.trace_wrappers import named_forward

# ep.module() inserts this submodule call to re-check export's input guards on every call.
_GUARDS_TARGET = "_guards_fn"


class ExportTraceFailure(Exception):
    """torch.export failed; `module_path`/`module_class` name the innermost module that was running."""

    def __init__(self, module_path: str, module_class: str, reason: BaseException) -> None:
        self.module_path = module_path
        self.module_class = module_class
        self.reason = reason
        super().__init__(f"{module_path or '<root>'} ({module_class}): {reason}")


def trace_export(model: nn.Module, inputs: TraceInputs, dims: Sequence[int | None] | None = None) -> fx.GraphModule:
    """torch.export the model at the example shapes and return a GraphModule with flat inputs.

    The unlifted module of torch.export takes pytree-structured inputs through a custom codegen; this
    rewrites it to plain placeholders (one per example tensor, forward() order) and plain outputs
    (Mappings such as Hugging Face ModelOutput become dicts, sequences become tuples/lists). ``dims``:
    each input's batch dim, where the symbolic batch goes (default: ``default_batch_dims``).
    """
    if dims is None:
        dims = default_batch_dims(inputs.values)
    kwargs = {**dict(zip(inputs.names, inputs.values, strict=True)), **inputs.bound}
    batch_shapes = _batch_dynamic_shapes(inputs, dims)
    # a wrapper's forward(*args, **kwargs) is exported as a forward that names the inputs (trace_wrappers)
    with named_forward(model, list(kwargs)) if inputs.wrapper_route else nullcontext():
        exported = _export(model, inputs, kwargs, batch_shapes)
    unlifted = exported.module()
    graph = _plain_graph(unlifted.graph, set(inputs.names), exported.call_spec.out_spec)
    _localise_symbolic_sizes(graph)
    gm = fx.GraphModule(unlifted, graph, class_name=type(model).__name__)
    _annotate_module_paths(gm.graph)
    gm.meta[meta.SYMBOLIC_BATCH] = batch_shapes is not None and _has_symbolic_batch(gm.graph, dims)
    gm.meta[meta.STATIC_INPUT_DIMS] = _static_input_dims(gm.graph)
    return gm


def _export(model: nn.Module, inputs: TraceInputs, kwargs: dict[str, Any],
            batch_shapes: dict[str, Any] | None) -> torch.export.ExportedProgram:
    exported = None
    # a symbolic batch keeps every view generic in the batch size; the other dims (sequence length, image
    # size) symbolic where the model allows (Dim.AUTO specialises a dim the model fixes instead of failing),
    # so one program runs batches of other shapes (STATIC_INPUT_DIMS records the dims it fixed)
    for shapes in (_other_dims_auto(inputs, batch_shapes), batch_shapes):
        if shapes is None or exported is not None:
            continue
        try:
            exported = torch.export.export(model, (), kwargs, dynamic_shapes=shapes, strict=False)
        except Exception:  # the model specialises the batch: export it static, annotate_costs names the op
            exported = None
    return exported if exported is not None else _export_static(model, kwargs)


def _other_dims_auto(inputs: TraceInputs, batch_shapes: dict[str, Any] | None) -> dict[str, Any] | None:
    """``batch_shapes`` with ``Dim.AUTO`` on every other dim of every batched tensor input."""
    if batch_shapes is None:
        return None
    shapes = dict(batch_shapes)
    for name, value in zip(inputs.names, inputs.values, strict=True):
        batch = shapes.get(name)
        if batch and isinstance(value, torch.Tensor):
            shapes[name] = {dim: batch.get(dim, torch.export.Dim.AUTO) for dim in range(value.dim())}
    return shapes


def _static_input_dims(graph: fx.Graph) -> dict[str, tuple[int, ...]]:
    """``{input name: dims export fixed}``: a batch of another size in such a dim does not fit the program."""
    static = {}
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            static[node.name] = tuple(dim for dim, size in enumerate(value.shape) if isinstance(size, int))
    return static


def _export_static(model: nn.Module, kwargs: dict[str, Any]) -> torch.export.ExportedProgram:
    with _running_modules(model) as running:
        try:
            return torch.export.export(model, (), kwargs, strict=False)
        except Exception as error:
            module_path = running[-1] if running else ""
            module_class = type(model.get_submodule(module_path)).__name__
            raise ExportTraceFailure(module_path, module_class, error) from error


def _batch_dynamic_shapes(inputs: TraceInputs, dims: Sequence[int | None]) -> dict[str, Any] | None:
    """One symbolic ``Dim`` on the batch dim of every tensor input, or None when no batch can be symbolic.

    A batch of 0 or 1 would be specialised by export, and inputs that disagree on the batch size have
    no common batch; both export static.
    """
    sizes = {int(value.shape[dim]) for value, dim in zip(inputs.values, dims, strict=True) if dim is not None}
    if len(sizes) != 1 or min(sizes) < 2:
        return None
    batch = torch.export.Dim("batch")
    shapes: dict[str, Any] = dict.fromkeys(inputs.bound)
    shapes.update({name: ({dim: batch} if dim is not None else None)
                   for name, dim in zip(inputs.names, dims, strict=True)})
    return shapes


def _has_symbolic_batch(graph: fx.Graph, dims: Sequence[int | None]) -> bool:
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for node, dim in zip(placeholders, dims, strict=False):
        value = node.meta.get("val")
        if dim is not None and isinstance(value, torch.Tensor):
            return not isinstance(value.shape[dim], int)
    return False


def _is_symbolic_scalar(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt | torch.SymFloat | torch.SymBool)


def _localise_symbolic_sizes(graph: fx.Graph) -> None:
    """Give every reader of a symbolic size (``sym_size(input_ids, 0)``, ``B * T``) its own copy, just before it.

    Export computes the batch size once at the top and every view reads it; a size is a Python int,
    which cannot cross a stage boundary, so without copies no cut could be made. Each copy re-reads
    the tensors it was computed from, so on a stage it gives that stage's own slice size.
    """
    for node in list(graph.nodes):
        if _is_symbolic_scalar(node) or not any(_is_symbolic_scalar(arg) for arg in node.all_input_nodes):
            continue
        copies: dict[fx.Node, fx.Node] = {}

        def copy_of(source: fx.Node, reader: fx.Node = node, copies: dict[fx.Node, fx.Node] = copies) -> fx.Node:
            if not _is_symbolic_scalar(source):
                return source
            if source not in copies:
                copied = graph.node_copy(source, copy_of)
                copied.meta = {**source.meta, "nn_module_stack": reader.meta.get("nn_module_stack", {})}
                copies[source] = copied
            return copies[source]

        with graph.inserting_before(node):
            node.args = fx.map_arg(node.args, copy_of)
            node.kwargs = fx.map_arg(node.kwargs, copy_of)
    for node in reversed(list(graph.nodes)):
        if _is_symbolic_scalar(node) and not node.users:
            graph.erase_node(node)


@contextmanager
def _running_modules(model: nn.Module) -> Iterator[list[str]]:
    """Yield the stack of module paths whose forward is running (Python-side hooks, no graph ops).

    A module that raises never pops itself, so after a failure the stack's top is the culprit.
    """
    paths = {id(module): path for path, module in model.named_modules()}
    running: list[str] = []

    def enter(module: nn.Module, args: Any) -> None:
        if id(module) in paths:
            running.append(paths[id(module)])

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in paths and running:
            running.pop()

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        yield running
    finally:
        for handle in handles:
            handle.remove()


_ASSERT_TENSOR_METADATA = torch.ops.aten._assert_tensor_metadata.default


def _plain_graph(source: fx.Graph, input_names: set[str], out_spec: TreeSpec | None) -> fx.Graph:
    """A copy of `source` with the default codegen, no guard call, metadata assertions that assert nothing, no
    constant inputs, plain outputs."""
    value_map: dict[fx.Node, fx.Node] = {}
    graph = fx.Graph()
    # Placeholders first (export lists the parameter reads before them), then the rest in order.
    ordered = sorted(source.nodes, key=lambda n: n.op != "placeholder")
    for node in ordered:
        if node.op == "call_module" and node.target == _GUARDS_TARGET:
            continue
        if node.op == "call_function" and node.target is _ASSERT_TENSOR_METADATA:
            # export's guard on a value's traced dtype, device and layout before a .to() that was a no-op when traced
            # (HF Mixtral's router: router_logits.float()); fxpipe runs the graph under autocast and on other devices
            # than it traced on, where these differ on purpose (bf16 logits), and the .to() after it still converts.
            # The node stays, asserting nothing: node-count cuts and node names stay as they were.
            value_map[node] = graph.node_copy(node, lambda n: value_map[n])
            value_map[node].args, value_map[node].kwargs = value_map[node].args[:1], {}
            continue
        if node.op == "placeholder" and node.target not in input_names:
            # A bound non-tensor argument (e.g. use_cache=False): export specialised on it.
            assert not _live_users(node), f"constant input {node.target} is used by the graph"
            continue
        if node.op == "get_attr" and not node.users:
            continue  # e.g. one alias of a tied weight: the graph reads the other alias
        if node.op == "output":
            flat_outputs = list(node.args[0])  # type: ignore[arg-type]
            graph.output(_structured_outputs(out_spec, flat_outputs, value_map))
            continue
        value_map[node] = graph.node_copy(node, lambda n: value_map[n])
    return graph


def _live_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if not (u.op == "call_module" and u.target == _GUARDS_TARGET)]


def _structured_outputs(
    out_spec: TreeSpec | None, flat_outputs: list[Any], value_map: dict[fx.Node, fx.Node]
) -> Any:
    mapped = [fx.map_arg(value, lambda n: value_map[n]) for value in flat_outputs]
    if out_spec is None:
        return tuple(mapped)
    return _rebuild(out_spec, iter(mapped))


def _rebuild(spec: TreeSpec, leaves: Iterator[Any]) -> Any:
    """Unflatten `leaves` along `spec` into plain dicts, tuples and lists."""
    if spec.is_leaf():
        return next(leaves)
    children = [_rebuild(child, leaves) for child in spec.children()]
    if spec.type is list:
        return children
    if isinstance(spec.type, type) and issubclass(spec.type, Mapping):
        return dict(zip(spec.context, children, strict=True))
    if spec.type is type(None):
        return None
    # tuples, namedtuples and any other registered container: a plain tuple of its children.
    return tuple(children)


def _annotate_module_paths(graph: fx.Graph) -> None:
    """node.meta['fxpipe.module_path'] from export's nn_module_stack (innermost module)."""
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            module_path, _ = list(stack.values())[-1]
            node.meta[meta.MODULE_PATH] = _clean_path(str(module_path))
        elif node.op == "get_attr":
            node.meta[meta.MODULE_PATH] = str(node.target).rpartition(".")[0]
        else:
            node.meta[meta.MODULE_PATH] = ""


def _clean_path(module_path: str) -> str:
    """Strict-mode paths look like "L['self'].blocks.0"; keep the part after the root."""
    prefix = "L['self']"
    if module_path.startswith(prefix):
        return module_path[len(prefix):].lstrip(".")
    return module_path
