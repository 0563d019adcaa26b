"""Tensor-parallel analysis: find Megatron-style column -> per-head -> row linear pairs on a traced graph."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxpipe.core import meta
from fxpipe.passes.tp_rules import (
    ELEMENTWISE,
    RESHAPES,
    SPLITS,
    Conflict,
    LinearInfo,
    Shard,
    input_of,
    linear_info,
    op_name,
    propagate,
    shape_parts,
    split_dim,
)
from fxpipe.passes.tp_shapes import NodeShapes, node_shapes

__all__ = ["MAX_GROUP_SIZE", "ParallelRegion", "SplitStates", "column_groups", "TensorParallelAnalysis", "VocabParallel",
           "embedding_ids", "find_tensor_parallel", "split_states", "vocab_parallel_ends"]

# The largest tensor-parallel group the planner considers (one node); a GQA kv projection counts as split in the
# costs when every T up to this size that divides the other heads divides the kv heads too.
MAX_GROUP_SIZE = 8

_HEAD_PATH_OPS = RESHAPES | {"slice", "to", "_to_copy", "contiguous", "clone", "float", "type", "alias"}


@dataclass(frozen=True)
class ParallelRegion:
    """One Megatron pair: ``columns`` split their outputs (fused ones by ``fused`` part sizes), ``nodes`` run
    per head / channel on the parts, ``rows`` multiply the parts and sum over the group.

    ``replicable`` are the GQA kv columns that may stay whole (each member then takes its heads after the
    repeat); ``divisor`` is the gcd of every split size, ``divisor_replicated`` the same with those kept whole.
    """

    columns: tuple[str, ...]
    rows: tuple[str, ...]
    nodes: tuple[str, ...]
    fused: tuple[tuple[str, tuple[int, ...]], ...]
    replicable: tuple[str, ...]
    divisor: int
    divisor_replicated: int
    replicable_nodes: tuple[str, ...] = ()  # the nodes that stay whole with the replicable columns


@dataclass(frozen=True)
class VocabParallel:
    """An embedding or an output head that can be split over its vocabulary (``vocab_size`` rows)."""

    node: str
    kind: str  # "embedding" or "head"
    weight: str  # the original parameter name
    vocab_size: int
    path: str = ""  # the weight's attribute path in the graph module


@dataclass(frozen=True)
class TensorParallelAnalysis:
    """What :func:`find_tensor_parallel` found: pairs, vocabulary-parallel ends, sequence-parallel nodes
    (norms, dropout, residual adds on the token rows between pairs) and the linears that stay whole (why)."""

    regions: tuple[ParallelRegion, ...]
    vocab: tuple[VocabParallel, ...]
    sequence_nodes: tuple[str, ...]
    replicated: tuple[tuple[str, str], ...]

    @property
    def divisor(self) -> int:
        """T must divide this for every pair to split (0 when nothing splits)."""
        return math.gcd(*(region.divisor for region in self.regions)) if self.regions else 0

    def notes(self) -> list[str]:
        """Plan notes: what splits and what stays whole."""
        lines = [f"tensor parallel: {len(self.regions)} column/row pairs "
                 f"({sum(len(r.columns) for r in self.regions)} column, {sum(len(r.rows) for r in self.regions)} "
                 f"row linears), vocabulary-parallel: {[v.node for v in self.vocab] or 'none'}"]
        lines += [f"replicated linear {name}: {why}" for name, why in self.replicated]
        return lines


@dataclass
class SplitStates:
    """One propagation: the split state of every node with ``replicated`` column candidates kept whole."""

    states: dict[fx.Node, Shard]
    rows: dict[fx.Node, frozenset[str]]  # row linear -> the columns it closes
    columns: dict[str, LinearInfo]
    fused: dict[str, tuple[int, ...]]
    expand_origins: frozenset[str]
    replicated: dict[str, str]


def split_states(gm: fx.GraphModule, shapes: NodeShapes, keep_whole: Iterable[str] = ()) -> SplitStates:
    """Split every column candidate that can be, keeping ``keep_whole`` whole; conflicts keep more whole until
    the graph has a consistent assignment (each retry keeps at least one more column whole, so it ends)."""
    replicated = {name: "kept whole" for name in keep_whole}
    while True:
        try:
            result = _propagate_once(gm, shapes, replicated)
        except Conflict as conflict:
            assert conflict.origins and not conflict.origins & replicated.keys(), conflict.why
            replicated.update(dict.fromkeys(sorted(conflict.origins), conflict.why))
            continue
        result.replicated = replicated
        return result


def _propagate_once(gm: fx.GraphModule, shapes: NodeShapes, replicated: Mapping[str, str]) -> SplitStates:
    states: dict[fx.Node, Shard] = {}
    rows: dict[fx.Node, frozenset[str]] = {}
    columns: dict[str, LinearInfo] = {}
    fused: dict[str, tuple[int, ...]] = {}
    expand_origins: set[str] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            _check_output(node, states)
            continue
        name = op_name(gm, node)
        info = linear_info(gm, node, name)
        if info is not None:
            _linear_state(info, shapes, states, rows, columns, replicated)
            continue
        state = propagate(node, name, states, shapes.get)  # type: ignore[arg-type]
        if state is None:
            continue
        if name in SPLITS and split_dim(node, len(shapes.get(input_of_split(node)))) == state.dim:
            fused_parts(node, state, shapes, columns, fused)
        if name in ("expand", "expand_as"):
            expand_origins |= state.origins
        states[node] = state
    return SplitStates(states, rows, columns, fused, frozenset(expand_origins), dict(replicated))


def input_of_split(node: fx.Node) -> fx.Node:
    source = node.args[0]
    assert isinstance(source, fx.Node)
    return source


def fused_parts(node: fx.Node, state: Shard, shapes: NodeShapes, columns: Mapping[str, LinearInfo],
                fused: dict[str, tuple[int, ...]]) -> None:
    """Record a split along the split dim of one column's output (fused q/k/v) as that column's part sizes."""
    parts = shape_parts(node, shapes.get)  # type: ignore[arg-type]
    (origin,) = state.origins if len(state.origins) == 1 else (None,)
    if parts is None or origin is None or columns[origin].out_features != state.extent:
        raise Conflict(state.origins, f"{node.name} splits the split dim of a value that is not one column's output")
    sizes = tuple(part[state.dim] for part in parts)
    if fused.setdefault(origin, sizes) != sizes:
        raise Conflict(state.origins, f"{node.name} splits {origin}'s output differently from an earlier split")


def _linear_state(info: LinearInfo, shapes: NodeShapes, states: dict[fx.Node, Shard],
                  rows: dict[fx.Node, frozenset[str]], columns: dict[str, LinearInfo],
                  replicated: Mapping[str, str]) -> None:
    source = input_of(info)
    state = states.get(source)
    if state is None:
        if info.node.name not in replicated:
            columns[info.node.name] = info
            states[info.node] = Shard(len(shapes.get(info.node)) - 1, info.out_features,
                                      frozenset({info.node.name}))
        return
    if state.dim != len(shapes.get(source)) - 1 or state.extent != info.in_features:
        raise Conflict(state.origins, f"{info.node.name} multiplies a value split along a dim it does not contract")
    rows[info.node] = state.origins


def _check_output(node: fx.Node, states: Mapping[fx.Node, Shard]) -> None:
    reaching = [arg for arg in node.all_input_nodes if arg in states]
    if reaching:
        origins = frozenset().union(*(states[arg].origins for arg in reaching))
        raise Conflict(origins, f"its split output reaches the graph output through {reaching[0].name}")


def find_tensor_parallel(gm: fx.GraphModule, example_inputs: Any = None) -> TensorParallelAnalysis:
    """Find the column / row linear pairs, vocabulary-parallel ends and sequence-parallel nodes of ``gm``.

    Pure: ``gm`` is not changed. Shapes come from the cost annotation, torch.export's ``val`` meta, or a
    fake run on ``example_inputs`` (default: the traced example inputs).
    """
    shapes = node_shapes(gm, example_inputs)
    full = split_states(gm, shapes)
    regions = _regions(gm, full, shapes)
    vocab = vocab_parallel_ends(gm, full, shapes)
    sequence = _sequence_nodes(gm, full, shapes, vocab)
    kept = {name: why for name, why in full.replicated.items() if name not in {v.node for v in vocab}}
    return TensorParallelAnalysis(regions=regions, vocab=vocab, sequence_nodes=sequence,
                                  replicated=tuple(sorted(kept.items())))


def _regions(gm: fx.GraphModule, full: SplitStates, shapes: NodeShapes) -> tuple[ParallelRegion, ...]:
    """Group the split nodes into pairs (columns joined by shared nodes) and find each pair's divisors."""
    groups = column_groups(full)
    without = split_states(gm, shapes, keep_whole=full.expand_origins) if full.expand_origins else full
    result = []
    for columns in groups:
        nodes = [node for node, state in full.states.items() if state.origins <= columns
                 and node.name not in columns]
        rows = [node.name for node, origins in full.rows.items() if origins <= columns]
        divisor = math.gcd(*(state.extent for node, state in full.states.items() if state.origins <= columns))
        replicable = sorted(columns & full.expand_origins) if columns - full.expand_origins else []
        divisor_replicated, whole = divisor, []
        if replicable:
            whole = [node.name for node, state in full.states.items() if state.origins <= set(replicable)]
            kept_columns = columns - set(replicable)
            if kept_columns & without.replicated.keys():
                replicable, whole = [], []  # the pair does not hold together with the kv columns whole
            else:
                divisor_replicated = math.gcd(*(state.extent for state in without.states.values()
                                                if state.origins <= kept_columns))
        result.append(ParallelRegion(
            columns=tuple(name for name in full.columns if name in columns), rows=tuple(rows),
            nodes=tuple(node.name for node in nodes),
            fused=tuple((name, full.fused[name]) for name in full.columns if name in columns and name in full.fused),
            replicable=tuple(replicable), divisor=divisor, divisor_replicated=divisor_replicated,
            replicable_nodes=tuple(whole)))
    return tuple(result)


