"""Cost annotation: run a traced graph node by node on fake tensors with a symbolic batch and record costs."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from fxpipe.core import meta
from fxpipe.core.cluster import DeviceSpec
from fxpipe.core.costgraph import ZERO, Affine, CostGraph, CostNode
from fxpipe.core.precision import matmul_flops_per_s
from fxpipe.passes.autocast_policy import fake_autocast
from fxpipe.passes.batchdims import graph_batch_dims
from fxpipe.passes.fakerun import RunState, SymbolicCost
from fxpipe.passes.flops import NodeRunError, run_fake
from fxpipe.passes.losscost import LOSS_NODE_NAME, LossRun
from fxpipe.passes.tp_costs import annotate_tensor_parallel, loss_fields, tensor_parallel_fields
from fxpipe.passes.trace_inputs import recorded_inputs

if TYPE_CHECKING:
    from fxpipe.passes.profile import MeasuredCosts

__all__ = ["BATCH", "CostAnnotationError", "SymbolicCost", "annotate_costs", "to_cost_graph"]

# The batch size (rows along each tensor input's batch dim, gm.meta["fxpipe.batch_dims"]) in every cost expression.
BATCH = sympy.Symbol("B", integer=True, positive=True)

_MIN_SYMBOLIC_BATCH = 2  # batch 0 and 1 would be specialised by the ShapeEnv


class CostAnnotationError(ValueError):
    """annotate_costs/to_cost_graph was given a graph or inputs it cannot cost."""


def annotate_costs(
    gm: fx.GraphModule, example_inputs: Sequence[Any] | None = None, *, cache: bool = True,
    loss_fn: Callable[[Any, Any], Any] | None = None, example_targets: Any = None,
    autocast_dtype: torch.dtype | None = None, autocast_device: str = "cuda",
) -> fx.GraphModule:
    """Return a copy of ``gm`` whose nodes carry ``node.meta["fxpipe.cost"]`` (a SymbolicCost).

    The graph runs once on fake tensors whose dim 0 is one symbolic batch size, so nothing is
    allocated and the costs are exact expressions in ``BATCH`` (also stored in
    ``gm.meta["fxpipe.batch_symbol"]``). If an op forces a concrete batch, costs are evaluated at
    two batch sizes and fitted as affine expressions; ``gm.meta["fxpipe.cost_mode"]`` says which.
    With ``cache`` (the default) nodes with equal signatures (repeated layers) share one FLOP, byte
    and kernel count; the results equal those of ``cache=False``, which measures every node.

    The loss is costed too (``gm.meta["fxpipe.loss_cost"]``, :mod:`fxpipe.passes.losscost`): ``loss_fn``
    run on the output's fakes (targets from ``example_targets``, batch in dim 0, else guessed), or
    without one the documented estimate; ``gm.meta["fxpipe.loss_source"]`` says which.
    With ``autocast_dtype`` the graph runs under the autocast of ``autocast_device`` (``"cuda"``: CUDA's op
    lists, played on CPU fakes; see ``passes.autocast_policy``), so every value, saved tensor and matmul
    has the dtype training gives it; ``gm.meta["fxpipe.autocast"]`` records ``(device, dtype name)``.
    """
    inputs = recorded_inputs(gm, example_inputs, CostAnnotationError, "annotate_costs")
    result = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    result.meta.update(copy.copy(gm.meta))
    dims = graph_batch_dims(gm, inputs)
    batch = _batch_hint(inputs, dims)
    loss = _LossSpec(loss_fn, example_targets)
    with fake_autocast(autocast_device, autocast_dtype):
        try:
            costs = _run_symbolic(result, inputs, batch, cache, dims, loss)
            mode = "symbolic"
        except _NotSymbolic as error:
            costs = _fit_affine(result, inputs, batch, cache, str(error), dims, loss)
            mode = f"affine-fit (symbolic batch failed: {error})"
    for node in result.graph.nodes:
        if node.name in costs:
            node.meta[meta.COST] = costs[node.name]
    result.meta[meta.LOSS_COST] = costs[_LOSS_KEY]
    result.meta[meta.INPUT_SAVED_BYTES] = costs[_INPUT_SAVED_KEY].saved_bytes
    result.meta[meta.TARGET_SAVED_BYTES] = costs[_TARGET_SAVED_KEY].saved_bytes
    result.meta[meta.LOSS_SOURCE] = loss.source
    result.meta[meta.BATCH_SYMBOL] = BATCH
    result.meta[meta.COST_MODE] = mode
    result.meta[meta.COST_BATCH_HINT] = batch  # the batch the costs were sampled at (for non-affine terms)
    result.meta[meta.AUTOCAST] = (None if autocast_dtype is None
                                  else (autocast_device, str(autocast_dtype).removeprefix("torch.")))
    annotate_tensor_parallel(result, inputs)  # on the copy: which nodes split over a tensor-parallel group
    return result


# Keys of the loss's cost and of the saved model inputs and targets among a run's costs (no fx node name
# has a dot); the latter two are costs whose saved bytes are those figures.
_LOSS_KEY, _INPUT_SAVED_KEY, _TARGET_SAVED_KEY = "fxpipe.loss", "fxpipe.input_saved", "fxpipe.target_saved"


@dataclass
class _LossSpec:
    """What annotate_costs costs the loss with; ``source`` is the last run's (``LossRun.source``)."""

    loss_fn: Callable[[Any, Any], Any] | None
    example_targets: Any
    source: str = ""

    def run(self, batch_size: Any) -> LossRun:
        return LossRun(self.loss_fn, self.example_targets, batch_size)

    def record(self, run: LossRun, costs: dict[str, SymbolicCost]) -> dict[str, SymbolicCost]:
        """``costs`` with the loss's and, as costs whose saved bytes they are, the saved inputs' and targets'."""
        assert run.cost is not None, "run_fake calls the loss run last"
        self.source = run.source
        costs[_LOSS_KEY] = run.cost
        costs[_INPUT_SAVED_KEY] = dataclasses.replace(run.cost, saved_bytes=run.input_saved_bytes)
        costs[_TARGET_SAVED_KEY] = dataclasses.replace(run.cost, saved_bytes=run.target_saved_bytes)
        return costs


