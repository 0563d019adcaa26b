"""The batch dimension: user declarations (``batch_dims``), their checks, and each graph value's batch dim from its shapes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe.core import meta
from fxpipe.core.fake_log import quiet_fake_tensor_log

__all__ = [
    "BatchDimError",
    "BatchDims",
    "batch_size_of",
    "check_outputs_follow",
    "check_unambiguous",
    "default_batch_dims",
    "derive_batch_dim",
    "fake_values",
    "graph_batch_dims",
    "resolve_batch_dims",
    "resolve_target_dim",
]

# What users pass: None (dim 0 of every input, checked for ambiguity), one int for every input, or
# {forward() parameter name: dim} (inputs not named keep dim 0).
BatchDims = int | Mapping[str, int] | None

MERGED = -1  # derive_batch_dim: the value grows with the batch but not as one dim growing by one row


class BatchDimError(ValueError):
    """A batch dim is malformed, ambiguous, or not followed by the model; names the input and the fix."""


def parse_batch_dims(text: str) -> int | dict[str, int]:
    """``--batch-dims`` of the CLI: ``"1"`` (every input) or ``"x=1,mask=0"`` (per input name; others dim 0)."""
    text = text.strip()
    if "=" not in text:
        try:
            return int(text)
        except ValueError:
            raise BatchDimError(f"batch dims {text!r} are neither a dim (e.g. 1) nor name=dim pairs "
                                "(e.g. x=1,mask=0)") from None
    dims: dict[str, int] = {}
    for item in text.split(","):
        name, _, dim = item.partition("=")
        name = name.strip()
        try:
            dims[name] = int(dim)
        except ValueError:
            raise BatchDimError(f"batch dims {text!r}: {item.strip()!r} is not name=dim with an integer dim "
                                "(e.g. x=1,mask=0)") from None
        if not name:
            raise BatchDimError(f"batch dims {text!r}: {item.strip()!r} has no input name before '='")
    return dims


def _normalised(name: str, value: torch.Tensor, dim: object) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise BatchDimError(f"batch_dims for input {name!r} is {dim!r}; give an int dim (e.g. 1 for a seq-first "
                            "(T, B, C) tensor)")
    if not -value.dim() <= dim < value.dim():
        raise BatchDimError(f"batch_dims says input {name!r} has its batch in dim {dim}, but it has shape "
                            f"{tuple(value.shape)} ({value.dim()} dims); give a dim in [0, {value.dim()})")
    return dim % value.dim()


def resolve_batch_dims(names: Sequence[str], values: Sequence[Any], batch_dims: BatchDims) -> tuple[int | None, ...]:
    """Each input's batch dim (None: no batch in it), checked against its shape.

    ``batch_dims`` None: :func:`default_batch_dims`. Declared dims must agree on the batch size.
    """
    if batch_dims is None:
        return default_batch_dims(values)
    if batch_dims is not None and not isinstance(batch_dims, int | Mapping):
        raise BatchDimError(f"batch_dims is a {type(batch_dims).__name__}; give an int (every input) or a dict "
                            f"{{input name: dim}} with names from {list(names)}")
    if isinstance(batch_dims, Mapping):
        unknown = sorted(str(key) for key in batch_dims if key not in names)
        if unknown:
            raise BatchDimError(f"batch_dims names {unknown}, which are not model inputs {list(names)}; use "
                                "forward()'s parameter names")
    dims: list[int | None] = []
    for name, value in zip(names, values, strict=True):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            dims.append(None)
            continue
        declared = batch_dims.get(name, 0) if isinstance(batch_dims, Mapping) else batch_dims
        dims.append(_normalised(name, value, declared))
    sizes = {name: int(value.shape[dim]) for name, value, dim in zip(names, values, dims, strict=True)
             if dim is not None}
    if len(set(sizes.values())) > 1:
        described = ", ".join(f"{name!r} dim {dim}: {sizes[name]}" for name, dim in zip(names, dims, strict=True)
                              if dim is not None)
        raise BatchDimError(f"inputs disagree on the batch size along their batch dims ({described}); every "
                            "input needs the same number of rows in its batch dim; fix batch_dims")
    return tuple(dims)


def default_batch_dims(values: Sequence[Any]) -> tuple[int | None, ...]:
    """Dim 0 of the first tensor input is the batch; another input is batched (in dim 0) when its dim 0 has as
    many rows, else it is a constant that every micro-batch reads whole (a bias, a table)."""
    tensors = [value for value in values if isinstance(value, torch.Tensor) and value.dim() > 0]
    if not tensors:
        return tuple(None for _ in values)
    batch = int(tensors[0].shape[0])
    return tuple(0 if isinstance(value, torch.Tensor) and value.dim() > 0 and int(value.shape[0]) == batch else None
                 for value in values)


def resolve_target_dim(batch_dims: BatchDims, target_batch_dim: int | None) -> int:
    """The targets' batch dim: ``target_batch_dim``, else ``batch_dims`` when it is one int, else 0."""
    if target_batch_dim is not None:
        if not isinstance(target_batch_dim, int) or isinstance(target_batch_dim, bool) or target_batch_dim < 0:
            raise BatchDimError(f"target_batch_dim={target_batch_dim!r}; give a dim >= 0 of the targets")
        return target_batch_dim
    if isinstance(batch_dims, int) and not isinstance(batch_dims, bool):
        if batch_dims < 0:
            raise BatchDimError(f"batch_dims={batch_dims} is negative, so the targets' dim is unknown; pass "
                                "target_batch_dim=... (a dim >= 0 of the targets)")
        return batch_dims
    return 0


