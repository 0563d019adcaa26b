"""fxpipe: automatic hybrid pipeline + data parallel training (DAPPLE) for PyTorch, planned from torch.fx."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public names resolve lazily so `import fxpipe` stays cheap and planning code never pulls in
# torch.distributed (only fxpipe.runtime imports it).
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
}

__all__ = [*sorted(_EXPORTS), "models", "passes"]


def __getattr__(name: str) -> Any:
    if name in ("models", "passes"):
        return importlib.import_module(f"fxpipe.{name}")
    if name in _EXPORTS:
        module_name, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")
