"""fxpipe: automatic hybrid pipeline + data parallel training (DAPPLE) for PyTorch, planned from torch.fx."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

# Public names resolve lazily so `import fxpipe` stays cheap and planning code never pulls in
# torch.distributed (only fxpipe.runtime imports it).
_EXPORTS: dict[str, tuple[str, str]] = {
    "compile": ("fxpipe.api", "compile"),
    "PipelinedModule": ("fxpipe.api", "PipelinedModule"),
    "plan": ("fxpipe.planning", "plan_model"),
    "Plan": ("fxpipe.plan", "Plan"),
    "StagePlan": ("fxpipe.plan", "StagePlan"),
    "Cluster": ("fxpipe.cluster", "Cluster"),
    "DeviceSpec": ("fxpipe.hardware", "DeviceSpec"),
    "simulate": ("fxpipe.simulate", "simulate"),
    "consolidate": ("fxpipe.checkpoint", "consolidate"),
}

__all__ = [*sorted(_EXPORTS), "models", "passes"]


class _Package(types.ModuleType):
    """``fxpipe.plan`` and ``fxpipe.simulate`` name both a function (the export) and a submodule. Loading a
    submodule binds it on the package, which turned the function into the module after its first import
    (``fxpipe.plan(...)``: "'module' object is not callable"); the submodule stays in ``sys.modules``,
    so ``from fxpipe.plan import Plan`` keeps working while the package attribute stays the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS_OVER_SUBMODULES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


_FUNCTIONS_OVER_SUBMODULES = frozenset({"plan", "simulate"})
sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in ("models", "passes"):
        return importlib.import_module(f"fxpipe.{name}")
    if name in _EXPORTS:
        module_name, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module_name), attribute)
    raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")
