"""The partition pass = the DAPPLE planner, whole: cost chain + cluster -> Plan, on plain numbers.

Where things are: ``dapple`` (the entry, :func:`partition`), ``search`` and ``polish`` (the cut and
replica search), ``candidates`` and ``scoring`` (scoring a layout), ``latency`` (the pivot model),
``placement`` (devices), ``baselines``/``pipedream``/``block_partition``/``every_device``/``exhaustive``
(the other planners). Stage costs and the exact simulator the planner scores with live in fxpipe.sim.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["partition"]


def __getattr__(name: str) -> Any:
    # Lazy, so importing one planner module (e.g. latency) does not load the whole search.
    if name == "partition":
        return importlib.import_module("fxpipe.passes.partition.dapple").partition
    raise AttributeError(f"module 'fxpipe.passes.partition' has no attribute {name!r}")