def batch_size_of(values: Sequence[Any], dims: Sequence[int | None]) -> int | None:
    """The rows along the batch dims (resolve_batch_dims checked that the inputs agree); None: no batch."""
    for value, dim in zip(values, dims, strict=True):
        if dim is not None:
            return int(value.shape[dim])
    return None


def graph_batch_dims(gm: fx.GraphModule, values: Sequence[Any]) -> tuple[int | None, ...]:
    """The batch dims ``trace`` recorded, or :func:`default_batch_dims` for a graph traced elsewhere."""
    dims = gm.meta.get(meta.BATCH_DIMS)
    if dims is not None and len(dims) == len(values):
        return tuple(dims)
    return default_batch_dims(values)


def _with_rows(shape: Sequence[int], dim: int | None, rows: int) -> tuple[int, ...]:
    """``shape`` with ``rows`` in dim ``dim`` (unchanged when ``dim`` is None)."""
    if dim is None:
        return tuple(shape)
    return (*shape[:dim], rows, *shape[dim + 1:])


def derive_batch_dim(value: Any, value_next: Any, batch: int | None) -> int | None:
    """A value's batch dim from its shapes at ``batch`` and ``batch + 1`` rows.

    None: it does not change with the batch. MERGED: it changes, but not as exactly one dim going
    from ``batch`` to ``batch + 1`` rows (a flattened ``(B*T, C)``, or the batch in two dims).
    """
    if batch is None or not isinstance(value, torch.Tensor) or not isinstance(value_next, torch.Tensor):
        return None
    if value.shape == value_next.shape:
        return None
    if value.dim() != value_next.dim():
        return MERGED
    grown = [d for d in range(value.dim()) if value.shape[d] != value_next.shape[d]]
    if len(grown) == 1 and value.shape[grown[0]] == batch and value_next.shape[grown[0]] == batch + 1:
        return grown[0]
    return MERGED


def fake_values(gm: fx.GraphModule, example_inputs: Sequence[Any], dims: Sequence[int | None],
                rows: int | None) -> dict[str, Any]:
    """Every node's value when ``gm`` runs on fakes with ``rows`` rows in each input's batch dim (no compute)."""
    with FakeTensorMode(allow_non_fake_inputs=True), torch.enable_grad():
        inputs = [_fake_input(value, dim, rows) for value, dim in zip(example_inputs, dims, strict=True)]
        interpreter = fx.Interpreter(gm, garbage_collect_values=False)
        interpreter.run(*inputs)
    return {node.name: value for node, value in interpreter.env.items()}


