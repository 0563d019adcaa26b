"""The plan ``fxpipe.compile`` runs: a given plan with the user's overrides, or one planned on rank 0 for the launched ranks."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.compile_options import CompileOptions
from fxpipe.core.cluster import Cluster
from fxpipe.core.interleaved_schedules import SPLIT_BACKWARD_SCHEDULES
from fxpipe.core.plan import Plan, plan_argument_kind
from fxpipe.core.precision import PrecisionError, precision_of_dtype
from fxpipe.core.recompute import force_recompute
from fxpipe.core.schedule import ScheduleError, schedule_name
from fxpipe.core.sharding import ShardingError, force_sharding
from fxpipe.runtime.faults.errors import PipelineSetupError

if TYPE_CHECKING:
    from fxpipe.job_costs import JobCosts
    from fxpipe.runtime.calibration.topology import Topology
    from fxpipe.runtime.faults.guard import SetupGroup
    from fxpipe.runtime.transport.comm import DistContext


def resolve_plan(options: CompileOptions, model: torch.nn.Module, example_inputs: Any, context: DistContext,
                 group: SetupGroup = None, traced: torch.fx.GraphModule | None = None) -> Plan:
    """The Plan to run: given, loaded from a file, or made by the planner on rank 0 and broadcast.

    Collective: every rank of ``context``'s group calls it alike; ``group`` carries the setup phases
    (:func:`fxpipe.runtime.faults.guard.setup_group`). ``traced``: ``model`` already traced on ``example_inputs``;
    costing and planning start from it instead of tracing again (an export trace of a Hugging Face model takes
    seconds).
    """
    from fxpipe.runtime.faults.guard import setup_phase

    kind = "plan" if isinstance(options.plan, Plan) else plan_argument_kind(options.plan)
    if kind in ("plan", "file"):
        with setup_phase("loading the plan", group):
            plan = options.plan if isinstance(options.plan, Plan) else Plan.load(options.plan)
            _check_precision(plan, options)
            _check_sequence_parallel(plan, options)
            return apply_overrides(plan, options)
    plan = _planned(options, model, example_inputs, context, group, markers=kind == "markers", traced=traced)
    with setup_phase("applying plan overrides", group):
        return apply_overrides(plan, options)


def apply_overrides(plan: Plan, options: CompileOptions) -> Plan:
    """Check the batch size against the plan and apply schedule / micro-batch / warm-up overrides."""
    if options.global_batch_size is not None and options.global_batch_size != plan.global_batch_size:
        raise PipelineSetupError(f"global_batch_size={options.global_batch_size} but the plan was made for "
                                 f"{plan.global_batch_size}; re-plan or pass the plan's batch size")
    changes: dict[str, Any] = {}
    if options.schedule is not None and _schedule_name(options.schedule) != "auto":  # auto: keep the plan's
        changes["schedule"] = _schedule_name(options.schedule)
    if options.num_microbatches is not None:
        changes["num_microbatches"] = options.num_microbatches
    if options.warmup_policy is not None:
        changes["warmup_policy"] = options.warmup_policy
    plan = force_recompute(plan.with_updates(**changes) if changes else plan, options.recompute)
    if options.sharding is not None:  # None (the default): the plan's own levels
        try:
            plan = force_sharding(plan, options.sharding)
        except ShardingError as error:
            raise PipelineSetupError(str(error)) from None
    check_sharded_schedule(plan)
    return plan


WITHOUT_SPLIT_BACKWARD = ("schedule='dapple' or 'gpipe'", "schedule='interleaved'")  # one stage, virtual stages


def check_sharded_schedule(plan: Plan) -> None:
    """ZeRO-3 under zero-bubble is refused, on every rank alike: a micro-batch's W runs after later forwards,
    which (resharding after forward) would free the weights it needs; keeping them gathered all step would
    save nothing over ZeRO-2 (docs/sharding.md). ZeRO-1/2 run: FSDP2 reduces after W
    (fxpipe.runtime.parallel.sharded_stage.ShardedStage.after_weights)."""
    zero3 = [stage.stage_index for stage in plan.stages if stage.sharding == "parameters"]
    if zero3 and plan.schedule in SPLIT_BACKWARD_SCHEDULES:
        raise PipelineSetupError(
            f"stages {zero3} are sharded with 'parameters' (ZeRO-3) but schedule={plan.schedule!r} runs each "
            "micro-batch's W after later forwards, which free ZeRO-3's gathered weights; use sharding='gradients' "
            f"or 'optimizer' with {plan.schedule}, or "
            f"{WITHOUT_SPLIT_BACKWARD[bool(plan.chunk_groups)]} with 'parameters'")


def training_precision(options: CompileOptions) -> str:
    """The precision ``autocast_dtype`` and ``param_dtype`` train in (``"bf16"`` for torch.bfloat16, ``"fp32"`` for None,
    ``"bf16-params"`` for both torch.bfloat16)."""
    dtype, param_dtype = options.autocast_dtype, options.param_dtype
    try:
        return precision_of_dtype(None if dtype is None else str(dtype).removeprefix("torch."),
                                  None if param_dtype is None else str(param_dtype).removeprefix("torch."))
    except PrecisionError as error:
        raise PipelineSetupError(f"autocast_dtype={dtype}, param_dtype={param_dtype}: {error}") from None


def _check_precision(plan: Plan, options: CompileOptions) -> None:
    """A given plan whose predictions are for another precision still runs (as ``autocast_dtype`` says), with a warning."""
    precision = training_precision(options)
    if plan.precision != precision and plan.predicted is not None:
        warnings.warn(f"fxpipe: the plan was costed for precision {plan.precision!r} but the job trains in "
                      f"{precision!r} (autocast_dtype={options.autocast_dtype}); its predictions are for the "
                      f"former: re-plan with precision {precision!r} (`fxpipe plan --precision {precision}`)",
                      RuntimeWarning, stacklevel=3)


def _check_sequence_parallel(plan: Plan, options: CompileOptions) -> None:
    """A given plan of tensor-parallel stages costed with another ``sequence_parallel`` than the job runs still runs
    exactly, with a warning: its predicted times and memory are for the other way (without sequence parallelism a
    member runs its stage's norms, dropout and residual adds whole, and keeps their saved bytes whole)."""
    if plan.predicted is None or plan.sequence_parallel == options.sequence_parallel:
        return
    if all(stage.tensor_parallel == 1 for stage in plan.stages):
        return
    costed, runs = (("with", "without") if plan.sequence_parallel else ("without", "with"))
    warnings.warn(f"fxpipe: the plan's tensor-parallel stages were costed {costed} sequence parallelism but the job "
                  f"runs {runs} it (sequence_parallel={options.sequence_parallel}); its predicted times and memory are "
                  f"for the former: re-plan with sequence_parallel={options.sequence_parallel} (`fxpipe plan"
                  f"{' --sequence-parallel' if options.sequence_parallel else ''}`)", RuntimeWarning, stacklevel=3)


def _schedule_name(schedule: str) -> str:
    if schedule == "auto":  # the planner picks early backward, zero-bubble or GPipe per plan
        return schedule
    try:
        return schedule_name(schedule)
    except ScheduleError as error:
        raise PipelineSetupError(f"{error}; or 'auto' (the planner picks)") from None


def _planned(options: CompileOptions, model: torch.nn.Module, example_inputs: Any, context: DistContext,
             group: SetupGroup, *, markers: bool = False, traced: torch.fx.GraphModule | None = None) -> Plan:
    """Plan for the launched world on rank 0 and broadcast it: every rank gets a role, plan devices land
    on the ranks of the nodes planned for. The cluster is resolved on every rank first (``local``
    calibrates over the process group, all ranks together), so rank 0 plans with agreed figures."""
    from fxpipe.job_costs import job_costs
    from fxpipe.runtime.calibration.topology import discover_topology
    from fxpipe.runtime.faults.guard import setup_phase
    from fxpipe.runtime.transport.comm import broadcast_text

    check_layout_fits_launch(options.plan, context.world_size)  # alike on every rank, before any measuring
    topology = discover_topology(group)  # collectives of their own, so outside any phase body
    cluster = _resolved_cluster(options, topology, context.device)
    costs = job_costs(options.costs, options.cluster is None, model, example_inputs, cluster, group,
                      batch_dims=options.batch_dims, device=context.device, loss_fn=options.loss_fn,
                      precision=training_precision(options), traced=traced)
    cluster = costs.planning_cluster(cluster)
    text = None
    with setup_phase("planning", group):
        if options.global_batch_size is None:
            raise PipelineSetupError("global_batch_size is missing; it is required unless a Plan is given")
        if context.rank == 0:
            run = _run_marker_planner if markers else _run_planner
            plan = costs.label(run(options, model, example_inputs, topology, cluster, costs, traced))
            text = _with_remeasured_note(plan, costs.source).to_json()
    return Plan.from_json(broadcast_text(text))


def _with_remeasured_note(plan: Plan, source: str) -> Plan:
    """A plan cut on measured block times says that another measurement (``fxpipe plan``) may cut elsewhere."""
    from fxpipe.planning import REMEASURED_NOTE

    return plan.with_updates(notes=(*plan.notes, REMEASURED_NOTE["train"])) if source == "measured" else plan


def check_layout_fits_launch(plan: Any, world_size: int) -> None:
    """A layout such as ``"2:1:1"`` must give every launched rank one replica: checked on every rank alike,
    before planning, in launch terms (LayoutError; a malformed layout is left to the planner's message)."""
    from fxpipe.passes.partition.request import LayoutError

    parts = str(plan).strip().split(":")
    if not all(part.isdecimal() and part.isascii() and int(part) > 0 for part in parts):
        return  # "auto", "markers", "dp" or malformed
    counts = [int(part) for part in parts]
    if sum(counts) == world_size:
        return
    stages = min(len(counts), world_size)
    example = ":".join([str(world_size - stages + 1)] + ["1"] * (stages - 1))
    raise LayoutError(
        f"you launched {world_size} rank{'s' if world_size != 1 else ''}; layout {plan!r} needs {sum(counts)} "
        f"(one rank per replica: {'+'.join(parts)}): launch {sum(counts)} (torchrun --nproc-per-node "
        f"{sum(counts)}, or nodes x processes per node = {sum(counts)}) or use a layout adding up to {world_size} "
        f"(e.g. {example!r}, or 'dp', or 'auto')")


def _resolved_cluster(options: CompileOptions, topology: Topology, device: torch.device) -> Cluster:
    """The cluster to plan for, resolved alike on every rank: the user's, or the launched nodes'."""
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.runtime.calibration.topology import cluster_for

    if isinstance(options.cluster, Cluster):
        return options.cluster
    if options.cluster is not None:
        return parse_cluster(options.cluster, collective=True)
    return cluster_for(topology, device, collective=True)


def _run_planner(options: CompileOptions, model: torch.nn.Module, example_inputs: Any, topology: Topology,
                 cluster: Cluster, costs: JobCosts, traced: torch.fx.GraphModule | None = None) -> Plan:
    """Cost the model and plan it (on rank 0) for ``cluster`` with every launched rank in a role."""
    from fxpipe.planning import costed_model, plan_chain
    from fxpipe.runtime.calibration.topology import check_cluster_size, placed_plan

    check_cluster_size(cluster, topology)
    precision = training_precision(options)
    costed = costed_model(model, example_inputs if isinstance(example_inputs, Mapping) else tuple(example_inputs),
                          cluster, batch_dims=options.batch_dims, costs=costs.source, measured=costs.measured,
                          graph_module=costs.graph_module, loss_fn=options.loss_fn, precision=precision,
                          traced=traced)
    layout = None if options.plan == "auto" else str(options.plan)
    assert options.global_batch_size is not None
    plan = plan_chain(costed.chain, cluster, options.global_batch_size, layout=layout,
                      num_microbatches=options.num_microbatches,
                      schedule=_schedule_name(options.schedule or "dapple"),
                      warmup_policy=options.warmup_policy, optimizer=options.optimizer, all_devices=True,
                      recompute=options.recompute, precision=precision, sharding=options.sharding or "none",
                      virtual_stages=options.virtual_stages, sequence_parallel=options.sequence_parallel)
    return placed_plan(plan, topology, cluster)


def _run_marker_planner(options: CompileOptions, model: torch.nn.Module, example_inputs: Any, topology: Topology,
                        cluster: Cluster, costs: JobCosts, traced: torch.fx.GraphModule | None = None) -> Plan:
    """``plan="markers"``: cuts at the model's pipe_split() calls (on rank 0), every launched rank in a role."""
    from fxpipe.planning import plan_markers
    from fxpipe.runtime.calibration.topology import check_cluster_size, placed_plan

    check_cluster_size(cluster, topology)
    assert options.global_batch_size is not None
    plan, _ = plan_markers(model, example_inputs, cluster, options.global_batch_size, costs=costs.source,
                           measured=costs.measured, num_microbatches=options.num_microbatches,
                           schedule=_schedule_name(options.schedule or "dapple"),
                           warmup_policy=options.warmup_policy, optimizer=options.optimizer, all_devices=True,
                           batch_dims=options.batch_dims, recompute=options.recompute, loss_fn=options.loss_fn,
                           precision=training_precision(options), sharding=options.sharding or "none",
                           virtual_stages=options.virtual_stages, sequence_parallel=options.sequence_parallel,
                           traced=traced)
    return placed_plan(plan, topology, cluster)