class _NotSymbolic(Exception):
    """The symbolic-batch run failed or specialised the batch; fall back to fitting."""


def _batch_hint(inputs: Sequence[Any], dims: Sequence[int | None]) -> int:
    sizes = {int(value.shape[dim]) for value, dim in zip(inputs, dims, strict=True) if dim is not None}
    if len(sizes) > 1:
        raise CostAnnotationError(
            f"tensor inputs disagree on the batch size (batch dims {list(dims)}): {sorted(sizes)}; "
            "every tensor input must hold the batch in its batch dim (dim 0 unless trace(batch_dims=...) says)"
        )
    return max(_MIN_SYMBOLIC_BATCH, *sizes) if sizes else _MIN_SYMBOLIC_BATCH


def _run_symbolic(gm: fx.GraphModule, inputs: Sequence[Any], batch: int, cache: bool,
                  dims: Sequence[int | None], loss: _LossSpec) -> dict[str, SymbolicCost]:
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    symbol = shape_env.create_symbol(batch, ConstantSource("fxpipe_batch"))
    batch_size = shape_env.create_symintnode(symbol, hint=batch)
    specialised_by: list[fx.Node] = []

    def to_expr(value: Any) -> sympy.Expr:
        if isinstance(value, torch.SymInt | torch.SymFloat):
            expr = shape_env.replace(value.node.expr)
            if not expr.free_symbols <= {symbol}:
                raise _NotSymbolic(f"cost expression {expr} depends on symbols other than the batch")
            return sympy.expand(expr.subs(symbol, BATCH))
        return sympy.sympify(value)

    def watch(node: fx.Node) -> None:  # the first node after which the batch is a constant made it one
        if not specialised_by and symbol in shape_env.replacements:
            specialised_by.append(node)

    loss_run = loss.run(batch_size)

    def finish(output: fx.Node, values: dict[str, Any], state: RunState) -> None:
        loss_run(output, values, state)
        watch(output)

    try:
        costs = run_fake(gm, inputs, fake_mode, batch_size, to_expr, cache=cache, after_node=watch, batch_dims=dims,
                         finish=finish)
    except NodeRunError as error:  # an op that cannot take a symbolic batch: fall back, say where in meta
        if isinstance(error.reason, _NotSymbolic):
            raise _NotSymbolic(f"{describe_node(gm, error.node)}: {error.reason}") from error
        raise _NotSymbolic(f"{describe_node(gm, error.node)} failed: {type(error.reason).__name__}: "
                           f"{_first_line(error.reason)}") from error
    if specialised_by:
        raise _NotSymbolic(f"{describe_node(gm, specialised_by[0])} specialised the batch to "
                           f"{shape_env.replacements[symbol]}")
    return loss.record(loss_run, costs)


