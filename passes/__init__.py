"""Compile-time passes: trace, annotate costs, build the cost chain, partition, generate stage code."""

from __future__ import annotations

import importlib
from typing import Any

# `trace` and `partition` are both a submodule and a function of that name. Importing the
# submodule would set the package attribute to the module, so bind the functions eagerly: a
# later `import fxpipe.passes.trace` finds the module in sys.modules and leaves the name alone.
from fxpipe.passes.partition import partition as partition
from fxpipe.passes.trace import trace as trace

_EXPORTS: dict[str, tuple[str, str]] = {
    "TraceError": ("fxpipe.passes.trace", "TraceError"),
    "ExampleInputsTypeError": ("fxpipe.passes.trace", "ExampleInputsTypeError"),
    "BATCH": ("fxpipe.passes.costs", "BATCH"),
    "NodeCost": ("fxpipe.passes.costs", "NodeCost"),
    "MeasuredCosts": ("fxpipe.passes.profile", "MeasuredCosts"),
    "BlockTime": ("fxpipe.passes.profile", "BlockTime"),
    "default_blocks": ("fxpipe.passes.profile", "default_blocks"),
    "annotate_costs": ("fxpipe.passes.costs", "annotate_costs"),
    "to_cost_graph": ("fxpipe.passes.costs", "to_cost_graph"),
    "measure_costs": ("fxpipe.passes.profile", "measure_costs"),
    "read_profile": ("fxpipe.passes.profiles_io", "read_profile"),
    "build_chain": ("fxpipe.passes.chain", "build_chain"),
    "split_stages": ("fxpipe.passes.codegen", "split_stages"),
}

__all__ = sorted([*_EXPORTS, "partition", "trace"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module_name, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'fxpipe.passes' has no attribute {name!r}")
