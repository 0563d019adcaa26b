"""nn.Module -> fx.GraphModule: symbolic tracing with a leaf policy, torch.export fallback, fxpipe meta."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import chain

import torch
from torch import fx, nn

from fxpipe.core import meta
from fxpipe.passes import meta_kernels  # noqa: F401  (Meta kernels the traced graphs' fake runs need)
from fxpipe.passes.batchdims import (
    BatchDimError,
    BatchDims,
    check_unambiguous,
    resolve_batch_dims,
)
from fxpipe.passes.trace_export import ExportTraceFailure, trace_export
from fxpipe.passes.trace_fx import FxTraceFailure, describe_module, trace_fx, validate_leaf_modules
from fxpipe.passes.trace_inputs import ExampleInputsTypeError, TraceInputs, normalize_inputs

__all__ = ["BatchDimError", "ExampleInputsTypeError", "TraceError", "trace"]

FRONTENDS = ("auto", "fx", "export")
_MAX_REASON_CHARS = 600


class TraceError(ValueError):
    """No front end could trace the model; names the module where fx broke and every front end's reason."""

    def __init__(
        self,
        message: str,
        *,
        module_path: str | None = None,
        module_class: str | None = None,
        fx_reason: str | None = None,
        export_module_path: str | None = None,
        export_reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.module_path = module_path
        self.module_class = module_class
        self.fx_reason = fx_reason
        self.export_module_path = export_module_path
        self.export_reason = export_reason


def trace(
    model: nn.Module,
    example_inputs: object,
    *,
    leaf_modules: Sequence[type[nn.Module] | str] = (),
    frontend: str = "auto",
    batch_dims: BatchDims = None,
) -> fx.GraphModule:
    """Trace `model` at `example_inputs` into a GraphModule carrying the fxpipe meta conventions:

        gm.meta[meta.FRONTEND]        "fx" or "export"
        gm.meta[meta.EXAMPLE_INPUTS]  tuple of example tensors, one per placeholder, forward() order
        gm.meta[meta.INPUT_NAMES]     tuple of placeholder names (forward()'s parameter names)
        gm.meta[meta.PARAM_NAMES]     {gm attribute path -> original parameter/buffer name}
        gm.meta[meta.BATCH_DIMS]      tuple of each placeholder's batch dim (None: 0-dim tensor)
        gm.meta[meta.BATCH_DIMS_DECLARED]  True when batch_dims was given
        node.meta[meta.MODULE_PATH]   original module path of the op ("" for the model itself)
        node.meta[meta.PARAM_NAMES]   tuple of original names of the parameters/buffers it reads
                                          (get_attr nodes and call_module leaves; () otherwise)

    An original name is the model's canonical name for the tensor: the first name that
    `model.named_parameters()` / `named_buffers()` gives it, so every use of a tied weight reports the
    same name.

    example_inputs: a Tensor, a tuple/list of Tensors (positional), or a dict of keyword Tensors; dict
    inputs become positional placeholders in forward()'s order, omitted parameters keep their defaults
    (and a `use_cache` parameter is bound to False). Only types are checked; nothing runs eagerly. A
    wrapper whose forward(*args, **kwargs) passes its inputs on (PEFT's PeftModel) takes the names of the
    model it wraps (fxpipe.passes.trace_wrappers) and is traced by torch.export alone, called by keyword.
    leaf_modules: extra leaves for the fx front end, as nn.Module subclasses or module-path prefixes
    ("blocks.3" makes blocks.3 and everything under it one call_module node). Recurrent layers and
    torch.nn built-ins are always leaves.
    frontend: "auto" tries torch.fx symbolic tracing, then non-strict torch.export at the example
    shapes; "fx" / "export" use only that front end.

    The GraphModule shares parameter and buffer tensors with `model` (nothing is copied; a tied weight
    stays one Parameter). Outputs are plain containers: Mappings such as Hugging Face ModelOutput come
    back as dicts, tuples and lists as tuples and lists. Export graphs are specialised on the model's
    training mode (dropout, batch statistics) and on the example shapes except the batch: dim 0 of
    every tensor input is one symbolic size, and each op that reads a size (a view to (B, T, C)) reads
    its own copy, computed from the tensors at hand; gm.meta[meta.SYMBOLIC_BATCH] is False when
    the model refused a symbolic batch and was exported at the example batch. fx graphs are
    shape-generic.
    Raises ExampleInputsTypeError (a TypeError) for malformed inputs, BatchDimError (a ValueError) for
    bad or ambiguous batch dims, and TraceError when tracing fails.
    """
    if frontend not in FRONTENDS:
        raise ValueError(f"frontend={frontend!r} is not one of {FRONTENDS}; use 'auto' unless debugging")
    inputs = normalize_inputs(model, example_inputs)
    leaves = validate_leaf_modules(leaf_modules)
    dims = resolve_batch_dims(inputs.names, inputs.values, batch_dims)
    with _training_modes_restored(model):
        if batch_dims is None:
            check_unambiguous(model, inputs.names, inputs.values, dims, inputs.bound)
        gm, used_frontend = _run_frontends(model, inputs, leaves, frontend, dims)
    _write_meta(gm, model, inputs, used_frontend)
    gm.meta[meta.BATCH_DIMS] = dims
    gm.meta[meta.BATCH_DIMS_DECLARED] = batch_dims is not None
    return gm


@contextmanager
def _training_modes_restored(model: nn.Module) -> Iterator[None]:
    """Front ends must not leave a module's train/eval flag changed, even when they fail."""
    modes = [(module, module.training) for module in model.modules()]
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _run_frontends(
    model: nn.Module,
    inputs: TraceInputs,
    leaves: tuple[type[nn.Module] | str, ...],
    frontend: str,
    dims: tuple[int | None, ...],
) -> tuple[fx.GraphModule, str]:
    fx_failure: FxTraceFailure | None = None
    if inputs.wrapper_route and frontend == "fx":
        raise TraceError(f"frontend='fx' cannot trace inputs {list(inputs.names)} that reach the model through "
                         f"{inputs.wrapper_route} (a forward(*args, **kwargs) has no names for torch.fx's "
                         "placeholders); use frontend='auto' or 'export', which call forward() by keyword")
    if frontend in ("auto", "fx") and not inputs.wrapper_route:
        try:
            return trace_fx(model, inputs, leaves), "fx"
        except FxTraceFailure as failure:
            if frontend == "fx":
                raise _fx_only_error(failure) from failure.reason
            fx_failure = failure
    try:
        return trace_export(model, inputs, dims), "export"
    except ExportTraceFailure as failure:
        raise _export_error(fx_failure, failure) from failure.reason


def _short(reason: BaseException) -> str:
    text = f"{type(reason).__name__}: {reason}".strip()
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + " ..."


def _fx_only_error(failure: FxTraceFailure) -> TraceError:
    where = describe_module(failure.module_path, failure.module_class)
    if failure.module_path:
        fix = (f"make that module a leaf (leaf_modules=[{failure.module_class}] or "
               f"['{failure.module_path}']), or use frontend='auto' to fall back to torch.export")
    else:  # the model's own forward broke: a leaf there would be the whole model
        fix = ("rewrite the data-dependent Python code with tensor ops (torch.where, torch.cond), or use "
               "frontend='auto' to fall back to torch.export")
    return TraceError(
        f"torch.fx could not trace {where}: {_short(failure.reason)}. Fix: {fix}",
        module_path=failure.module_path,
        module_class=failure.module_class,
        fx_reason=_short(failure.reason),
    )


def _export_error(fx_failure: FxTraceFailure | None, failure: ExportTraceFailure) -> TraceError:
    export_where = describe_module(failure.module_path, failure.module_class)
    export_reason = _short(failure.reason)
    if fx_failure is None:
        return TraceError(
            f"torch.export could not trace {export_where}: {export_reason}",
            module_path=failure.module_path,
            module_class=failure.module_class,
            export_module_path=failure.module_path,
            export_reason=export_reason,
        )
    where = describe_module(fx_failure.module_path, fx_failure.module_class)
    fx_reason = _short(fx_failure.reason)
    leaf_hint = f", or make {fx_failure.module_path} a leaf with leaf_modules" if fx_failure.module_path else ""
    return TraceError(
        f"could not trace {where}: torch.fx failed there: {fx_reason}; the torch.export fallback failed "
        f"in {export_where}: {export_reason}. Fix: rewrite the data-dependent Python code with tensor "
        f"ops (torch.where, torch.cond){leaf_hint}",
        module_path=fx_failure.module_path,
        module_class=fx_failure.module_class,
        fx_reason=fx_reason,
        export_module_path=failure.module_path,
        export_reason=export_reason,
    )


def _write_meta(gm: fx.GraphModule, model: nn.Module, inputs: TraceInputs, frontend: str) -> None:
    """Graph-level and node-level fxpipe.* meta; see the module docstring."""
    param_names = _gm_param_names(gm, model)
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    assert len(placeholders) == len(inputs.values), (placeholders, inputs.names)
    gm.meta[meta.FRONTEND] = frontend
    gm.meta[meta.EXAMPLE_INPUTS] = inputs.values
    gm.meta[meta.INPUT_NAMES] = tuple(str(node.target) for node in placeholders)
    gm.meta[meta.PARAM_NAMES] = param_names
    gm.meta[meta.STATE_DICT_NAMES] = _state_dict_names(model)
    for node in gm.graph.nodes:
        node.meta.setdefault(meta.MODULE_PATH, "")
        node.meta[meta.PARAM_NAMES] = _names_read(node, param_names)


def _state_dict_names(model: nn.Module) -> dict[str, str]:
    """{key of model.state_dict() -> canonical name}: what a checkpoint must hold to load strict."""
    canonical: dict[int, str] = {}
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        canonical.setdefault(id(tensor), name)
    return {key: canonical.get(id(value), key) for key, value in model.state_dict(keep_vars=True).items()}


def _gm_param_names(gm: fx.GraphModule, model: nn.Module) -> dict[str, str]:
    """{gm attribute path -> canonical original name} for every parameter and buffer of gm."""
    canonical: dict[int, str] = {}
    for name, tensor in chain(model.named_parameters(), model.named_buffers()):
        canonical.setdefault(id(tensor), name)
    model_tensors: dict[str, torch.Tensor] = dict(
        chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    )
    names: dict[str, str] = {}
    gm_tensors = chain(gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False))
    for path, tensor in gm_tensors:
        if id(tensor) in canonical:
            names[path] = canonical[id(tensor)]
        elif path in model_tensors:  # a front end that copied the tensor keeps its name
            names[path] = canonical[id(model_tensors[path])]
    return names


def _names_read(node: fx.Node, param_names: dict[str, str]) -> tuple[str, ...]:
    if node.op == "get_attr":
        target = str(node.target)
        return (param_names[target],) if target in param_names else ()
    if node.op == "call_module":
        prefix = f"{node.target}."
        found = [name for path, name in param_names.items() if path.startswith(prefix)]
        return tuple(dict.fromkeys(found))
    return ()