def describe_node(gm: fx.GraphModule, node: fx.Node) -> str:
    """``node 'view_2' (op view, module transformer.h.0.attn)``: how errors name a graph node."""
    return f"node {node.name!r} (op {_target_name(gm, node)}, module {meta.module_path(node) or '<root>'})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else ""


def _fit_affine(gm: fx.GraphModule, inputs: Sequence[Any], batch: int, cache: bool,
                why: str, dims: Sequence[int | None], loss: _LossSpec) -> dict[str, SymbolicCost]:
    """Cost the graph at batch sizes b and 2b with concrete fakes and join them by a line in BATCH.

    A graph that cannot run at 2b (its views hard-code the example batch) has no line to fit: the
    error names the node that breaks and the one that fixed the batch.
    """
    runs = []
    for rows in (batch, 2 * batch):
        fake_mode = FakeTensorMode()
        loss_run = loss.run(rows)
        try:
            runs.append(loss.record(loss_run, run_fake(gm, inputs, fake_mode, rows, sympy.sympify, cache=cache,
                                                        batch_dims=dims, finish=loss_run)))
        except NodeRunError as error:
            if rows == batch:  # not about the batch at all: the graph fails at its own example
                raise CostAnnotationError(
                    f"cannot cost the graph: {describe_node(gm, error.node)} fails on fake inputs at the example "
                    f"batch {batch} ({type(error.reason).__name__}: {_first_line(error.reason)})"
                ) from error
            raise CostAnnotationError(
                f"cannot cost the graph: the symbolic batch failed ({why}), and at batch {rows} instead of the "
                f"example's {batch} {describe_node(gm, error.node)} fails ({type(error.reason).__name__}: "
                f"{_first_line(error.reason)}), so the graph only runs at the example batch and cannot be split "
                "into micro-batches. Fix: trace with fxpipe.passes.trace (a symbolic batch), and write shapes "
                "from the input (x.view(x.size(0), -1)) instead of fixed numbers"
            ) from error
    return {name: _fit_node(runs[0][name], runs[1][name], batch) for name in runs[0]}


def _fit_node(low: SymbolicCost, high: SymbolicCost, batch: int) -> SymbolicCost:
    def line(a: sympy.Expr, b: sympy.Expr) -> sympy.Expr:
        slope = sympy.Rational(b - a, batch)
        return sympy.expand(a - slope * batch + slope * BATCH)

    fitted: dict[str, Any] = {}
    for name in ("output_bytes", "forward_flops", "backward_flops", "saved_bytes"):
        fitted[name] = line(getattr(low, name), getattr(high, name))
    for name in ("forward_bytes_moved", "backward_bytes_moved"):
        fitted[name] = line(getattr(low, name), getattr(high, name))
    for name in ("forward_matmul_flops", "backward_matmul_flops"):
        high_by_dtype = dict(getattr(high, name))
        fitted[name] = tuple((dtype, line(flops, high_by_dtype.get(dtype, 0))) for dtype, flops in getattr(low, name))
    shapes = tuple(
        tuple(line(a, b) for a, b in zip(shape_low, shape_high, strict=True))
        for shape_low, shape_high in zip(low.output_shapes, high.output_shapes, strict=True)
    )
    low_resaved, high_resaved = _resaved_by_saver(low), _resaved_by_saver(high)
    fitted["resaved"] = tuple((saver, line(low_resaved.get(saver, 0), high_resaved.get(saver, 0)))
                              for saver in dict.fromkeys([*low_resaved, *high_resaved]))
    return SymbolicCost(
        output_shapes=shapes,
        output_dtypes=low.output_dtypes,
        param_bytes=low.param_bytes,
        is_tensor=low.is_tensor,
        num_forward_kernels=low.num_forward_kernels,
        num_backward_kernels=low.num_backward_kernels,
        **fitted,
    )




