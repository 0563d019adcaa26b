"""Type checks for values read from JSON, against dataclass-style annotations (int is not bool, floats finite)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any

_NAMES: dict[Any, str] = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
                          type(None): "null"}


class JSONValueError(ValueError):
    """A JSON value does not have the declared type; the message names the field, the value and the type."""


def describe(hint: Any) -> str:
    """What a value of type ``hint`` looks like in JSON, for error messages ("an integer", ...)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arm) for arm in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"a list whose items are each {describe(args[0])}"
    if origin is tuple:
        return f"a list of {len(args)} items ({', '.join(describe(arm) for arm in args)})"
    if origin is dict:
        return f"an object whose keys are each {describe(args[0])} and values each {describe(args[1])}"
    return _NAMES.get(hint, f"a {getattr(hint, '__name__', hint)}")


def _is_finite_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False


def _conform_items(value: Any, hint: Any) -> Any:
    """``value`` as the tuple or dict ``hint`` declares, or raise JSONValueError (caught by :func:`conform`)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict and isinstance(value, Mapping):
        return {conform(key, args[0]): conform(item, args[1]) for key, item in value.items()}
    if origin is tuple and isinstance(value, list | tuple):
        arms = (args[0],) * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(arms) == len(value):
            return tuple(conform(item, arm) for item, arm in zip(value, arms, strict=True))
    raise JSONValueError(describe(hint))


def conform(value: Any, hint: Any) -> Any:
    """``value`` converted to the type ``hint`` declares (lists become tuples, ints become floats).

    Raises :class:`JSONValueError` whose message is :func:`describe` of ``hint``. Understands
    ``bool``, ``int``, ``float``, ``str``, ``None``, unions, ``tuple[X, ...]``, fixed tuples,
    ``dict[K, V]`` and plain classes (checked with isinstance).
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arm in args:
            try:
                return conform(value, arm)
            except JSONValueError:
                continue
    elif origin in (tuple, dict):
        try:
            return _conform_items(value, hint)
        except JSONValueError:
            pass
    elif hint is float:
        if _is_finite_number(value):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(hint, type) and isinstance(value, hint):
        return value
    raise JSONValueError(describe(hint))


def read_field(data: Any, key: str, hint: Any, where: str = "") -> Any:
    """``data[key]`` conformed to ``hint``; JSONValueError names ``where.key``, the value and the expected type."""
    path = f"{where}.{key}" if where else key
    if not isinstance(data, Mapping):
        raise JSONValueError(f"{where or 'the top level'} must be a JSON object with key {key!r}, "
                             f"got {type(data).__name__} {data!r:.80}")
    if key not in data:
        raise JSONValueError(f"{where or 'the top level'} needs key {key!r}; it has keys {sorted(map(str, data))}")
    try:
        return conform(data[key], hint)
    except JSONValueError as error:
        raise JSONValueError(f"{path} {data[key]!r:.80} must be {error}") from None


@cache
def field_hints(cls: type) -> dict[str, Any]:
    """A dataclass's field annotations, resolved (modules use ``from __future__ import annotations``)."""
    hints = typing.get_type_hints(cls)
    return {field.name: hints[field.name] for field in dataclasses.fields(cls)}
