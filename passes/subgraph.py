"""Cut a set of nodes out of a traced graph into a standalone GraphModule (the one graph-cutting mechanism)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx

from fxpipe.core import meta


class SubgraphError(ValueError):
    """The node set, inputs or outputs asked of ``extract_subgraph`` do not fit the graph."""


@dataclass(frozen=True)
class Subgraph:
    """A node set as a module: ``module(*inputs)`` returns the tuple of ``output_names`` values.

    ``input_names`` and ``output_names`` are node names of the full graph; the module's forward
    arguments carry the same names, so its generated code reads like the original graph.
    """

    module: fx.GraphModule
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]


def extract_subgraph(
    gm: fx.GraphModule,
    node_names: Sequence[str],
    *,
    inputs: Sequence[str] | None = None,
    outputs: Sequence[str] | None = None,
    attribute_names: Mapping[str, str] | None = None,
    class_name: str = "Subgraph",
) -> Subgraph:
    """Return the nodes ``node_names`` of ``gm`` as a GraphModule; ``gm`` is not modified.

    By default the inputs are the outside values the set reads (in graph order; placeholders of
    ``gm`` included) and the outputs are the set's values read outside the set or by the graph
    output (in graph order). ``inputs`` fixes the argument order (it must contain every value the
    set reads from outside; extra names become unused arguments). ``outputs`` fixes what is
    returned; an output that is an input is passed straight through. Parameters, buffers and
    submodules referenced by ``get_attr``/``call_module`` nodes of the set are shared (not copied)
    under the same attribute paths, or under ``attribute_names[target]`` for ``get_attr`` targets.
    """
    nodes_by_name = {node.name: node for node in gm.graph.nodes}
    members = _member_nodes(gm, node_names, nodes_by_name)
    required = _outside_reads(gm, members)
    input_names = _resolve_inputs(required, inputs, nodes_by_name)
    output_names = _resolve_outputs(gm, members, input_names, outputs)
    graph, root = _build_graph(gm, members, input_names, output_names, dict(attribute_names or {}))
    module = fx.GraphModule(root, graph, class_name=class_name)
    if meta.FRONTEND in gm.meta:  # the other whole-graph meta (inputs, names) does not describe a part
        module.meta[meta.FRONTEND] = gm.meta[meta.FRONTEND]
    return Subgraph(module=module, input_names=input_names, output_names=output_names)


def _member_nodes(gm: fx.GraphModule, node_names: Sequence[str], nodes_by_name: Mapping[str, fx.Node]) -> set[fx.Node]:
    unknown = sorted(name for name in node_names if name not in nodes_by_name)
    if unknown:
        raise SubgraphError(f"nodes {unknown} are not in the graph; use node names from gm.graph.nodes")
    members = {nodes_by_name[name] for name in node_names}
    if any(node.op == "output" for node in members):
        raise SubgraphError("the output node cannot be part of a subgraph; its inputs become outputs instead")
    # Placeholders are values from outside by nature: listing one only makes it an input.
    return {node for node in members if node.op != "placeholder"}


def _outside_reads(gm: fx.GraphModule, members: set[fx.Node]) -> list[str]:
    read = {source for node in members for source in node.all_input_nodes if source not in members}
    return [node.name for node in gm.graph.nodes if node in read]


def _resolve_inputs(
    required: list[str], inputs: Sequence[str] | None, nodes_by_name: Mapping[str, fx.Node]
) -> tuple[str, ...]:
    if inputs is None:
        return tuple(required)
    missing = [name for name in required if name not in inputs]
    if missing:
        raise SubgraphError(f"the node set reads {missing} from outside but inputs={list(inputs)} lacks them")
    unknown = [name for name in inputs if name not in nodes_by_name]
    if unknown or len(set(inputs)) != len(inputs):
        raise SubgraphError(f"inputs={list(inputs)} must be distinct node names of the graph (unknown: {unknown})")
    return tuple(inputs)


def _resolve_outputs(
    gm: fx.GraphModule, members: set[fx.Node], input_names: tuple[str, ...], outputs: Sequence[str] | None
) -> tuple[str, ...]:
    if outputs is None:
        return tuple(
            node.name for node in gm.graph.nodes if node in members and any(user not in members for user in node.users)
        )
    member_names = {node.name for node in members}
    stray = [name for name in outputs if name not in member_names and name not in input_names]
    if stray:
        raise SubgraphError(f"outputs {stray} are neither computed by the node set nor among its inputs")
    return tuple(outputs)


def _build_graph(
    gm: fx.GraphModule,
    members: set[fx.Node],
    input_names: tuple[str, ...],
    output_names: tuple[str, ...],
    attribute_names: dict[str, str],
) -> tuple[fx.Graph, dict[str, Any]]:
    nodes_by_name = {node.name: node for node in gm.graph.nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in input_names:
        original = nodes_by_name[name]
        # name= keeps the value name verbatim (the default would snake_case it).
        placeholder = graph.create_node("placeholder", name, name=name)
        placeholder.meta = dict(original.meta)
        env[original] = placeholder
    root: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node not in members:
            continue
        copied = graph.node_copy(node, lambda source: env[source])
        if node.op in ("get_attr", "call_module"):
            target = attribute_names.get(node.target, node.target) if node.op == "get_attr" else node.target
            copied.target = target
            root[target] = _fetch_attribute(gm, node.target)
        env[node] = copied
    graph.output(tuple(env[nodes_by_name[name]] for name in output_names))
    graph.lint()
    return graph, root


def _fetch_attribute(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        if not hasattr(value, atom):
            raise SubgraphError(f"graph attribute {target!r} does not exist on the GraphModule (missing {atom!r})")
        value = getattr(value, atom)
    return value


__all__ = ["Subgraph", "SubgraphError", "extract_subgraph"]
