"""Compile-time passes: trace, annotate costs, build the cost chain, partition, generate stage code."""

from __future__ import annotations

import importlib
from typing import Any

# Every public name resolves lazily, so importing one pass (or the plain-number planner in
# fxpipe.passes.partition) does not load the tracer, the planner or the others. The function
# `trace` lives in fxpipe.passes.tracing, so no submodule shadows it; `fxpipe.passes.partition`
# is the planner subpackage (its `partition` function: fxpipe.passes.partition.partition).
_EXPORTS: dict[str, tuple[str, str]] = {
    "trace": ("fxpipe.passes.tracing", "trace"),
    "TraceError": ("fxpipe.passes.tracing", "TraceError"),
    "ExampleInputsTypeError": ("fxpipe.passes.tracing", "ExampleInputsTypeError"),
    "BATCH": ("fxpipe.passes.costs", "BATCH"),
    "SymbolicCost": ("fxpipe.passes.fakerun", "SymbolicCost"),
    "MeasuredCosts": ("fxpipe.passes.profile", "MeasuredCosts"),
    "BlockTime": ("fxpipe.passes.profile", "BlockTime"),
    "default_blocks": ("fxpipe.passes.profile", "default_blocks"),
    "annotate_costs": ("fxpipe.passes.costs", "annotate_costs"),
    "to_cost_graph": ("fxpipe.passes.costs", "to_cost_graph"),
    "measure_costs": ("fxpipe.passes.profile", "measure_costs"),
    "read_profile": ("fxpipe.passes.profiles_io", "read_profile"),
    "build_chain": ("fxpipe.core.chain", "build_chain"),
    "split_stages": ("fxpipe.passes.codegen", "split_stages"),
    "find_tensor_parallel": ("fxpipe.passes.tensor_parallel", "find_tensor_parallel"),
    "shard_stage": ("fxpipe.passes.tp_shard", "shard_stage"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module_name, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'fxpipe.passes' has no attribute {name!r}")
