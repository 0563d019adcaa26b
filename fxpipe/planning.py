"""From a model or a profile file to a cost chain and a plan: the compile-time pipeline in one call."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.core import meta
from fxpipe.core.chain import CostChain, build_chain
from fxpipe.core.cluster import Cluster
from fxpipe.core.costgraph import CostGraph, CostNode
from fxpipe.core.plan import Plan
from fxpipe.core.precision import (
    DEFAULT_PRECISION,
    autocast_device_type,
    autocast_dtype_name,
    param_dtype_name,
)
from fxpipe.core.sharding import DEFAULT_SHARDING, ShardingRequest
from fxpipe.core.utilization import peak_flops_per_device
from fxpipe.passes.batchdims import BatchDims
from fxpipe.passes.model_flops import model_flops_per_sample, tokens_per_sample

if TYPE_CHECKING:
    from fxpipe.passes.profile import MeasuredCosts

# What ``costs=`` takes: "auto" measures where the cluster's devices are this machine's (see default_costs).
COST_CHOICES = ("auto", "measured", "analytic")
COSTS_ENV = "FXPIPE_COSTS"


LossFn = Callable[[Any, Any], Any]

# Why `fxpipe plan --layout L` and `fxpipe train --plan L` may cut differently with measured costs: each measures
# the blocks again (plan: in one process; a job: on all its ranks at once), and near-equal cuts swap on noise.
# With the same costs (e.g. --costs analytic) and cluster both choose the same cuts (tests/test_cli_surfaces.py).
REMEASURED_NOTE = {
    "plan": "cuts follow block times measured just now in one process; `fxpipe train --plan LAYOUT` measures "
            "again on its ranks and may cut elsewhere: to train this very plan, write it with --json FILE and "
            "train with --plan FILE",
    "train": "cuts follow block times measured by this launch's ranks; `fxpipe plan` or another launch measures "
             "again and may cut elsewhere: `fxpipe train --json FILE` keeps this plan and --plan FILE runs it again",
}


class ModelSpecError(ValueError):
    """MODEL is neither a zoo name nor a ``package.module:factory`` returning (model, example_inputs)."""


@dataclass(frozen=True)
class CostedModel:
    """A traced model with its cost graph and chain."""

    graph_module: torch.fx.GraphModule
    cost_graph: CostGraph
    chain: CostChain


def load_model(spec: str, *, device: str = "cpu", **overrides: Any) -> tuple[torch.nn.Module, Any]:
    """Build MODEL: a zoo name (``gpt-mini``) or ``package.module:factory`` returning (model, example_inputs).

    A factory's example inputs may be a tensor, a tuple of tensors or a dict of keyword tensors.
    """
    if ":" not in spec:
        from fxpipe import models

        return models.build(spec, device=device, **overrides)
    from fxpipe.models.registry import load_callable

    result = load_callable(spec, "model factory")(**overrides)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        got = (f"a tuple of {[type(item).__name__ for item in result]}" if isinstance(result, tuple)
               else type(result).__name__)
        raise ModelSpecError(f"factory {spec!r} must return (nn.Module, example_inputs), got {got}")
    model, example_inputs = result
    if isinstance(example_inputs, torch.Tensor | list):
        example_inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    if not isinstance(example_inputs, tuple | Mapping):
        raise ModelSpecError(f"factory {spec!r} returned example inputs of type {type(example_inputs).__name__}; "
                             "return a tensor, a tuple of tensors or a dict of keyword tensors")
    if device not in ("cpu", "meta"):  # measuring on a GPU: the factory built on the CPU
        model = model.to(device)
        example_inputs = torch.utils._pytree.tree_map(
            lambda value: value.to(device) if isinstance(value, torch.Tensor) else value, example_inputs)
    return model, example_inputs


def model_loss(spec: str, example_inputs: Any) -> dict[str, Any]:
    """``loss_fn`` and ``example_targets`` for :func:`costed_model`: a zoo model's own loss on targets of its
    data (as many rows as the example inputs); nothing for a ``package.module:factory`` (the estimate)."""
    if ":" in spec:
        return {}
    from fxpipe import models

    entry = models.get(spec)
    first = next(iter(example_inputs.values() if isinstance(example_inputs, Mapping) else example_inputs))
    _, targets = entry.make_batch(int(first.shape[0]), 0)
    return {"loss_fn": entry.loss_fn, "example_targets": targets}


def measuring_device(cluster: Cluster) -> str:
    """Where ``fxpipe plan`` times blocks for ``cluster``: this machine's GPU when the cluster describes its
    GPUs (``local`` on a CUDA machine maps them to a GPU preset), else the CPU."""
    if is_local(cluster) and cluster.device.name != "CPU" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def annotated_model(model: torch.nn.Module, example_inputs: Any, cluster: Cluster, precision: str, *,
                    batch_dims: BatchDims = None, loss_fn: LossFn | None = None, example_targets: Any = None,
                    traced: torch.fx.GraphModule | None = None) -> torch.fx.GraphModule:
    """``model`` traced on ``example_inputs`` (``traced``: already traced, not again) and annotated with its costs
    (:func:`fxpipe.passes.annotate_costs`: the loss costed with ``loss_fn`` on ``example_targets``) under the
    autocast of ``precision``, on the autocast op lists of the cluster's devices."""
    from fxpipe import passes

    return passes.annotate_costs(traced or passes.trace(model, example_inputs, batch_dims=batch_dims),
                                 loss_fn=loss_fn, example_targets=example_targets,
                                 autocast_dtype=autocast_dtype(precision),
                                 autocast_device=autocast_device_type(cluster.device))