def _fake_input(value: Any, dim: int | None, rows: int | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    shape = value.shape if rows is None else _with_rows(value.shape, dim, rows)
    return torch.empty(tuple(shape), dtype=value.dtype, device=value.device, requires_grad=value.requires_grad)


def _alternative_dims(values: Sequence[Any], dims: Sequence[int | None], batch: int) -> list[int | None]:
    """Per input, its first other dim that also has ``batch`` rows (else its declared dim)."""
    alternative = list(dims)
    for index, (value, dim) in enumerate(zip(values, dims, strict=True)):
        if dim is None:
            continue
        others = [d for d in range(value.dim()) if d != dim and int(value.shape[d]) == batch]
        if others:
            alternative[index] = others[0]
    return alternative


def check_unambiguous(model: nn.Module, names: Sequence[str], values: Sequence[Any], dims: Sequence[int | None],
                      bound: Mapping[str, Any]) -> None:
    """Refuse to guess dim 0 when another dim has the same size and the model also runs with that dim grown.

    A seq-first model fed ``(T, B, C)`` with ``T == B`` would otherwise be split along the sequence and
    train wrong without an error. Costs one fake forward (no memory, no compute), only in that case.
    """
    batch = batch_size_of(values, dims)
    if batch is None:
        return
    alternative = _alternative_dims(values, dims, batch)
    if alternative == list(dims) or not _runs_with_rows(model, names, values, alternative, batch + 1, bound):
        return
    index = next(i for i, (a, d) in enumerate(zip(alternative, dims, strict=True)) if a != d)
    name, value = names[index], values[index]
    raise BatchDimError(
        f"input {name!r} has shape {tuple(value.shape)}: dims {dims[index]} and {alternative[index]} both have "
        f"{batch} rows and the model runs when either grows, so fxpipe cannot tell which dim is the batch (a "
        f"seq-first (T, B, C) model with T == B would be split along the sequence and train wrong). Fix: pass "
        f"batch_dims={{{name!r}: {alternative[index]}}} (or batch_dims=1 for every input) when dim "
        f"{alternative[index]} is the batch, batch_dims=0 to confirm dim 0, or use an example batch size that no "
        "other dim has")


def _runs_with_rows(model: nn.Module, names: Sequence[str], values: Sequence[Any], dims: Sequence[int | None],
                    rows: int, bound: Mapping[str, Any]) -> bool:
    """Does ``model`` run on fakes with ``rows`` rows in ``dims``? (fake weights: the model is not changed)"""
    with FakeTensorMode(allow_non_fake_inputs=True), quiet_fake_tensor_log(), _fake_weights(model):
        kwargs = {name: _fake_input(value, dim, rows) for name, value, dim in zip(names, values, dims, strict=True)}
        try:
            model(**kwargs, **bound)
        except Exception:  # the other dim cannot grow: dim 0 is the only candidate
            return False
    return True


@contextlib.contextmanager
def _fake_weights(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer replaced by a new fake tensor (one per tensor, so ties stay ties), then restored.

    New tensors rather than conversions: converting leaves weak references on the parameters, and
    ``module.to()`` cannot swap a parameter that has one. Replaced in each module's own dicts rather than
    by ``torch.func.functional_call``, which restores a fake into a module reachable under two names.
    """
    fakes: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for key, tensor in table.items():
                if tensor is not None:
                    saved.append((table, key, tensor))
                    table[key] = fakes.setdefault(id(tensor), torch.empty(
                        tensor.shape, dtype=tensor.dtype, device=tensor.device, requires_grad=tensor.requires_grad))
    try:
        yield
    finally:
        for table, key, tensor in reversed(saved):
            table[key] = tensor


def _following_outputs(gm: fx.GraphModule, at_batch: Mapping[str, Any], at_next: Mapping[str, Any],
                       batch: int) -> dict[str, int]:
    """{output leaf: its batch dim} for the outputs that hold the batch in one dim."""
    (output,) = [node for node in gm.graph.nodes if node.op == "output"]
    leaves: list[fx.Node] = []
    fx.node.map_arg(output.args, leaves.append)
    found = {}
    for leaf in leaves:
        dim = derive_batch_dim(at_batch.get(leaf.name), at_next.get(leaf.name), batch)
        if dim is not None and dim != MERGED:
            found[leaf.name] = dim
    return found


def check_outputs_follow(gm: fx.GraphModule, example: Sequence[Any], dims: Sequence[int | None],
                         at_batch: Mapping[str, Any], at_next: Mapping[str, Any]) -> None:
    """Declared batch dims must reach the model's outputs: at least one output holds the batch in one dim.

    A model that pools or flattens the declared dim (it is not the batch) fails this; the error says
    which other dim of the input the outputs do follow, when one does.
    """
    batch = batch_size_of(example, dims)
    if batch is None or _following_outputs(gm, at_batch, at_next, batch):
        return
    index = next(i for i, dim in enumerate(dims) if dim is not None)
    names = gm.meta.get(meta.INPUT_NAMES) or [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    name, value, declared = names[index], example[index], dims[index]
    seen = ("no other dim of it does either (a model that returns only batch-free values, such as a loss it "
            "computes itself, must return its per-row outputs and leave the loss to loss_fn)")
    for other in (d for d in range(value.dim()) if d != declared):
        trial = [other if i == index else None for i in range(len(dims))]
        size = int(value.shape[other])
        try:
            low, high = (fake_values(gm, example, trial, rows) for rows in (size, size + 1))
        except Exception:  # the graph cannot grow that dim: not the batch either
            continue
        following = _following_outputs(gm, low, high, size)
        if following:
            output, dim = next(iter(following.items()))
            seen = f"growing its dim {other} instead grows output {output!r} in dim {dim}, so the model treats dim " \
                   f"{other} as the batch"
            break
    raise BatchDimError(
        f"batch_dims declares dim {declared} of input {name!r} (shape {tuple(value.shape)}) as the batch, but no "
        f"model output keeps that dim: one more row there does not give any output exactly one more row in one dim "
        f"(the model pools, flattens or mixes it); {seen}. Fix: declare the dim the model treats as the batch in "
        "batch_dims")
