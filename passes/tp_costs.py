"""Per-node tensor-parallel figures for the cost graph: which share of each node's time, weights and saved bytes splits."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from torch import fx

from fxpipe.core import meta
from fxpipe.core.costgraph import ZERO, Affine
from fxpipe.passes.tensor_parallel import (
    MAX_GROUP_SIZE,
    ParallelRegion,
    TensorParallelAnalysis,
    find_tensor_parallel,
)
from fxpipe.passes.tp_rules import SIZE_READS, linear_info, op_name

__all__ = ["NodeTensorParallel", "annotate_tensor_parallel", "chosen_divisor", "loss_fields", "tensor_parallel_fields"]


@dataclass(frozen=True)
class NodeTensorParallel:
    """What a T-way group does with one node: ``role`` (``column``, ``row``, ``split``, ``parameter``,
    ``vocab-embedding``, ``vocab-head``, ``sequence``), the share of its time and saved bytes that divides by T,
    the bytes of the split parameters it reads, where its collective point lies (``"input"`` / ``"output"`` / ``""``)
    and the number T must divide (0: none). ``sequence_saved_share``: the part of ``saved_share`` that divides only
    under sequence parallelism (a column linear saving its input's token share); ``regather``: the node's input is
    gathered again in backward then (the first column reading it carries it)."""

    role: str
    time_share: float = 0.0
    param_bytes: int = 0
    saved_share: float = 0.0
    comm: str = ""
    divisor: int = 0
    sequence_saved_share: float = 0.0
    regather: bool = False


def chosen_divisor(region: ParallelRegion) -> tuple[int, bool]:
    """The pair's divisor in the costs and whether its GQA kv columns count as split: they do when every group
    size up to MAX_GROUP_SIZE that splits the other heads splits the kv heads too."""
    if not region.replicable or math.gcd(region.divisor, MAX_GROUP_SIZE) == \
            math.gcd(region.divisor_replicated, MAX_GROUP_SIZE):
        return region.divisor, True
    return region.divisor_replicated, False


def _parameter_bytes(gm: fx.GraphModule, path: str | None) -> int:
    if path is None:
        return 0
    parameter = gm.get_parameter(path)
    return parameter.numel() * parameter.element_size()


def annotate_tensor_parallel(gm: fx.GraphModule, example_inputs: Any = None) -> TensorParallelAnalysis:
    """Write :data:`meta.TENSOR_PARALLEL` on the nodes of ``gm`` that split (in place: annotate_costs calls it on
    its own copy); returns the analysis."""
    analysis = find_tensor_parallel(gm, example_inputs)
    nodes = {node.name: node for node in gm.graph.nodes}
    figures: dict[str, NodeTensorParallel] = {}
    split_params: dict[str, tuple[int, int]] = {}  # attribute path -> (bytes that split, the reader's divisor)
    divisors = []
    for region in analysis.regions:
        divisor, kv_split = chosen_divisor(region)
        divisors.append(divisor)
        whole = set() if kv_split else set(region.replicable_nodes)
        for name in region.columns + region.rows:
            if name in whole:
                continue
            info = linear_info(gm, nodes[name], op_name(gm, nodes[name]))
            assert info is not None, name
            is_column = name in region.columns
            bias = _parameter_bytes(gm, info.bias) if is_column else 0
            split_params[info.weight] = (_parameter_bytes(gm, info.weight), divisor)
            if is_column and info.bias is not None:
                split_params[info.bias] = (bias, divisor)
            # a linear saves its input for backward: whole on every member into a column-parallel one (the
            # gathered input under sequence parallelism too), this member's channels into a row-parallel one
            figures[name] = NodeTensorParallel("column" if is_column else "row", 1.0,
                                               _parameter_bytes(gm, info.weight) + bias, 0.0 if is_column else 1.0,
                                               "" if is_column else "output", divisor)
        for name in region.nodes:
            if name not in whole:
                figures[name] = NodeTensorParallel("split", 1.0, 0, 1.0, "", divisor)
    model_divisor = math.gcd(*divisors, MAX_GROUP_SIZE) if divisors else 0
    for vocab in analysis.vocab:
        if model_divisor and vocab.vocab_size % model_divisor == 0:
            path = _vocab_weight_path(gm, nodes[vocab.node])
            split_params[path] = (_parameter_bytes(gm, path), vocab.vocab_size)
            comm = "output" if vocab.kind == "embedding" else "input"
            # the embedding saves the token ids, the head its whole input: neither splits
            figures[vocab.node] = NodeTensorParallel(f"vocab-{vocab.kind}", 1.0, split_params[path][0], 0.0, comm,
                                                     vocab.vocab_size)
    if figures:
        for name in analysis.sequence_nodes:
            figures.setdefault(name, NodeTensorParallel("sequence", 1.0, 0, 1.0))
        _token_share_inputs(gm, figures, set(analysis.sequence_nodes))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in split_params:
            num_bytes, divisor = split_params[str(node.target)]
            figures[node.name] = NodeTensorParallel("parameter", 0.0, num_bytes, 0.0, "", divisor)
        if node.name in figures:
            node.meta[meta.TENSOR_PARALLEL] = figures[node.name]
    return analysis


def _token_share_inputs(gm: fx.GraphModule, figures: dict[str, NodeTensorParallel], sequence: set[str]) -> None:
    """Under sequence parallelism a token-row input read only by split column linears (and the vocabulary head)
    is saved as each member's token share and gathered again in backward (fxpipe.passes.tp_sequence_columns):
    those linears' saved bytes divide by T then, and the first of them carries the input's second gather."""
    readers = ("column", "vocab-head")
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.name not in sequence:
            continue
        users = [user for user in node.users if op_name(gm, user) not in SIZE_READS]  # shape reads read the share
        if not users or not all(
                getattr(figures.get(user.name), "role", "") in readers and _activation(user) is node for user in users):
            continue
        first = min(users, key=order.__getitem__)
        for user in users:
            figures[user.name] = replace(figures[user.name], saved_share=1.0, sequence_saved_share=1.0,
                                         regather=user is first)


def _activation(node: fx.Node) -> fx.Node:
    return node.all_input_nodes[0 if node.op == "call_module" else _activation_index(node)]


def _vocab_weight_path(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return f"{node.target}.weight"
    info = linear_info(gm, node, op_name(gm, node))
    if info is not None:
        return info.weight
    weight = next(arg for arg in node.args[:2] if isinstance(arg, fx.Node) and arg.op == "get_attr")
    return str(weight.target)


def tensor_parallel_fields(node: fx.Node, param_bytes: int, output_bytes: Affine,
                           input_bytes: Callable[[fx.Node], Affine]) -> dict[str, Any]:
    """The ``tp_*`` fields of ``node``'s CostNode from its :data:`meta.TENSOR_PARALLEL` annotation (none: {}).

    ``param_bytes`` is what the node's CostNode counts (its first-use share), so a tied weight splits once.
    """
    figure: NodeTensorParallel | None = node.meta.get(meta.TENSOR_PARALLEL)
    if figure is None:
        return {}
    comm = ZERO
    if figure.comm == "output":
        comm = output_bytes
    elif figure.comm == "input":
        comm = input_bytes(_activation(node))
    return {"tp_time_share": figure.time_share, "tp_param_bytes": min(figure.param_bytes, param_bytes),
            "tp_saved_share": figure.saved_share, "tp_comm_bytes": comm, "tp_divisor": figure.divisor,
            "tp_sequence": figure.role == "sequence", "tp_sequence_saved_share": figure.sequence_saved_share,
            "tp_regather_bytes": input_bytes(_activation(node)) if figure.regather else ZERO}


def _activation_index(node: fx.Node) -> int:
    """Among a linear call's input nodes, the activation's position (the first non-parameter one)."""
    return next(index for index, arg in enumerate(node.all_input_nodes) if arg.op != "get_attr")


def loss_fields(gm: fx.GraphModule) -> dict[str, Any]:
    """The loss's ``tp_*`` fields: a cross-entropy on vocabulary-split logits runs split too."""
    split_head = any(getattr(node.meta.get(meta.TENSOR_PARALLEL), "role", "") == "vocab-head"
                     for node in gm.graph.nodes)
    return {"tp_time_share": 1.0, "tp_saved_share": 1.0} if split_head else {}