def costed_model(
    model: torch.nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    *,
    costs: str = "analytic",
    max_blocks: int | None = 64,
    precision: str = DEFAULT_PRECISION,
    batch_dims: BatchDims = None,
    measured: MeasuredCosts | None = None,
    graph_module: torch.fx.GraphModule | None = None,
    loss_fn: LossFn | None = None,
    example_targets: Any = None,
    traced: torch.fx.GraphModule | None = None,
) -> CostedModel:
    """Trace, annotate and chain a model. ``costs="measured"`` times every block on this machine.

    The loss is costed on the last block: ``loss_fn`` on the output's fakes (``example_targets``, else
    guessed), without one the documented estimate (:mod:`fxpipe.passes.losscost`). A given
    ``graph_module`` carries the loss it was annotated with.

    ``batch_dims``: where each input holds the batch (``fxpipe.passes.trace``; default dim 0).
    ``precision`` (``fxpipe.core.precision``): costs are taken under the autocast it trains in, with the
    autocast op lists of the cluster's devices, measured blocks included. ``measured`` gives block times
    measured already (e.g. agreed by every rank of a job, :func:`fxpipe.block_costs.measure_block_costs`)
    on ``graph_module``, the annotated graph they were measured on; ``"auto"`` resolves with
    :func:`default_costs`. ``traced``: ``model`` already traced on ``example_inputs`` (``fxpipe.passes.trace``,
    as ``fxpipe.compile`` does first), annotated here instead of tracing again.
    """
    from fxpipe import passes

    costs = default_costs(cluster) if costs == "auto" else costs
    if costs not in COST_CHOICES:
        raise ValueError(f"costs={costs!r} is unknown; choose one of {COST_CHOICES}")
    dtype = autocast_dtype(precision)
    if graph_module is None:
        graph_module = annotated_model(model, example_inputs, cluster, precision, batch_dims=batch_dims,
                                       loss_fn=loss_fn, example_targets=example_targets, traced=traced)
    if costs == "measured" and measured is None:
        measured = passes.measure_costs(graph_module, graph_module.meta[meta.EXAMPLE_INPUTS], autocast_dtype=dtype)
    graph = passes.to_cost_graph(graph_module, device=cluster.device, measured=measured if costs == "measured"
                                 else None)
    graph = parameter_reads_at_first_use(graph)
    chain = replace(build_chain(graph, max_blocks=max_blocks), model_flops_per_sample=model_flops_per_sample(
        graph_module), tokens_per_sample=tokens_per_sample(graph_module))
    return CostedModel(graph_module, graph, chain)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The torch dtype ``precision`` trains under with autocast (``torch.bfloat16``), None for fp32."""
    name = autocast_dtype_name(precision)
    return None if name is None else getattr(torch, name)  # type: ignore[no-any-return]


def param_dtype(precision: str) -> torch.dtype | None:
    """The torch dtype of the compute copies ``precision`` keeps of the fp32 masters (bf16-params), else None."""
    name = param_dtype_name(precision)
    return None if name is None else getattr(torch, name)  # type: ignore[no-any-return]


def default_costs(cluster: Cluster, *, devices_here: bool | None = None) -> str:
    """Where ``costs="auto"`` takes block times from: ``$FXPIPE_COSTS`` when set, else ``"measured"`` when
    the cluster's devices are this machine's (``local:N``, the nodes a torchrun job forms), else ``"analytic"``.

    Measuring needs the devices at hand; a preset or remote cluster (``dapple-a``, ``4x8:h100``) gets the
    analytic device model, labelled as such in the plan (``predicted.cost_source``). ``devices_here``
    overrides the guess from the cluster's name (compile knows whether it plans for the launched ranks).
    """
    chosen = os.environ.get(COSTS_ENV, "").strip().lower()
    if chosen:
        if chosen not in ("measured", "analytic"):
            raise ValueError(f"${COSTS_ENV}={chosen!r} is unknown; set it to 'measured' or 'analytic' or unset it")
        return chosen
    here = is_local(cluster) if devices_here is None else devices_here
    return "measured" if here else "analytic"


def is_local(cluster: Cluster) -> bool:
    """Whether the cluster describes this machine's own ranks (``local:N``, ``NxR:local`` under torchrun)."""
    return cluster.name.startswith("local") or cluster.name.endswith(":local")


