"""FSDP units of a sharded stage: its parameters grouped by block (module path), and the stage's graph calling each block as a module.

FSDP2 gathers and frees a ``fully_shard``-ed module's weights in that module's forward hooks, so a unit must
be a module the stage calls. A traced stage calls only leaves (fx) or reads every weight through ``get_attr``
(export), never a transformer block. :func:`unit_paths` groups the parameters by the first numbered component
of their path (``h.3.attn.c_attn.weight`` -> ``h.3``, ``model.layers.0.mlp...`` -> ``model.layers.0``): one
unit per block of a ``ModuleList``/``Sequential``. :func:`unit_program` then cuts the stage's graph so that each
unit's nodes run inside one ``call_module`` of a small GraphModule (:class:`UnitModule`) whose children are
the block's own modules and parameters (the same objects: when FSDP2 swaps gathered weights in, the stage
module sees them under their usual paths). Everything else (embeddings, final norm, head) is the root unit.

A block becomes a unit only where that is safe: its nodes form one stretch of the graph (get_attr nodes
move to their first reader) that reads no other block's or the root's modules, and no other unit's stretch
overlaps it. The unit holds the block module itself as its child ``block``, so FSDP2 swaps each parameter on
its own module, the one the stage's paths name.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxpipe.core.sharding import block_path


@dataclass(frozen=True)
class UnitSpan:
    """One unit: its module path and the graph nodes (by position) it runs, get_attr nodes included."""

    path: str
    node_indexes: tuple[int, ...]


# what a checkpointed region (fxpipe.passes.recompute_regions) reading several blocks' modules reads: no unit's path
MIXED_BLOCKS = "<several blocks>"


def _reads(node: fx.Node) -> str | None:
    """The block path whose modules or parameters ``node`` reads (None: none, a root module's or only functions).

    A checkpointed region (per-block recompute) reads what its own graph reads: a region inside one block joins that
    block's unit, so FSDP2's hooks sit outside the checkpoint (as torchtitan applies ``fully_shard`` after
    activation checkpointing): the unit's pre-backward hook gathers its weights before the recompute runs on them."""
    if node.op == "get_attr":
        return block_path(str(node.target))
    if node.op != "call_module":
        return None
    inner = region_of(node)
    if inner is None:
        return block_path(str(node.target))
    paths = {_reads(each) for each in inner.graph.nodes} - {None}
    return paths.pop() if len(paths) == 1 else MIXED_BLOCKS if paths else None


def _inside_block(node: fx.Node, path: str) -> bool:
    """Whether ``node`` may run inside block ``path``'s unit: it reads that block's modules, or nothing (a function,
    or a checkpointed region calling only functions: an attention core of matmuls and a softmax)."""
    if node.op not in ("call_module", "get_attr"):
        return True
    found = _reads(node)
    return found == path or (found is None and region_of(node) is not None)


def region_of(node: fx.Node) -> fx.GraphModule | None:
    """The region graph a ``call_module`` node runs when its module is a checkpointed region, else None."""
    owner = node.graph.owning_module
    if owner is None or node.op != "call_module":
        return None
    module = owner.get_submodule(str(node.target))
    # marked by fxpipe.passes.recompute_regions.CheckpointedRegion (the runtime does not import the passes)
    region = module.__dict__.get("region") if getattr(module, "is_checkpointed_region", False) else None
    return region if isinstance(region, fx.GraphModule) else None


def unit_spans(gm: fx.GraphModule) -> list[UnitSpan]:
    """The stage's units in forward order (see the module docstring for which blocks qualify)."""
    nodes = list(gm.graph.nodes)
    position = {node: index for index, node in enumerate(nodes)}
    members: dict[str, list[int]] = {}
    uses: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        path = _reads(node)
        if path is None:
            continue
        members.setdefault(path, []).append(index)
        # a get_attr runs where it is read (export hoists them to the top of the graph)
        readers = [position[user] for user in node.users] if node.op == "get_attr" else [index]
        uses.setdefault(path, []).extend(readers or [index])
    spans = {path: (min(found), max(found)) for path, found in uses.items() if _has_parameters(gm, path)}
    ordered = sorted(spans, key=lambda path: spans[path])
    keep = [path for path in ordered if not any(
        other != path and spans[other][0] <= spans[path][1] and spans[path][0] <= spans[other][1] for other in ordered)]
    units = []
    for path in keep:
        low, high = spans[path]
        inside = [index for index in range(low, high + 1)
                  if nodes[index].op not in ("get_attr", "placeholder", "output") or index in members[path]]
        inside += [index for index in members[path] if index < low]
        if not all(_inside_block(nodes[index], path) for index in inside):
            continue  # it calls a module of another block or of the root: not one stretch of this block
        units.append(UnitSpan(path, tuple(sorted(set(inside)))))
    return units


def _has_parameters(gm: fx.GraphModule, path: str) -> bool:
    try:
        block = gm.get_submodule(path)
    except AttributeError:
        return False
    return any(True for _ in block.parameters())


def unit_paths(gm: fx.GraphModule) -> list[str]:
    """The module paths of the stage's units, in forward order."""
    return [span.path for span in unit_spans(gm)]


def unviewed(value: Any) -> Any:
    """``value``, copied when it is a view: FSDP2 hooks a unit's outputs for its backward (the gather, the
    reduction), and an in-place op on a view output (a residual's ``x += y``) would drop that hook. A checkpointed
    region's outputs (a tuple, taken apart after the unit when the block's last node is the region) each alike."""
    if isinstance(value, tuple):
        return tuple(unviewed(each) for each in value)
    return value.clone() if isinstance(value, torch.Tensor) and value._is_view() else value


class UnitModule(fx.GraphModule):
    """One unit's nodes as a GraphModule whose one child ``block`` is the stage's block module itself (the same
    object: FSDP2 swaps gathered weights in on their owners, so the stage module sees them under their paths)."""


def _unit_module(gm: fx.GraphModule, span: UnitSpan, nodes: Sequence[fx.Node]) -> tuple[UnitModule, list[fx.Node],
                                                                                         list[fx.Node]]:
    """The unit's GraphModule, the outside values it reads (its arguments) and the values read after it (its results)."""
    inside = [nodes[index] for index in span.node_indexes]
    inside_set = set(inside)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[fx.Node] = []
    regions: dict[str, torch.nn.Module] = {}

    def value_of(node: fx.Node) -> fx.Node:
        if node not in env:
            inputs.append(node)
            env[node] = graph.placeholder(f"in_{len(inputs) - 1}")
        return env[node]

    for node in inside:
        for arg in node.all_input_nodes:
            if arg not in inside_set:
                value_of(arg)
        copied = graph.node_copy(node, lambda arg: env[arg])
        if region_of(node) is not None:  # a checkpointed region: the unit holds it under its own name
            regions[str(node.target)] = gm.get_submodule(str(node.target))
        elif node.op in ("call_module", "get_attr"):
            copied.target = "block" + str(node.target)[len(span.path):]
        env[node] = copied
    outputs = [node for node in inside if any(user not in inside_set for user in node.users)]
    graph.output(tuple(graph.call_function(unviewed, (env[node],)) for node in outputs))
    holder = torch.nn.Module()
    holder.block = gm.get_submodule(span.path)
    for name, region in regions.items():
        holder.add_module(name, region)
    module = UnitModule(holder, graph, class_name="UnitModule")
    module.block = holder.block  # GraphModule copied fresh parents of what the graph reads; use the block whole
    return module, inputs, outputs


def unit_program(gm: fx.GraphModule, spans: Iterable[UnitSpan]) -> tuple[fx.GraphModule, list[UnitModule]]:
    """A GraphModule computing what ``gm`` computes with each span's nodes inside one call of its unit module
    (registered as ``fsdp_unit_<k>``), and the units in forward order; the rest reads ``gm``'s own children.
    ``gm`` is left as it was."""
    nodes = list(gm.graph.nodes)
    by_first: dict[int, tuple[int, UnitSpan, list[fx.Node], list[fx.Node]]] = {}
    modules: list[UnitModule] = []
    for span in spans:
        module, inputs, outputs = _unit_module(gm, span, nodes)
        by_first[min(index for index in span.node_indexes if nodes[index].op != "get_attr")] = (
            len(modules), span, inputs, outputs)
        modules.append(module)
    skipped = {index for _, span, _, _ in by_first.values() for index in span.node_indexes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for index, node in enumerate(nodes):
        if index in by_first:
            number, span, inputs, outputs = by_first[index]
            for value in inputs:  # a root get_attr placed after the unit's first node
                if value not in env:
                    env[value] = graph.node_copy(value, lambda arg: env[arg])
            call = graph.call_module(f"fsdp_unit_{number}", tuple(env[value] for value in inputs))
            for position, value in enumerate(outputs):
                env[value] = graph.call_function(operator.getitem, (call, position))
        if index not in skipped and node not in env:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    attributes: dict[str, object] = {f"fsdp_unit_{number}": module for number, module in enumerate(modules)}
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr") and node.target not in attributes:
            attributes[node.target] = gm.get_submodule(node.target) if node.op == "call_module" else _attribute(gm, node.target)
    program = fx.GraphModule(attributes, graph, class_name="UnitProgram")
    for name, child in gm.named_children():  # share the stage's objects (see UnitModule)
        setattr(program, name, child)
    for name, param in gm.named_parameters(recurse=False):
        program.register_parameter(name, param)
    for name, buffer in gm.named_buffers(recurse=False):
        program.register_buffer(name, buffer)
    for number, module in enumerate(modules):  # after the stage's children: parameters keep the stage's names
        delattr(program, f"fsdp_unit_{number}")
        program.add_module(f"fsdp_unit_{number}", module)
    return program, modules


def _attribute(module: torch.nn.Module, target: str) -> object:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def unit_parameters(modules: Sequence[torch.nn.Module]) -> set[torch.nn.Parameter]:
    return {param for module in modules for param in module.parameters()}