def column_groups(full: SplitStates) -> list[set[str]]:
    """Columns that meet in some node (q, k, v at attention; gate and up at their product), in graph order."""
    parent = {name: name for name in full.columns}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for origins in [*(state.origins for state in full.states.values()), *full.rows.values()]:
        first, *rest = sorted(origins)
        for other in rest:
            parent[root(other)] = root(first)
    groups: dict[str, set[str]] = {}
    for name in full.columns:
        groups.setdefault(root(name), set()).add(name)
    closed = {origin for origins in full.rows.values() for origin in origins}
    return [group for group in groups.values() if group <= closed]


def vocab_parallel_ends(gm: fx.GraphModule, full: SplitStates, shapes: NodeShapes) -> tuple[VocabParallel, ...]:
    """Embeddings with a parameter table, and whole linears whose output reaches the graph output unchanged."""
    names: Mapping[str, str] = gm.meta.get(meta.PARAM_NAMES, {})
    found = []
    for node in gm.graph.nodes:
        name = op_name(gm, node)
        if name == "embedding":
            path = _embedding_weight(node)
            if path is not None and _reads_graph_input(node, shapes) and _plain_lookup(gm, node):
                rows = int(gm.get_parameter(path).shape[0])
                found.append(VocabParallel(node.name, "embedding", names.get(path, path), rows, path))
            continue
        info = linear_info(gm, node, name)
        if info is not None and node.name in full.replicated and _reaches_output(gm, node):
            found.append(VocabParallel(node.name, "head", names.get(info.weight, info.weight), info.out_features,
                                       info.weight))
    return tuple(found)