def labelled(plan: Plan, cost_source: str) -> Plan:
    """``plan`` with ``predicted.cost_source`` set: where the block times behind its figures came from."""
    if plan.predicted is None:
        return plan
    return plan.with_updates(predicted=replace(plan.predicted, cost_source=cost_source))


def parameter_reads_at_first_use(graph: CostGraph) -> CostGraph:
    """Move every ``get_attr`` node to just before its first reader (a valid topological order still).

    torch.export graphs read all parameters at the top. Left there, the chain's first blocks would
    hold every weight and the compute blocks none, so the planner's parameter-holding cuts could not
    split the model; next to their readers, each weight stays on the stage that uses it.
    """
    first_reader: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for name in node.inputs:
            first_reader.setdefault(name, index)
    moved: dict[int, list[CostNode]] = {}
    for node in graph.nodes:
        if node.op.startswith("get_attr") and not node.inputs and node.name in first_reader:
            moved.setdefault(first_reader[node.name], []).append(node)
    if not moved:
        return graph
    moved_names = {node.name for nodes in moved.values() for node in nodes}
    order: list[CostNode] = []
    for index, node in enumerate(graph.nodes):
        order.extend(moved.get(index, ()))
        if node.name not in moved_names:
            order.append(node)
    return replace(graph, nodes=tuple(order))


def profile_chain(path: str, profile_batch_size: int, *, max_blocks: int | None = 64) -> CostChain:
    """Read a PipeDream/DAPPLE profile file into a cost chain."""
    from fxpipe.passes.profiles_io import read_profile

    return build_chain(read_profile(path, profile_batch_size=profile_batch_size), max_blocks=max_blocks)


def cost_source_of(costs: str, cluster: Cluster) -> str:
    """The label a plan's figures carry for a ``costs=`` choice (``"auto"`` resolved for ``cluster``)."""
    return default_costs(cluster) if costs == "auto" else costs


# costs="auto" measures only when the analytic model says measuring takes at most this long on the
# cluster's device (the analytic model is optimistic on CPUs, so the real time is longer).
MEASURING_BUDGET_S = 20.0
# What passes.measure_costs runs: its default warm-up plus timed sweeps, at its two batch sizes.
MEASURING_SWEEPS = 2 + 5
MEASURING_BATCH_SIZES = (2, 8)


def measuring_seconds(chain: CostChain) -> float:
    """The analytic estimate of measuring every block of ``chain`` (forward and backward, each batch size, each sweep)."""
    per_sweep = sum(block.forward_s.at(rows) + block.backward_s.at(rows)
                    for block in chain.blocks for rows in MEASURING_BATCH_SIZES)
    return MEASURING_SWEEPS * per_sweep


