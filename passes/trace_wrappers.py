"""forward() signatures through wrapper models: a forward(*args, **kwargs) that passes its inputs on to a module it wraps."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

# a wrapper of a wrapper of ...: deeper chains than this are not followed (and a cycle ends here too)
_MAX_DEPTH = 8
NAMED_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
HOW_WRAPPERS_ARE_FOLLOWED = ("through get_base_model() (PEFT's PeftModel), a module's only child module, and "
                             "functools.wraps' __wrapped__")


@dataclass(frozen=True)
class ForwardSignature:
    """forward()'s named parameters (``own``), and those its ``**kwargs`` reach in the modules it wraps.

    ``passed_on``: named parameters of the wrapped modules' forward() that forward() itself does not name;
    ``route``: how they were found (``"PeftModel -get_base_model()-> LlamaForCausalLM"``), "" when none were;
    ``takes_kwargs``: forward() has a ``**kwargs`` parameter.
    """

    own: tuple[inspect.Parameter, ...]
    passed_on: tuple[inspect.Parameter, ...]
    route: str
    takes_kwargs: bool


def _named(module: nn.Module) -> tuple[list[inspect.Parameter], bool]:
    """forward()'s named parameters in signature order (inspect follows __wrapped__), and whether it takes **kwargs."""
    parameters = inspect.signature(module.forward).parameters.values()
    return ([p for p in parameters if p.kind in NAMED_KINDS],
            any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters))


def wrapped_module(module: nn.Module) -> tuple[nn.Module, str] | None:
    """The module ``module``'s forward() passes its inputs on to, and how it was found; None when there is none."""
    get_base_model = getattr(module, "get_base_model", None)
    if callable(get_base_model):
        try:
            base = get_base_model()
        except Exception:  # an unrelated method of that name: fall back to the child-module rule
            base = None
        if isinstance(base, nn.Module) and base is not module:
            return base, "get_base_model()"
    children = list(module.named_children())
    if len(children) == 1:
        return children[0][1], f".{children[0][0]}"
    return None


def forward_signature(model: nn.Module) -> ForwardSignature:
    """forward()'s own named parameters, then (while each forward takes **kwargs) those of the modules it wraps."""
    own, takes_kwargs = _named(model)
    passed_on: list[inspect.Parameter] = []
    seen = {p.name for p in own}
    route, module, kwargs_open = type(model).__name__, model, takes_kwargs
    visited = {id(model)}
    for _ in range(_MAX_DEPTH):
        found = wrapped_module(module) if kwargs_open else None
        if found is None or id(found[0]) in visited:
            break
        module, how = found
        visited.add(id(module))
        route += f" -{how}-> {type(module).__name__}"
        named, kwargs_open = _named(module)
        passed_on += [p for p in named if p.name not in seen]
        seen.update(p.name for p in named)
    return ForwardSignature(own=tuple(own), passed_on=tuple(passed_on), route=route if passed_on else "",
                            takes_kwargs=takes_kwargs)


@contextmanager
def named_forward(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """``model.forward`` temporarily as a function of exactly ``names`` (passed on by keyword).

    torch.export binds inputs and dynamic shapes to forward()'s signature; a wrapper's ``**kwargs`` gets
    them wrong, so the export front end sees a forward that names the inputs and calls the real one by
    keyword. The model itself stays the export root, so module paths and parameter names do not change.
    """
    had_own = "forward" in model.__dict__
    saved = model.__dict__.get("forward")
    original = model.forward
    signature = inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                   for name in names])

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(**signature.bind(*args, **kwargs).arguments)

    forward.__signature__ = signature  # type: ignore[attr-defined]
    model.__dict__["forward"] = forward
    try:
        yield
    finally:
        if had_own:
            model.__dict__["forward"] = saved
        else:
            del model.__dict__["forward"]