def _resaved_by_saver(cost: SymbolicCost) -> dict[str, sympy.Expr]:
    """A node's re-saved bytes summed per earlier saver, in first-seen order (what a fit joins)."""
    totals: dict[str, sympy.Expr] = {}
    for saver, num_bytes in cost.resaved:
        totals[saver] = totals.get(saver, sympy.Integer(0)) + num_bytes
    return totals


def to_cost_graph(
    gm: fx.GraphModule,
    *,
    device: DeviceSpec | None = None,
    measured: MeasuredCosts | None = None,
    dtype: str | None = None,
) -> CostGraph:
    """Turn an annotated graph into a CostGraph of plain Affine numbers (per batch row and fixed).

    Times come from ``measured`` (each block's time spread over its nodes in proportion to their
    analytic FLOPs, evenly when a block has none) or else from the roofline model of ``device``:
    ``max(compute_s, bytes_moved / bandwidth) + kernels * kernel_launch_s``, taken separately for the
    fixed and the per-row part. ``compute_s`` runs matmuls, convolutions and attention at the rate of
    the dtype they ran in (tensor-core rates under bf16/fp16 autocast, ``annotate_costs(autocast_dtype=)``)
    and every other FLOP at the float32 rate; ``dtype`` (a peak_flops key) instead runs every FLOP at
    that one rate. Without either, times are zero. Placeholders
    are not nodes: their bytes form ``input_bytes`` and they are dropped from ``inputs``; the
    output node is dropped too; ``get_attr`` nodes stay (zero time, their parameter bytes).
    """
    annotated = _annotated_nodes(gm)
    hint = int(gm.meta.get(meta.COST_BATCH_HINT, _MIN_SYMBOLIC_BATCH))
    input_bytes = Affine.total(
        _affine(node.meta[meta.COST].output_bytes, hint) for node in gm.graph.nodes if node.op == "placeholder"
    )
    times = _measured_times(annotated, measured, hint) if measured is not None else {
        node.name: _roofline(node.meta[meta.COST], device, dtype, hint) for node in annotated
    }
    nodes = tuple(_cost_node(gm, node, times[node.name], hint) for node in annotated)
    return CostGraph(nodes=nodes, source="fx", input_bytes=input_bytes, shared_params=_shared_params(gm, nodes),
                     loss=_loss_node(gm, device, dtype, hint),
                     input_saved_bytes=_affine(gm.meta.get(meta.INPUT_SAVED_BYTES, 0), hint),
                     target_saved_bytes=_affine(gm.meta.get(meta.TARGET_SAVED_BYTES, 0), hint))


def _loss_node(gm: fx.GraphModule, device: DeviceSpec | None, dtype: str | None, hint: int) -> CostNode | None:
    """The loss as a CostNode reading the output's producers; times from the roofline model (measured
    block costs time the model's blocks, not the loss), None when the graph has no loss cost."""
    cost: SymbolicCost | None = gm.meta.get(meta.LOSS_COST)
    if cost is None:
        return None
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    forward, backward = _roofline(cost, device, dtype, hint)
    source = str(gm.meta.get(meta.LOSS_SOURCE, ""))
    return CostNode(
        name=LOSS_NODE_NAME, inputs=tuple(arg.name for arg in output.all_input_nodes if arg.op != "placeholder"),
        forward_s=forward, backward_s=backward, output_bytes=_affine(cost.output_bytes, hint),
        saved_bytes=_affine(cost.saved_bytes, hint), forward_flops=_affine(cost.forward_flops, hint),
        backward_flops=_affine(cost.backward_flops, hint), resaved=_resaved(cost, hint),
        op="loss:loss_fn" if source == "loss_fn" else "loss:estimate", **loss_fields(gm),
    )