def affordable_costs(analytic_chain: CostChain, *, on_meta: bool = False) -> tuple[str, str]:
    """``(source, note)`` for ``costs="auto"`` where measuring is possible in principle: ``"measured"``, or
    ``"analytic"`` with a note saying why when the model is on the meta device or measuring would take
    longer than :data:`MEASURING_BUDGET_S` by the analytic model (a paper-size model on a CPU)."""
    if on_meta:
        return "analytic", "costs=auto: the model is on the meta device, so its blocks were not measured (analytic costs)"
    seconds = measuring_seconds(analytic_chain)
    if seconds <= MEASURING_BUDGET_S:
        return "measured", ""
    return "analytic", (f"costs=auto: measuring every block here would take about {seconds:.0f} s by the analytic "
                        f"model (over the {MEASURING_BUDGET_S:.0f} s budget), so the analytic model was used; "
                        "costs='measured' (--costs measured) measures anyway")


def plan_chain(chain: CostChain, cluster: Cluster, global_batch_size: int, *,
               precision: str = DEFAULT_PRECISION, sharding: ShardingRequest = DEFAULT_SHARDING,
               sequence_parallel: bool = False, **options: Any) -> Plan:
    """Run a planner (``planner=`` name, default DAPPLE) over a chain costed for ``precision`` (recorded in the plan).

    ``sharding``: ``"none"``, ``"auto"``, one level or one per stage (:mod:`fxpipe.core.sharding`); the
    plan records each stage's level (``stages[*].sharding``; docs/sharding.md). A plan whose prediction leaves
    out fixed costs that would dominate it says so in its notes (:func:`fxpipe.sim.fixed_costs.fixed_cost_note`).
    ``sequence_parallel``: tensor-parallel stages are costed as they run with ``fxpipe.compile``'s option of that
    name: without it (the default) their norms, dropout and residual adds run whole on every group member
    (:func:`fxpipe.core.chain.without_sequence_parallel`); the plan records it (``Plan.sequence_parallel``).
    """
    from fxpipe.core.chain import without_sequence_parallel
    from fxpipe.passes.partition.dapple import partition
    from fxpipe.sim.fixed_costs import fixed_cost_note
    from fxpipe.sim.sharding_memory import chain_in_precision

    chain = chain_in_precision(chain, precision)  # bf16-params: compute copies in memory, bf16 all-gathers
    chain = chain if sequence_parallel else without_sequence_parallel(chain)
    plan = partition(chain, cluster, global_batch_size, sharding=sharding, **options)
    note = fixed_cost_note(plan, chain, cluster)  # a lower bound when uncounted fixed costs would dominate
    plan = plan.with_updates(notes=(*plan.notes, note)) if note else plan
    plan = with_model_flops(plan, chain, cluster, precision)
    plan = plan.with_updates(sequence_parallel=True) if sequence_parallel else plan
    return plan if precision == DEFAULT_PRECISION else plan.with_updates(precision=precision)


def with_model_flops(plan: Plan, chain: CostChain, cluster: Cluster, precision: str) -> Plan:
    """``plan`` with the chain's model FLOPs and tokens per sample and the device's datasheet peak for
    ``precision`` in its prediction: what MFU and tokens/s per device are computed from
    (:mod:`fxpipe.core.utilization`)."""
    if plan.predicted is None or chain.model_flops_per_sample <= 0:
        return plan
    return plan.with_updates(predicted=replace(
        plan.predicted, model_flops_per_sample=chain.model_flops_per_sample,
        tokens_per_sample=chain.tokens_per_sample, peak_flops_per_device=peak_flops_per_device(cluster.device, precision)))