def _reads_graph_input(node: fx.Node, shapes: NodeShapes) -> bool:
    """Whether the looked-up ids are data from a graph input (token ids), not positions built from its size."""
    pending, seen = [node], {node}
    while pending:
        for arg in pending.pop().all_input_nodes:
            if arg.op == "placeholder":
                return True
            if arg not in seen and arg.op != "get_attr" and shapes.find(arg) is not None:
                seen.add(arg)
                pending.append(arg)
    return False


def _plain_lookup(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A lookup without padding row, norm clipping or sparse gradients (what vocab_embedding computes)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return all(_unset(getattr(module, name, None)) for name in ("padding_idx", "max_norm", "sparse"))
    if node.target is torch.nn.functional.embedding:
        return all(_unset(node.kwargs.get(name)) for name in ("padding_idx", "max_norm", "sparse")) \
            and len(node.args) <= 2
    return bool(len(node.args) <= 2 or node.args[2] == -1 and not any(node.args[3:]))  # aten: padding_idx -1: none


def _unset(value: object) -> bool:
    return value is None or value is False  # not `in (None, False)`: padding_idx 0 == False


def embedding_ids(node: fx.Node) -> fx.Node:
    """The ids an embedding looks up (``nn.Embedding(ids)``, ``F.embedding(ids, w)``, ``aten.embedding(w, ids)``)."""
    ids = next(arg for arg in node.args[:2] if isinstance(arg, fx.Node) and arg.op != "get_attr")
    assert isinstance(ids, fx.Node)
    return ids


def _embedding_weight(node: fx.Node) -> str | None:
    if node.op == "call_module":
        return f"{node.target}.weight"
    for arg in node.args[:2]:  # aten.embedding(weight, ids); F.embedding(ids, weight)
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            return str(arg.target)
    return None


def _reaches_output(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether every use of ``node`` leads to the graph output through views, slices and casts only."""
    pending, seen = [node], set()
    while pending:
        current = pending.pop()
        for user in current.users:
            if user.op == "output":
                continue
            if user in seen or op_name(gm, user) not in _HEAD_PATH_OPS:
                return False
            seen.add(user)
            pending.append(user)
    return True


_SEQUENCE_OPS = ELEMENTWISE | {"norm", "layer_norm", "native_layer_norm", "rms_norm", "mean", "unary"}


def _sequence_nodes(gm: fx.GraphModule, full: SplitStates, shapes: NodeShapes,
                    vocab: tuple[VocabParallel, ...]) -> tuple[str, ...]:
    """Whole nodes on the token rows (the rows of a column's input or a row's output): under sequence
    parallelism each member runs them on its share of the tokens."""
    token_rows = {math.prod(shapes.get(input_of(info))[:-1]) for info in full.columns.values()}
    token_rows |= {math.prod(shapes.get(node)[:-1]) for node in full.rows}
    widths = {1} | {info.in_features for info in full.columns.values()}
    vocab_nodes = {v.node for v in vocab}
    found = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or node in full.states \
                or node in full.rows or node.name in vocab_nodes or node.name in full.replicated:
            continue
        shape = shapes.find(node)
        if shape is None or len(shape) < 2 or not isinstance(shape[0], int):
            continue
        if math.prod(shape[:-1]) in token_rows and shape[-1] in widths and op_name(gm, node) in _SEQUENCE_OPS:
            found.append(node.name)
    return tuple(found)
