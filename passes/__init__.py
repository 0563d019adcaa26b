"""Compile-time passes: trace, annotate costs, build the cost chain, partition, generate stage code."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, str]] = {
    "trace": ("fxpipe.passes.trace", "trace"),
    "TraceError": ("fxpipe.passes.trace", "TraceError"),
    "annotate_costs": ("fxpipe.passes.costs", "annotate_costs"),
    "to_cost_graph": ("fxpipe.passes.costs", "to_cost_graph"),
    "measure_costs": ("fxpipe.passes.profile", "measure_costs"),
    "read_profile": ("fxpipe.passes.profiles_io", "read_profile"),
    "build_chain": ("fxpipe.passes.chain", "build_chain"),
    "partition": ("fxpipe.passes.partition", "partition"),
    "split_stages": ("fxpipe.passes.codegen", "split_stages"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module_name, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'fxpipe.passes' has no attribute {name!r}")
