"""Model FLOPs per sample as Megatron counts them (3 x the forward matmul FLOPs) and tokens per sample."""

from __future__ import annotations

import sympy
from torch import fx

from fxpipe.core import meta
from fxpipe.passes.costs import BATCH, CostAnnotationError
from fxpipe.passes.fakerun import SymbolicCost

# Integer dtypes of token ids (the first such (batch, seq) input of a language model is its tokens).
_TOKEN_DTYPES = ("int64", "int32")


def model_flops_per_sample(gm: fx.GraphModule) -> float:
    """What one sample costs in model FLOPs: 3 x the forward matmul FLOPs of ``gm``, per batch row.

    Matmul FLOPs are what ``torch.utils.flop_counter`` counts (linear, matmul, bmm, convolution, the attention
    score and value products, causal or not, as full products), in every dtype; the forward counts once and the
    backward twice (input and weight gradients), as Megatron counts model FLOPs: recomputation and elementwise
    work are not counted. For a GPT this is 6N + 12 L h s per token (N: matmul parameters, the output head
    included; L layers, h width, s sequence). ``gm`` must carry ``annotate_costs``' node costs.
    """
    total = sympy.Integer(0)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        cost: SymbolicCost | None = node.meta.get(meta.COST)
        if cost is None:
            raise CostAnnotationError(f"node {node.name!r} has no node.meta[{meta.COST!r}]; "
                                      "run fxpipe.passes.annotate_costs(gm) first")
        total += sum((sympy.sympify(flops) for _, flops in cost.forward_matmul_flops), sympy.Integer(0))
    return 3.0 * _per_row(total, int(gm.meta.get(meta.COST_BATCH_HINT, 2)))


def tokens_per_sample(gm: fx.GraphModule) -> int:
    """Tokens in one sample of a language model: the length of its first integer ``(batch, seq)`` input; 0 when
    no input is token ids (not a language model, or the sequence length depends on the batch)."""
    for node in gm.graph.nodes:
        cost: SymbolicCost | None = node.meta.get(meta.COST)
        if node.op != "placeholder" or cost is None or len(cost.output_shapes) != 1:
            continue
        shape, dtype = cost.output_shapes[0], cost.output_dtypes[0]
        if dtype in _TOKEN_DTYPES and len(shape) == 2 and sympy.sympify(shape[0]) == BATCH:
            length = sympy.sympify(shape[1])
            return int(length) if length.is_Integer else 0
    return 0


def _per_row(expr: sympy.Expr, hint: int) -> float:
    """The per-row part of a count: its slope in the batch (between ``hint`` and ``2 * hint`` rows if not affine)."""
    expr = sympy.expand(expr)
    if BATCH not in expr.free_symbols:
        return 0.0
    low, high = float(expr.subs(BATCH, hint)), float(expr.subs(BATCH, 2 * hint))
    return (high - low) / hint