def plan_model(
    model: torch.nn.Module,
    example_inputs: tuple[Any, ...] | dict[str, Any],
    *,
    cluster: Cluster | str,
    global_batch_size: int,
    costs: str = "auto",
    batch_dims: BatchDims = None,
    loss_fn: LossFn | None = None,
    example_targets: Any = None,
    precision: str = DEFAULT_PRECISION,
    **options: Any,
) -> Plan:
    """``fxpipe.plan``: trace, cost, chain and partition a model for a cluster in one call.

    ``loss_fn`` (and ``example_targets``): the loss the last stage runs, costed with it (else the
    documented estimate, :mod:`fxpipe.passes.losscost`).

    ``costs="auto"``: block times measured here for a local cluster, the analytic model otherwise
    (:func:`default_costs`); the plan says which in ``predicted.cost_source``. ``precision``: what the
    job trains in (``"fp32"``, ``"bf16"``, ``"fp16"``), recorded in the plan. Other ``options`` go to
    :func:`plan_chain` (``sequence_parallel=True`` when the job will compile with it).
    """
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
    from fxpipe.core.cluster import parse_cluster

    resolved = parse_cluster(cluster) if isinstance(cluster, str) else cluster
    source, note = cost_source_of(costs, resolved), ""
    costed = None
    if costs == "auto" and source == "measured":
        costed = costed_model(model, example_inputs, resolved, costs="analytic", batch_dims=batch_dims,
                              loss_fn=loss_fn, example_targets=example_targets, precision=precision)
        on_meta = any(value.is_meta for value in (*model.parameters(), *model.buffers()))
        source, note = affordable_costs(costed.chain, on_meta=on_meta)
    if costed is None or source == "measured":
        costed = costed_model(model, example_inputs, resolved, costs=source, batch_dims=batch_dims,
                              graph_module=None if costed is None else costed.graph_module, loss_fn=loss_fn,
                              example_targets=example_targets, precision=precision)
    plan = labelled(plan_chain(costed.chain, resolved, global_batch_size, precision=precision, **options), source)
    return plan.with_updates(notes=(*plan.notes, note)) if note else plan


def plan_markers(
    model: torch.nn.Module,
    example_inputs: Any,
    cluster: Cluster,
    global_batch_size: int,
    *,
    costs: str = "analytic",
    measured: MeasuredCosts | None = None,
    precision: str = DEFAULT_PRECISION,
    sharding: ShardingRequest = DEFAULT_SHARDING,
    traced: torch.fx.GraphModule | None = None,
    **options: Any,
) -> tuple[Plan, CostChain]:
    """Cut at the model's ``pipe_split()`` markers; DAPPLE picks replica counts, placement, micro-batches and,
    under ``sharding="auto"``, each stage's sharding level (per-stage levels: one per marked stage).

    Returns the plan and the cost chain it is stated in. Every marked stage must hold parameters
    (otherwise the README's ``torch.optim.AdamW(pipe.parameters())`` fails on its ranks): a
    MarkerError names the stage to merge. ``batch_dims=`` among ``options`` goes to ``trace``,
    ``precision`` to :func:`costed_model`, ``sequence_parallel`` as in :func:`plan_chain`. ``traced``: the model
    already traced on ``example_inputs`` (as :func:`costed_model` takes it).
    """
    from fxpipe import passes
    from fxpipe.core.chain import without_sequence_parallel
    from fxpipe.passes.markers import MarkerError, marker_stages, marker_stops
    from fxpipe.passes.partition.block_partition import coarsen_chain, holds_parameters
    from fxpipe.passes.partition.dapple import on_fine_chain, partition

    batch_dims: BatchDims = options.pop("batch_dims", None)  # trace's, not the planner's
    loss_fn: LossFn | None = options.pop("loss_fn", None)  # the cost pass's
    sequence_parallel: bool = options.pop("sequence_parallel", False)
    graph_module = traced or passes.trace(model, example_inputs, batch_dims=batch_dims)
    groups = marker_stages(model, example_inputs, graph_module)
    chain = costed_model(model, example_inputs, cluster, costs=costs, max_blocks=None, batch_dims=batch_dims,
                         measured=measured, loss_fn=loss_fn, precision=precision, traced=graph_module).chain
    chain = chain if sequence_parallel else without_sequence_parallel(chain)
    stops = marker_stops(chain, groups)
    marked = coarsen_chain(chain, stops)
    empty = [index for index, holds in enumerate(holds_parameters(marked)) if not holds]
    if empty:
        raise MarkerError(f"pipe_split() markers give stage(s) {empty} no parameters, so their ranks would have "
                          "nothing to optimise; remove the marker before or after each such stage")
    plan = partition(marked, cluster, global_batch_size, num_stages=len(stops), sharding=sharding, **options)
    plan = on_fine_chain(plan, chain, stops).with_updates(planner="markers", precision=precision,
                                                          sequence_parallel=sequence_parallel)
    plan = with_model_flops(plan, chain, cluster, precision)
    return labelled(plan, cost_source_of(costs, cluster)), chain
