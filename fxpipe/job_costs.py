"""The block times ``fxpipe.compile`` plans with: measured by every launched rank at once, or the analytic model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.core import meta
from fxpipe.core.cluster import Cluster, LinkSpec
from fxpipe.core.plan import Plan
from fxpipe.core.precision import DEFAULT_PRECISION
from fxpipe.planning import COST_CHOICES, annotated_model, autocast_dtype, default_costs, is_local, labelled
from fxpipe.runtime.faults.errors import PipelineSetupError

if TYPE_CHECKING:
    from fxpipe.passes.batchdims import BatchDims
    from fxpipe.passes.profile import MeasuredCosts
    from fxpipe.runtime.faults.guard import SetupGroup

# The plan note that records how measured figures were taken (benchmarks/prediction_fidelity.py reads it).
STRETCH_NOTE = ("block times measured on every rank at once, CPU time stretched x {stretch:.3f} "
                "(wall seconds per CPU second while the ranks shared the cores)")
COLLECTIVE_NOTE = ("allreduce over the job's {ranks} ranks measured at {latency_ms:.3f} ms per ring step and "
                   "{bandwidth_mb:.0f} MB/s; the planner costed gradient allreduces with these figures")


@dataclass(frozen=True)
class JobCosts:
    """The block times compile plans with: their source and, when measured, the agreed figures and their graph."""

    source: str
    measured: MeasuredCosts | None = None
    graph_module: torch.fx.GraphModule | None = None
    # (ranks, latency s, bandwidth B/s) of an allreduce over all the job's ranks, measured with the blocks
    collective: tuple[int, float, float] | None = None

    def planning_cluster(self, cluster: Cluster) -> Cluster:
        """``cluster`` with the measured optimizer step (:attr:`Cluster.optimizer_s_per_param_byte`) and the
        measured allreduce as its collective link (intra-host on one host, inter-host across several), if any;
        on CPU ranks its calibrated fixed costs (CPU work) times the blocks' stretch over the core sharing."""
        if self.measured is None:
            return cluster
        cluster = replace(cluster, optimizer_s_per_param_byte=self.measured.optimizer_s_per_param_byte)
        if self.measured.device == "cpu":  # calibrated in CPU work, alone: the job's stretch, as on the blocks
            scale = self.measured.stretch / cluster.compute_slowdown
            cluster = replace(cluster, action_overhead_s=cluster.action_overhead_s * scale,
                              step_overhead_s=cluster.step_overhead_s * scale)
        if self.collective is None:
            return cluster
        _, latency_s, bandwidth = self.collective
        link = LinkSpec(bandwidth, latency_s)
        if cluster.num_hosts == 1:
            return replace(cluster, intra_host_collective=link)
        return replace(cluster, inter_host_collective=link)

    def label(self, plan: Plan) -> Plan:
        """``plan`` with ``predicted.cost_source`` set and notes on how the measured figures were taken."""
        plan = labelled(plan, self.source)
        notes = []
        if self.measured is not None and self.measured.device == "cpu":
            notes.append(STRETCH_NOTE.format(stretch=self.measured.stretch))
        if self.measured is not None and self.collective is not None:
            ranks, latency_s, bandwidth = self.collective
            notes.append(COLLECTIVE_NOTE.format(ranks=ranks, latency_ms=latency_s * 1e3, bandwidth_mb=bandwidth / 1e6))
        return plan.with_updates(notes=(*plan.notes, *notes)) if notes else plan


def job_costs(costs: str, launched_cluster: bool, model: torch.nn.Module, example_inputs: Any, cluster: Cluster,
              group: SetupGroup, *, batch_dims: BatchDims = None, device: torch.device | None = None,
              loss_fn: Callable[[Any, Any], Any] | None = None, precision: str = DEFAULT_PRECISION,
              traced: torch.fx.GraphModule | None = None) -> JobCosts:
    """Measure block costs on every rank at once (the median agreed by all) unless analytic costs are asked for.

    A collective: every rank calls it alike. ``costs="auto"`` measures when the cluster is the launched
    devices (``launched_cluster``: the user gave no ``cluster=``, or a local one); ``$FXPIPE_COSTS`` overrides.
    With ``device`` (where the training backend's tensors live) and a cluster of exactly the launched
    ranks, it also times an allreduce over all of them on the default process group
    (:func:`fxpipe.runtime.calibration.calibrate_measure.measure_job_collective`). The traced graph costs the loss with
    ``loss_fn`` (:func:`fxpipe.passes.annotate_costs`); blocks are costed and timed under the autocast of
    ``precision``, on the autocast op lists of the cluster's devices. ``traced``: the model already traced on
    ``example_inputs`` (``fxpipe.compile`` traces first), costed instead of tracing again.
    """
    from fxpipe.block_costs import measure_block_costs
    from fxpipe.runtime.calibration.measure_together import job_collective
    from fxpipe.runtime.faults.guard import setup_phase

    if costs not in COST_CHOICES:
        raise PipelineSetupError(f"costs={costs!r} is unknown; choose one of {COST_CHOICES}")
    source = default_costs(cluster, devices_here=launched_cluster or is_local(cluster)) if costs == "auto" else costs
    if source == "analytic":
        return JobCosts("analytic")
    dtype = autocast_dtype(precision)
    with setup_phase("tracing for cost measurement", group):
        graph_module = annotated_model(model, example_inputs, cluster, precision, batch_dims=batch_dims,
                                       loss_fn=loss_fn, traced=traced)
    measured = measure_block_costs(graph_module, graph_module.meta[meta.EXAMPLE_INPUTS],
                                   slowdown=cluster.compute_slowdown, group=group, autocast_dtype=dtype)
    if measured is None:
        return JobCosts("analytic")
    return JobCosts("measured", measured, graph_module, job_collective(cluster.num_devices, device, group))