def _shared_params(gm: fx.GraphModule, nodes: Sequence[CostNode]) -> tuple[tuple[str, int], ...]:
    """``(original name, bytes)`` of every trainable parameter read by more than one node, by name."""
    renames: Mapping[str, str] = gm.meta.get(meta.PARAM_NAMES, {})
    sizes = {renames.get(path, path): param.numel() * param.element_size()
             for path, param in gm.named_parameters(remove_duplicate=False) if param.requires_grad}
    readers: dict[str, int] = {}
    for node in nodes:
        for name in set(node.param_names):
            readers[name] = readers.get(name, 0) + 1
    return tuple(sorted((name, sizes[name]) for name, count in readers.items() if count > 1 and name in sizes))


def _annotated_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    nodes = [node for node in gm.graph.nodes if node.op not in ("placeholder", "output")]
    missing = [node.name for node in gm.graph.nodes if node.op != "output" and meta.COST not in node.meta]
    if missing:
        raise CostAnnotationError(
            f"nodes {missing[:5]} have no node.meta[{meta.COST!r}]; run fxpipe.passes.annotate_costs(gm) first"
        )
    return nodes


def _affine(expr: sympy.Expr, hint: int) -> Affine:
    """Exact coefficients when ``expr`` is affine in BATCH, else the secant through hint and 2 x hint."""
    expr = sympy.expand(sympy.sympify(expr))
    poly = expr.as_poly(BATCH) if expr.free_symbols else None
    if poly is None or poly.degree() <= 1:
        per_sample = float(sympy.diff(expr, BATCH))
        fixed = float(expr.subs(BATCH, 0))
    else:
        low, high = float(expr.subs(BATCH, hint)), float(expr.subs(BATCH, 2 * hint))
        per_sample = (high - low) / hint
        fixed = low - per_sample * hint
    return Affine(max(fixed, 0.0), max(per_sample, 0.0))  # a fitted line may dip below zero at B=0


def _roofline_time(compute_s: Affine, bytes_moved: Affine, num_kernels: int, device: DeviceSpec) -> Affine:
    bandwidth = device.memory_bandwidth_bytes_per_s
    return Affine(
        max(compute_s.fixed, bytes_moved.fixed / bandwidth) + num_kernels * device.kernel_launch_s,
        max(compute_s.per_sample, bytes_moved.per_sample / bandwidth),
    )


def _compute_s(flops: Affine, matmul_flops: Sequence[tuple[str, sympy.Expr]], device: DeviceSpec,
               dtype: str | None, hint: int) -> Affine:
    """Seconds of arithmetic: ``flops`` at one rate, or matmuls at their dtype's rate and the rest at float32's."""
    fast = [(_affine(part, hint), matmul_flops_per_s(device, name)) for name, part in matmul_flops]
    peak = device.flops_per_s(dtype or "float32")
    if dtype is not None or all(rate == peak for _, rate in fast):
        return Affine(flops.fixed / peak, flops.per_sample / peak)  # one rate (float32 models: as before)
    rest = Affine(flops.fixed - sum(part.fixed for part, _ in fast),
                  flops.per_sample - sum(part.per_sample for part, _ in fast))
    return Affine(max(rest.fixed, 0.0) / peak + sum(part.fixed / rate for part, rate in fast),
                  max(rest.per_sample, 0.0) / peak + sum(part.per_sample / rate for part, rate in fast))


def _roofline(cost: SymbolicCost, device: DeviceSpec | None, dtype: str | None, hint: int) -> tuple[Affine, Affine]:
    if device is None:
        return ZERO, ZERO
    forward = _roofline_time(
        _compute_s(_affine(cost.forward_flops, hint), cost.forward_matmul_flops, device, dtype, hint),
        _affine(cost.forward_bytes_moved, hint), cost.num_forward_kernels, device,
    )
    backward = _roofline_time(
        _compute_s(_affine(cost.backward_flops, hint), cost.backward_matmul_flops, device, dtype, hint),
        _affine(cost.backward_bytes_moved, hint), cost.num_backward_kernels, device,
    )
    return forward, backward


