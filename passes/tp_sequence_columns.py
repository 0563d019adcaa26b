"""Sequence-parallel column linears that keep only their input's token share for backward (Megatron-LM's way).

Under sequence parallelism a member's column linears read their input gathered over the tokens
(``gather_sequence``); each linear then saves that gathered input, T times the member's share, for its weight
gradient. :func:`keep_token_shares` replaces a gather whose every reader is such a linear, together with those
linears, by one :func:`fxpipe.passes.tensor_parallel_ops.sequence_columns` call: the same forward (one all-gather,
then the linears), only the share saved, and one more all-gather in backward to get the gathered input back.
"""

from __future__ import annotations

import operator

import torch.nn.functional as F
from torch import fx

from fxpipe.core import meta
from fxpipe.passes import tensor_parallel_ops as ops

__all__ = ["keep_token_shares"]


def keep_token_shares(graph: fx.Graph) -> int:
    """Rewrite ``graph`` (a member's stage graph) in place: each ``gather_sequence`` read only as the input of
    ``F.linear`` calls becomes one ``sequence_columns`` call at the first linear, whose outputs replace the
    linears'. Returns how many gathers were rewritten; a gather with any other reader is left as it is."""
    rewritten = 0
    order = {node: index for index, node in enumerate(graph.nodes)}  # nodes added below are read by nothing here
    for gather in [node for node in graph.nodes if node.op == "call_function" and node.target is ops.gather_sequence]:
        linears = sorted(gather.users, key=order.__getitem__)
        if not linears or not all(_reads_as_input(linear, gather) for linear in linears):
            continue
        x, key, dim = gather.args
        params: list[fx.Node] = []
        biases = []
        for linear in linears:
            weight, bias = _weight_and_bias(linear)
            params += [weight] if bias is None else [weight, bias]
            biases.append(bias is not None)
        first = linears[0]
        with graph.inserting_before(first):
            # get_attr nodes read by later linears come after the first: read them again here
            reads = [graph.get_attr(str(param.target)) if param.op == "get_attr" else param for param in params]
            fused = graph.call_function(ops.sequence_columns, (x, key, dim, tuple(biases), *reads))
        fused.meta[meta.TP_ORIGIN] = first.meta.get(meta.TP_ORIGIN, first.name)
        for index, linear in enumerate(linears):
            with graph.inserting_before(linear):
                output = graph.call_function(operator.getitem, (fused, index))
            output.meta = dict(linear.meta)
            linear.replace_all_uses_with(output)
            graph.erase_node(linear)
        graph.erase_node(gather)
        for param in params:
            if param.op == "get_attr" and not param.users:
                graph.erase_node(param)
        rewritten += 1
    return rewritten


def _reads_as_input(node: fx.Node, gather: fx.Node) -> bool:
    """``node`` is ``F.linear(gather, weight[, bias])`` with ``gather`` as its input only (weight and bias are
    parameters read with get_attr)."""
    if node.op != "call_function" or node.target is not F.linear or node.kwargs or not 2 <= len(node.args) <= 3:
        return False
    return node.args[0] is gather and all(isinstance(param, fx.Node) and param.op == "get_attr"
                                          for param in node.args[1:] if param is not None)


def _weight_and_bias(node: fx.Node) -> tuple[fx.Node, fx.Node | None]:
    weight = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    assert isinstance(weight, fx.Node) and (bias is None or isinstance(bias, fx.Node)), node.format_node()
    return weight, bias
