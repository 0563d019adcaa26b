"""The block times ``fxpipe.compile`` plans with: measured by every launched rank at once, or the analytic model."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.core import meta
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan
from fxpipe.planning import COST_CHOICES, default_costs, is_local, labelled
from fxpipe.runtime.errors import PipelineSetupError

if TYPE_CHECKING:
    from fxpipe.passes.batchdims import BatchDims
    from fxpipe.passes.profile import MeasuredCosts
    from fxpipe.runtime.guard import SetupGroup

# The plan note that records how measured figures were taken (benchmarks/prediction_fidelity.py reads it).
STRETCH_NOTE = "block costs measured by every rank at once: CPU work x {stretch:.3f} wall/CPU seconds"


@dataclass(frozen=True)
class JobCosts:
    """The block times compile plans with: their source and, when measured, the agreed figures and their graph."""

    source: str
    measured: MeasuredCosts | None = None
    graph_module: torch.fx.GraphModule | None = None

    def planning_cluster(self, cluster: Cluster) -> Cluster:
        """``cluster`` with the measured optimizer step (:attr:`Cluster.optimizer_s_per_param_byte`), if any."""
        if self.measured is None:
            return cluster
        return replace(cluster, optimizer_s_per_param_byte=self.measured.optimizer_s_per_param_byte)

    def label(self, plan: Plan) -> Plan:
        """``plan`` with ``predicted.cost_source`` set and, for measured CPU figures, the stretch they include."""
        plan = labelled(plan, self.source)
        if self.measured is None or self.measured.device != "cpu":
            return plan
        return plan.with_updates(notes=(*plan.notes, STRETCH_NOTE.format(stretch=self.measured.stretch)))


def job_costs(costs: str, launched_cluster: bool, model: torch.nn.Module, example_inputs: Any, cluster: Cluster,
              group: SetupGroup, *, batch_dims: BatchDims = None) -> JobCosts:
    """Measure block costs on every rank at once (the median agreed by all) unless analytic costs are asked for.

    A collective: every rank calls it alike. ``costs="auto"`` measures when the cluster is the launched
    devices (``launched_cluster``: the user gave no ``cluster=``, or a local one); ``$FXPIPE_COSTS`` overrides.
    """
    from fxpipe import passes
    from fxpipe.block_costs import measure_block_costs
    from fxpipe.runtime.guard import setup_phase

    if costs not in COST_CHOICES:
        raise PipelineSetupError(f"costs={costs!r} is unknown; choose one of {COST_CHOICES}")
    source = default_costs(cluster, devices_here=launched_cluster or is_local(cluster)) if costs == "auto" else costs
    if source == "analytic":
        return JobCosts("analytic")
    with setup_phase("tracing for cost measurement", group):
        graph_module = passes.annotate_costs(passes.trace(model, example_inputs, batch_dims=batch_dims))
    measured = measure_block_costs(graph_module, graph_module.meta[meta.EXAMPLE_INPUTS],
                                   slowdown=cluster.compute_slowdown, group=group)
    return JobCosts("measured", measured, graph_module) if measured is not None else JobCosts("analytic")
