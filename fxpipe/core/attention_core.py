"""Attention cores on a cost graph: the nodes from the QK^T matmul to the xV matmul (or an SDPA call)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fxpipe.core.costgraph import Affine, CostGraph, CostNode

_MATMULS = ("matmul", "bmm", "baddbmm", "einsum")
_SOFTMAXES = ("softmax", "_softmax", "_safe_softmax")
# how far from a softmax its two matmuls may lie: scale, mask, casts and dropout sit between them
_SEARCH_DEPTH = 8


def _target(node: CostNode) -> str:
    """``call_function:matmul`` -> ``matmul``; ``call_function:bmm.default`` (an aten overload) -> ``bmm``;
    ``call_module:Softmax`` -> ``softmax``."""
    return node.op.rpartition(":")[2].removeprefix("aten.").split(".")[0].lower()


def _is_matmul(node: CostNode) -> bool:
    return _target(node) in _MATMULS


def _is_sdpa(node: CostNode) -> bool:
    return "scaled_dot_product_attention" in node.op or "_scaled_dot_product" in node.op


def attention_core_nodes(graph: CostGraph) -> list[tuple[str, ...]]:
    """Each attention core's node names, in graph order (:func:`attention_cores`)."""
    return attention_cores(graph.nodes)


def attention_cores(nodes: Sequence[CostNode]) -> list[tuple[str, ...]]:
    """Each attention core's node names among ``nodes`` (topological order; only ``name``, ``op`` and ``inputs``
    are read, so a stage's fx graph works too): an SDPA node alone, or for each softmax whose input comes (within
    a few ops) from a matmul and whose output reaches one, every node on a path between the two matmuls, both
    included (the part that grows with the sequence length squared)."""
    position = {node.name: index for index, node in enumerate(nodes)}
    by_name = {node.name: node for node in nodes}
    consumers: dict[str, list[str]] = {node.name: [] for node in nodes}
    for node in nodes:
        for producer in node.inputs:
            if producer in consumers:
                consumers[producer].append(node.name)
    cores: list[tuple[str, ...]] = []
    for node in nodes:
        if _is_sdpa(node):
            cores.append((node.name,))
        elif _target(node) in _SOFTMAXES:
            first = _nearest(node.name, lambda name: by_name[name].inputs, by_name)
            last = _nearest(node.name, lambda name: consumers[name], by_name)
            if first is not None and last is not None:
                cores.append(_between(first, last, position, by_name, consumers))
    return cores


def _nearest(start: str, step: object, by_name: Mapping[str, CostNode]) -> str | None:
    """The closest matmul reached from ``start`` by ``step`` (inputs or consumers), breadth first."""
    frontier, seen = [start], {start}
    for _ in range(_SEARCH_DEPTH):
        following = [nxt for name in frontier for nxt in step(name)  # type: ignore[operator]
                     if nxt not in seen and nxt in by_name]
        for name in following:
            if _is_matmul(by_name[name]):
                return name
        seen.update(following)
        frontier = following
    return None


def _between(first: str, last: str, position: Mapping[str, int], by_name: Mapping[str, CostNode],
             consumers: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """Nodes that are descendants of ``first`` and ancestors of ``last`` (both included), in graph order."""
    lo, hi = position[first], position[last]
    below = {first}
    for name in sorted(position, key=position.__getitem__)[lo + 1:hi + 1]:
        if any(producer in below for producer in by_name[name].inputs):
            below.add(name)
    above = {last}
    stack = [last]
    while stack:
        for producer in by_name[stack.pop()].inputs:
            if producer not in above and producer in position and lo <= position[producer] <= hi:
                above.add(producer)
                stack.append(producer)
    return tuple(sorted(below & above, key=position.__getitem__))


def core_figures(graph: CostGraph, core: Sequence[str]) -> tuple[Affine, Affine]:
    """``(saved bytes, forward seconds)`` of one core: the bytes its nodes save less the bytes of the tensors it
    reads from outside (a recomputed core keeps those: Q, K, V, the mask), at least 0; and its forward time."""
    by_name = graph.by_name()
    members = set(core)
    saved = Affine.total(by_name[name].saved_bytes for name in core)
    inputs = sorted({producer for name in core for producer in by_name[name].inputs if producer not in members})
    kept = Affine.total(by_name[name].output_bytes for name in inputs if by_name[name].tensor_output)
    net = Affine(max(0.0, saved.fixed - kept.fixed), max(0.0, saved.per_sample - kept.per_sample))
    return net, Affine.total(by_name[name].forward_s for name in core)


def cores_within_blocks(graph: CostGraph, block_of: Mapping[str, int]) -> dict[str, tuple[Affine, Affine]]:
    """The figures of each core lying whole in one block (``block_of``: node name -> block), keyed by its last node
    (the xV matmul or the SDPA call). A core a block boundary cuts is left out: no block can recompute it alone."""
    return {core[-1]: core_figures(graph, core) for core in attention_core_nodes(graph)
            if len({block_of[name] for name in core}) == 1}


def cuts_inside_cores(graph: CostGraph) -> set[int]:
    """Node-level cuts (cut k lies between node k and k + 1) that would split an attention core; a chain never cuts
    there (the scores and probabilities crossing such a cut grow with the sequence length squared anyway)."""
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    inside: set[int] = set()
    for core in attention_core_nodes(graph):
        spots = [position[name] for name in core]
        inside.update(range(min(spots), max(spots)))
    return inside
