"""Device constants a traced stage carries, pointed at the device the stage runs on.

A graph traced with example inputs on the CPU can hold the CPU as a constant: torch.export (fxpipe's fallback
tracer for models torch.fx cannot trace, Hugging Face's among them) writes ``device=cpu`` into every factory call
whose device came from an input, such as GPT-2's ``aten.arange(n, device=cpu)`` for its position ids. Run on a GPU,
such a stage makes those tensors on the CPU and fails at the first op that meets a GPU tensor ("index is on cpu,
different from other tensors on cuda:0"; the first device run of issue 36). torch.distributed.pipelining rewrites
the same constants when it places a stage (``_modify_graph_op_device``).

Only the devices a trace can have taken from its example inputs are rewritten (the CPU and the meta device); a
graph that names a GPU, or one run on the CPU, is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

__all__ = ["TRACE_DEVICE_TYPES", "retarget_device_constants"]

TRACE_DEVICE_TYPES = ("cpu", "meta")


def retarget_device_constants(module: torch.nn.Module, device: torch.device,
                              from_types: tuple[str, ...] = TRACE_DEVICE_TYPES) -> int:
    """Point every ``torch.device`` constant of a type in ``from_types`` (default: the CPU and meta) in the
    arguments of ``module``'s graphs (its own and any nested GraphModule's, such as a higher-order op's body) at
    ``device``, in place, as ``module.to(device)`` moves its tensors; returns how many nodes changed. Nothing
    changes when ``device`` is itself of such a type (a stage run on the CPU keeps its CPU constants)."""
    if device.type in from_types:
        return 0
    changed = 0
    for graph_module in (m for m in module.modules() if isinstance(m, fx.GraphModule)):
        count = 0
        for node in graph_module.graph.nodes:
            args, kwargs = fx.node.map_aggregate((node.args, node.kwargs),
                                                 lambda value: _retargeted(value, device, from_types))
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs = args, kwargs
                count += 1
        if count:
            graph_module.recompile()
            changed += count
    return changed


def _retargeted(value: Any, device: torch.device, from_types: tuple[str, ...]) -> Any:
    if isinstance(value, torch.device) and value.type in from_types:
        return device
    return value
