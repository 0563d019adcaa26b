"""Sequence parallelism inside a tensor-parallel stage: which whole nodes run on each member's share of the tokens."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from fxpipe.passes.tp_plan import StagePlanTP
from fxpipe.passes.tp_rules import ELEMENTWISE, input_of, op_name
from fxpipe.passes.tp_shapes import NodeShapes

__all__ = ["SEQUENCE_DIM", "SequenceSplit", "boundary_inputs", "sequence_split"]

SEQUENCE_DIM = 1  # (batch, tokens, channels): the dim split over the group between pairs

_TOKEN_OPS = ELEMENTWISE | {"norm", "layer_norm", "rms_norm", "unary", "mean"}


@dataclass(frozen=True)
class SequenceSplit:
    """``nodes``: whole nodes each member runs on its tokens (norms, dropout, residual adds between pairs);
    ``rows``: row linears whose sum is reduce-scattered over the tokens instead of all-reduced."""

    nodes: frozenset[fx.Node]
    rows: frozenset[fx.Node]
    tokens: int
    widths: frozenset[int] = frozenset()  # the token-row widths: 1 and the column linears' input widths


def sequence_split(gm: fx.GraphModule, plan: StagePlanTP, shapes: NodeShapes, excluded: set[fx.Node],
                   degree: int) -> SequenceSplit:
    """The token-row nodes of ``gm`` (outputs ``(batch, tokens, width)`` with ``width`` a pair's width or 1) that
    are not split, not in ``excluded``; none when the example's token count does not split ``degree`` ways."""
    states = plan.states
    column_inputs = [shapes.get(input_of(info)) for info in states.columns.values()]
    tokens = {shape[SEQUENCE_DIM] for shape in column_inputs if len(shape) == 3}
    widths = {1} | {info.in_features for info in states.columns.values()}
    if len(tokens) != 1 or next(iter(tokens)) % degree:
        return SequenceSplit(frozenset(), frozenset(), 0)
    (count,) = tokens
    rows = frozenset(row for row in states.rows if _token_rows(shapes.find(row), count, widths))
    nodes = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or node in states.states \
                or node in states.rows or node in excluded or node.name in states.columns:
            continue
        name = op_name(gm, node)
        if name in _TOKEN_OPS and _token_rows(shapes.find(node), count, widths) and \
                (name != "mean" or _reduces_last_dim(node)):
            nodes.add(node)
    return SequenceSplit(frozenset(nodes), rows, count, frozenset(widths))


def boundary_inputs(gm: fx.GraphModule, shapes: NodeShapes, split: SequenceSplit,
                    names: frozenset[str]) -> frozenset[fx.Node]:
    """The placeholders named in ``names`` that are token rows, so that they can arrive split over the tokens."""
    if not split.tokens:
        return frozenset()
    return frozenset(node for node in gm.graph.nodes if node.op == "placeholder" and node.name in names
                     and _token_rows(shapes.find(node), split.tokens, set(split.widths)))


def _token_rows(shape: object, tokens: int, widths: set[int]) -> bool:
    return isinstance(shape, tuple) and len(shape) == 3 and isinstance(shape[0], int) \
        and shape[SEQUENCE_DIM] == tokens and shape[-1] in widths


def _reduces_last_dim(node: fx.Node) -> bool:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return isinstance(dims, list | tuple) and list(dims) in ([-1], [2])
