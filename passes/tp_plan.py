"""What one T-way stage splits: the column/row pairs whose sizes T divides, the kv columns kept whole, the vocabulary ends."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from fxpipe.passes.tensor_parallel import SplitStates, column_groups, split_states
from fxpipe.passes.tp_rules import ELEMENTWISE, Shard, aligned_operand_ok, linear_info, op_name
from fxpipe.passes.tp_shapes import NodeShapes

__all__ = ["StagePlanTP", "plan_stage_split"]

# Ops where a whole operand meeting a split one at full size is sliced locally (each member takes its heads).
_SLICING_OPS = ELEMENTWISE | {"matmul", "bmm", "scaled_dot_product_attention"}


@dataclass
class StagePlanTP:
    """The split states for ``degree`` members, the whole operands each member slices, and the notes."""

    states: SplitStates
    local_slices: dict[fx.Node, list[fx.Node]]  # split node -> whole operands it slices
    notes: list[str]


def _region_divisible(states: SplitStates, columns: set[str], degree: int) -> bool:
    extents = [state.extent for state in states.states.values() if state.origins <= columns]
    parts = [size for name in columns for size in states.fused.get(name, ())]
    return all(extent % degree == 0 for extent in extents + parts)


def plan_stage_split(gm: fx.GraphModule, shapes: NodeShapes, degree: int) -> StagePlanTP:
    """Split every pair whose split sizes ``degree`` divides: first with every column split, then with GQA kv
    columns (those reaching a repeat ``expand``) whole, else the pair stays whole."""
    keep: dict[str, str] = {}
    notes: list[str] = []
    while True:
        states = split_states(gm, shapes, keep)
        changed = False
        for columns in column_groups(states):
            if _region_divisible(states, columns, degree):
                continue
            kv = columns & states.expand_origins
            if kv and kv != columns and not kv & keep.keys():
                keep.update(dict.fromkeys(sorted(kv), f"kv heads not divisible by {degree}: kept whole"))
                notes.append(f"kv projections {sorted(kv)} kept whole: their heads do not split {degree} ways")
            else:
                keep.update(dict.fromkeys(sorted(columns), f"sizes not divisible by {degree}: pair kept whole"))
                notes.append(f"pair {sorted(columns)} kept whole: its sizes do not split {degree} ways")
            changed = True
            break
        if not changed:
            break
    return StagePlanTP(states, _local_slices(gm, states, shapes), notes)


def _local_slices(gm: fx.GraphModule, states: SplitStates, shapes: NodeShapes) -> dict[fx.Node, list[fx.Node]]:
    found: dict[fx.Node, list[fx.Node]] = {}
    for node, state in states.states.items():
        name = op_name(gm, node)
        if name not in _SLICING_OPS or linear_info(gm, node, name) is not None:
            continue
        out_ndim = len(shapes.get(node if name != "scaled_dot_product_attention" else node.all_input_nodes[0]))
        for arg in node.all_input_nodes:
            if arg in states.states or shapes.find(arg) is None or isinstance(shapes.get(arg)[0], tuple):
                continue
            if aligned_operand_ok(shapes.get(arg), out_ndim, Shard(state.dim, state.extent, state.origins)) == "slice":
                found.setdefault(node, []).append(arg)
    return found
