"""Example-input normalisation for trace(): positional tensors in forward() order plus bound constants."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from fxpipe.core import meta
from fxpipe.passes.trace_wrappers import HOW_WRAPPERS_ARE_FOLLOWED, ForwardSignature, forward_signature

ACCEPTED_FORMS = "a Tensor, a tuple or list of Tensors, or a dict mapping forward() parameter names to Tensors"

# Inputs that a training graph never wants: a KV cache is inference-only and its cache object is not a
# tensor, so forward() parameters with these names are bound to these values unless the caller sets them.
TRAINING_DEFAULTS: dict[str, Any] = {"use_cache": False}


class ExampleInputsTypeError(TypeError):
    """example_inputs (or one of its values) has a type trace() cannot turn into graph inputs."""


@dataclass(frozen=True)
class TraceInputs:
    """The example inputs as graph placeholders: names and values in forward() order, plus constants.

    `bound` holds forward() parameters that are not graph inputs (omitted inputs at their defaults and
    TRAINING_DEFAULTS); the tracers specialise the graph on these values. `wrapper_route` is non-empty when
    some of them reach the model through a wrapper's ``**kwargs`` (trace_wrappers): only the export front
    end traces those, calling forward() by keyword.
    """

    names: tuple[str, ...]
    values: tuple[torch.Tensor, ...]
    bound: dict[str, Any] = field(default_factory=dict)
    wrapper_route: str = ""


def normalize_inputs(model: nn.Module, example_inputs: object) -> TraceInputs:
    """Check example_inputs' types and bind them to model.forward's signature (nothing is run)."""
    if not isinstance(model, nn.Module):
        raise ExampleInputsTypeError(
            f"trace() needs an nn.Module, got a {type(model).__name__}; wrap plain functions in a Module"
        )
    signature = forward_signature(model)
    parameters = [*signature.own, *signature.passed_on]
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        # positional values go to forward()'s own positional parameters; to the wrapped model's when it has none
        own_positional = [p for p in signature.own if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        given = _bind_positional(tuple(example_inputs), list(signature.own) if own_positional else parameters)
    elif isinstance(example_inputs, Mapping):
        given = _bind_keywords(example_inputs, parameters, signature, type(model).__name__)
    else:
        raise ExampleInputsTypeError(
            f"example_inputs is a {type(example_inputs).__name__}; accepted forms: {ACCEPTED_FORMS}"
        )
    bound = _bound_constants(list(signature.own), given)
    # a wrapped module's parameters keep their defaults (or get what the wrapper passes); only the training
    # defaults are passed on
    bound.update({p.name: TRAINING_DEFAULTS[p.name] for p in signature.passed_on
                  if p.name in TRAINING_DEFAULTS and p.name not in given})
    reached = set(given) | set(bound)
    route = signature.route if reached - {p.name for p in signature.own} else ""
    return TraceInputs(names=tuple(given), values=tuple(given.values()), bound=bound, wrapper_route=route)


def _check_tensor(value: object, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ExampleInputsTypeError(
            f"{where} is a {type(value).__name__}; accepted forms: {ACCEPTED_FORMS} "
            "(bind non-tensor options in the model, e.g. with a small wrapper Module)"
        )
    return value


def _bind_positional(
    values: tuple[object, ...], parameters: list[inspect.Parameter]
) -> dict[str, torch.Tensor]:
    tensors = [_check_tensor(value, f"example_inputs[{index}]") for index, value in enumerate(values)]
    positional = [p for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if len(values) > len(positional):
        names = [p.name for p in positional]
        raise ExampleInputsTypeError(
            f"example_inputs has {len(values)} positional values but forward() takes {len(positional)} "
            f"named positional parameters {names}; pass fewer values or a dict of keyword inputs"
        )
    return {parameter.name: tensor for parameter, tensor in zip(positional, tensors, strict=False)}


def _bind_keywords(
    values: Mapping[Any, object], parameters: list[inspect.Parameter], signature: ForwardSignature, model_name: str
) -> dict[str, torch.Tensor]:
    known = [p.name for p in parameters]
    for key in values:
        if not isinstance(key, str) or key not in known:
            raise ExampleInputsTypeError(
                f"example_inputs has key {key!r}, which is not a parameter of forward() {known}"
                f"{_where_names_come_from(signature, model_name)}"
            )
    # Placeholders follow the signature's order, whatever order the dict was written in.
    return {
        name: _check_tensor(values[name], f"example_inputs[{name!r}]") for name in known if name in values
    }


def _where_names_come_from(signature: ForwardSignature, model_name: str) -> str:
    """The end of an unknown-key error: where the names came from and what to pass instead."""
    if signature.route:
        return (f" (its own and, through {signature.route}, the wrapped model's); use one of these names as "
                "the key")
    if signature.takes_kwargs:
        return (f"; {model_name}.forward takes **kwargs, which hide the names, and fxpipe found no module it "
                f"passes them to (it looks {HOW_WRAPPERS_ARE_FOLLOWED}). Fix: compile the wrapped model "
                f"itself, or give {model_name} a forward() that names its inputs (def forward(self, input_ids, "
                "attention_mask=None)), or decorate it with functools.wraps(wrapped_model.forward)")
    return "; use forward()'s parameter names as keys"


def _bound_constants(parameters: list[inspect.Parameter], given: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Omitted forward() parameters -> their defaults (TRAINING_DEFAULTS first); error if required."""
    bound: dict[str, Any] = {}
    for parameter in parameters:
        if parameter.name in given:
            continue
        if parameter.name in TRAINING_DEFAULTS:
            bound[parameter.name] = TRAINING_DEFAULTS[parameter.name]
        elif parameter.default is not inspect.Parameter.empty:
            bound[parameter.name] = parameter.default
        else:
            raise ExampleInputsTypeError(
                f"example_inputs gives no value for forward()'s required parameter {parameter.name!r} "
                f"(given: {list(given)}); add it to the example inputs"
            )
    return bound


def recorded_inputs(gm: fx.GraphModule, example_inputs: Sequence[Any] | None, error: type[ValueError],
                    pass_name: str) -> tuple[Any, ...]:
    """``example_inputs``, or when None the ones ``trace`` recorded in ``gm.meta``; one value per placeholder.

    ``error`` is the calling pass's error class and ``pass_name`` its name, so the message says who asked.
    """
    if not isinstance(gm, fx.GraphModule):
        raise error(f"{pass_name} needs a torch.fx.GraphModule, got {type(gm).__name__}; "
                    "run fxpipe.passes.trace(model, example_inputs) first")
    if example_inputs is None:
        example_inputs = gm.meta.get(meta.EXAMPLE_INPUTS)
    if example_inputs is None:
        raise error(f"{pass_name}: graph has no gm.meta[{meta.EXAMPLE_INPUTS!r}] and no example_inputs were given; "
                    "run fxpipe.passes.trace(model, example_inputs) first or pass example_inputs")
    num_placeholders = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
    if len(example_inputs) != num_placeholders:
        raise error(f"{pass_name}: graph has {num_placeholders} placeholders but {len(example_inputs)} example inputs "
                    "were given; pass one positional value per placeholder (as fxpipe.passes.trace records them)")
    return tuple(example_inputs)