def _measured_times(nodes: Sequence[fx.Node], measured: MeasuredCosts, hint: int) -> dict[str, tuple[Affine, Affine]]:
    by_name = {node.name: node for node in nodes}
    times: dict[str, tuple[Affine, Affine]] = {}
    for block in measured.blocks:
        members = [by_name[name] for name in block.node_names if name in by_name]
        forward = _shares([node.meta[meta.COST].forward_flops for node in members], hint)
        backward = _shares([node.meta[meta.COST].backward_flops for node in members], hint)
        for node, forward_share, backward_share in zip(members, forward, backward, strict=True):
            times[node.name] = (block.forward_s.scaled(forward_share), block.backward_s.scaled(backward_share))
    missing = [node.name for node in nodes if node.name not in times]
    if missing:
        raise CostAnnotationError(
            f"measured costs cover no block holding nodes {missing[:5]}; "
            "profile every node with fxpipe.passes.measure_costs(gm, example_inputs) (default blocks)"
        )
    return times


def _shares(flops: Sequence[sympy.Expr], hint: int) -> list[float]:
    """Each node's fraction of its block's FLOPs at the example batch (even split if the block has none)."""
    values = [float(sympy.sympify(f).subs(BATCH, hint)) for f in flops]
    total = sum(values)
    if total <= 0:
        return [1.0 / len(values)] * len(values) if values else []
    return [value / total for value in values]


def _cost_node(gm: fx.GraphModule, node: fx.Node, times: tuple[Affine, Affine], hint: int) -> CostNode:
    cost: SymbolicCost = node.meta[meta.COST]
    return CostNode(
        name=node.name,
        inputs=tuple(arg.name for arg in node.all_input_nodes if arg.op != "placeholder"),
        forward_s=times[0],
        backward_s=times[1],
        output_bytes=_affine(cost.output_bytes, hint),
        saved_bytes=_affine(cost.saved_bytes, hint),
        resaved=_resaved(cost, hint),
        param_bytes=cost.param_bytes,
        forward_flops=_affine(cost.forward_flops, hint),
        backward_flops=_affine(cost.backward_flops, hint),
        module_path=meta.module_path(node),
        param_names=_param_names(gm, node),
        op=f"{node.op}:{_target_name(gm, node)}",
        tensor_output=cost.is_tensor and rows_follow_batch(cost),
        **tensor_parallel_fields(node, cost.param_bytes, _affine(cost.output_bytes, hint),
                                 lambda source: _affine(source.meta[meta.COST].output_bytes, hint)),
    )


def _resaved(cost: SymbolicCost, hint: int) -> tuple[tuple[str, Affine], ...]:
    """The node's re-saved bytes per earlier saver (:attr:`CostNode.resaved`), as plain numbers."""
    return tuple((saver, _affine(num_bytes, hint)) for saver, num_bytes in _resaved_by_saver(cost).items())


def rows_follow_batch(cost: SymbolicCost) -> bool:
    """Whether every output's rows are the batch rows: dim 0 is the batch, or no dim depends on it.

    A value such as ``(B*T, C)`` (a flatten before a matmul) cannot be split between replicas by
    rows, so the cost graph marks it like a non-tensor: no cut may send it (see CostNode).
    """
    for shape in cost.output_shapes:
        dims = [sympy.sympify(size) for size in shape]
        if any(BATCH in size.free_symbols for size in dims) and sympy.expand(dims[0] - BATCH) != 0:
            return False
    return True


def _param_names(gm: fx.GraphModule, node: fx.Node) -> tuple[str, ...]:
    if meta.PARAM_NAMES in node.meta:
        return tuple(node.meta[meta.PARAM_NAMES])
    renames: Mapping[str, str] = gm.meta.get(meta.PARAM_NAMES, {})
    if node.op == "get_attr":
        paths = [str(node.target)]
    elif node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        paths = [f"{node.target}.{name}" for name, _ in module.named_parameters(remove_duplicate=False)]
    else:
        paths = []
    return tuple(renames.get(path, path) for path in paths)


def _target_name(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    if callable(node.target):
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)
