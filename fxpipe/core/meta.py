"""The ``meta["fxpipe.*"]`` keys passes write on GraphModules and nodes, one constant each, with the pass that writes it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import fx

# --- written by `trace` (fxpipe.passes.tracing), on the GraphModule (gm.meta)
FRONTEND = "fxpipe.frontend"  # "fx" or "export": which tracer built the graph (codegen copies it to each stage)
EXAMPLE_INPUTS = "fxpipe.example_inputs"  # tuple of the example inputs, one per placeholder
INPUT_NAMES = "fxpipe.input_names"  # tuple of the placeholder names (the model's input names)
STATE_DICT_NAMES = "fxpipe.state_dict_names"  # {key of the model's state_dict() -> canonical name}
SYMBOLIC_BATCH = "fxpipe.symbolic_batch"  # bool: the export front end kept the batch dimension symbolic
# {input name: dims the export front end fixed at the example's sizes}; absent (fx front end): none fixed
STATIC_INPUT_DIMS = "fxpipe.static_input_dims"
BATCH_DIMS = "fxpipe.batch_dims"  # tuple of each placeholder's batch dim (None: the input is not batched)
BATCH_DIMS_DECLARED = "fxpipe.batch_dims_declared"  # bool: the user passed batch_dims (not the dim-0 default)
# --- written by `trace` on the GraphModule and on each node; codegen writes the GraphModule key per stage
PARAM_NAMES = "fxpipe.param_names"  # gm: {attribute path -> original name}; node: tuple of original names read
# --- written by `trace` on each node (both front ends)
MODULE_PATH = "fxpipe.module_path"  # the original module path that produced the node ("" at top level)

# --- written by `annotate_costs` (fxpipe.passes.costs)
COST = "fxpipe.cost"  # node: its SymbolicCost
BATCH_SYMBOL = "fxpipe.batch_symbol"  # gm: the sympy symbol of the batch size in the costs
COST_MODE = "fxpipe.cost_mode"  # gm: "symbolic", or "affine-fit (...)" when evaluated at two batches and fitted
COST_BATCH_HINT = "fxpipe.cost_batch_hint"  # gm: the example batch size the costs were evaluated at
LOSS_COST = "fxpipe.loss_cost"  # gm: the SymbolicCost of the loss on the model's output (fxpipe.passes.losscost)
LOSS_SOURCE = "fxpipe.loss_source"  # gm: "loss_fn", or "estimate (why)": the documented cross-entropy estimate
INPUT_SAVED_BYTES = "fxpipe.input_saved_bytes"  # gm: bytes of the model's inputs autograd saves (sympy in the batch)
TARGET_SAVED_BYTES = "fxpipe.target_saved_bytes"  # gm: bytes of the targets the loss saves (sympy in the batch)
# node: a passes.tensor_parallel.NodeTensorParallel (role and plain-number figures under a T-way group);
# written by annotate_costs through passes.tp_costs.annotate_tensor_parallel
TENSOR_PARALLEL = "fxpipe.tensor_parallel"
# node of a tensor-parallel member's stage (written by fxpipe.passes.tp_shard.shard_stage): the name of the stage node
# it was rewritten from, on every node the rewrite of that node made (split linears, collectives, renamed ops)
TP_ORIGIN = "fxpipe.tp_origin"
AUTOCAST = "fxpipe.autocast"  # gm: (device type, dtype name) of the autocast the costs ran under, or None

# --- written by codegen (fxpipe.passes.codegen), on each stage's GraphModule
STAGE_INDEX = "fxpipe.stage_index"  # int: which stage the module is


def module_path(node: fx.Node) -> str:
    """The original module path of a node: the tracer's :data:`MODULE_PATH` if present, else torch.fx's module stack."""
    if MODULE_PATH in node.meta:
        return str(node.meta[MODULE_PATH])
    stack = node.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    return str(node.target) if node.op == "call_module" else ""
