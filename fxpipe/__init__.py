"""fxpipe: automatic hybrid pipeline + data parallel training (DAPPLE) for PyTorch, planned from torch.fx."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names resolve lazily so `import fxpipe` stays cheap (it loads no torch) and planning code
# never pulls in torch.distributed (only fxpipe.runtime imports it).
_EXPORTS: dict[str, tuple[str, str]] = {
    "compile": ("fxpipe.api", "compile"),
    "PipelinedModule": ("fxpipe.api", "PipelinedModule"),
    "plan": ("fxpipe.planning", "plan_model"),
    "Plan": ("fxpipe.core.plan", "Plan"),
    "StagePlan": ("fxpipe.core.plan", "StagePlan"),
    "Cluster": ("fxpipe.core.cluster", "Cluster"),
    "DeviceSpec": ("fxpipe.core.hardware", "DeviceSpec"),
    "simulate": ("fxpipe.sim.simulate", "simulate"),
    "consolidate": ("fxpipe.runtime.checkpoint_io", "consolidate"),
    "latest_checkpoint": ("fxpipe.core.checkpoint", "latest_checkpoint"),
    "handle_preemption": ("fxpipe.runtime.faults.preemption", "install"),
    "gather_rows": ("fxpipe.runtime.transport.rows", "gather_rows"),
}

# Every error and warning a user can meet (docs/errors.md has a row for each; tests/test_docs_examples.py
# checks both ways). Internal ones, always converted before they reach the caller, are not here.
_ERRORS: dict[str, str] = {
    "ChainError": "fxpipe.core.chain",
    "CheckpointError": "fxpipe.core.checkpoint",
    "ClusterSpecError": "fxpipe.core.cluster_spec",
    "CostGraphError": "fxpipe.core.costgraph",
    "PlanError": "fxpipe.core.plan",
    "PrecisionError": "fxpipe.core.precision",
    "RecomputeError": "fxpipe.core.recompute",
    "ScheduleError": "fxpipe.core.schedule",
    "ShardingError": "fxpipe.core.sharding",
    "MissingPlotExtraError": "fxpipe.sim.timeline_plot",
    "CommandLineError": "fxpipe.cli",
    "DataError": "fxpipe.data",
    "ModelSpecError": "fxpipe.planning",
    "UnknownModelError": "fxpipe.models.registry",
    "CallableSpecError": "fxpipe.models.registry",
    "AutocastPolicyError": "fxpipe.passes.autocast_policy",
    "BatchDimError": "fxpipe.passes.batchdims",
    "CodegenError": "fxpipe.passes.codegen",
    "CostAnnotationError": "fxpipe.passes.costs",
    "ExampleInputsTypeError": "fxpipe.passes.trace_inputs",
    "MarkerError": "fxpipe.passes.markers",
    "PlanningError": "fxpipe.passes.partition.request",
    "InfeasiblePlanError": "fxpipe.passes.partition.request",
    "LayoutError": "fxpipe.passes.partition.request",
    "VirtualStagesError": "fxpipe.passes.partition.virtual_request",
    "RecomputeRegionError": "fxpipe.passes.recompute_regions",
    "ProfileError": "fxpipe.passes.profile",
    "ProfileFormatError": "fxpipe.passes.profiles_io",
    "ProgramFileError": "fxpipe.passes.codegen_io",
    "StageExportError": "fxpipe.passes.stage_export",
    "StaticBatchWarning": "fxpipe.passes.stage_export",
    "SubgraphError": "fxpipe.passes.subgraph",
    "TraceError": "fxpipe.passes.tracing",
    "PipelineSetupError": "fxpipe.runtime.faults.errors",
    "RemoteSetupError": "fxpipe.runtime.faults.errors",
    "LossReductionError": "fxpipe.runtime.faults.errors",
    "LossFunctionError": "fxpipe.runtime.faults.errors",
    "BatchShapeError": "fxpipe.runtime.faults.errors",
    "CommunicationError": "fxpipe.runtime.faults.errors",
    "MessageLayoutError": "fxpipe.runtime.faults.errors",
    "TrainableSetChangedError": "fxpipe.runtime.faults.errors",
    "GradScalerError": "fxpipe.runtime.grad_scaler",
    "BatchMismatchError": "fxpipe.runtime.transport.batchcheck",
    "ReplicaMismatchError": "fxpipe.runtime.sync",
    "NormTypeError": "fxpipe.runtime.clipping",
    "BatchNormWarning": "fxpipe.runtime.numerics.batchnorm",
    "CompileFallbackWarning": "fxpipe.runtime.compiled_stages",
}
_EXPORTS.update({name: (module, name) for name, module in _ERRORS.items()})

_SUBMODULES = ("data", "models", "passes")  # public modules: fxpipe.data, fxpipe.models, fxpipe.passes

__all__ = [*sorted(_EXPORTS), *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"fxpipe.{name}")
    if name in _EXPORTS:
        module_name, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
