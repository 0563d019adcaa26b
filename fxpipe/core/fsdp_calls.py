"""FSDP2's host time per collective call beyond the collective, per kind and by the unit's bytes (plain numbers).

Around each all-gather FSDP2 allocates the unit's full buffer, copies the gathered shards out into the
parameters and frees them again at reshard; around each reduce-scatter it copies the unit's gradients into a
flat buffer and the result into the shards' ``.grad``, and runs its hooks in Python. On CPU ranks that costs
milliseconds per call and grows with the unit's bytes (benchmarks/sharding_fidelity.md: 3.5-4.3 ms at 16 KiB
units, 5-10 ms at 1 MB), so one figure per call under- or over-charges depending on the units it was timed on.
Legend: for a call of ``kind`` on a unit of ``b`` whole bytes (gathered weights, or gradients reduced)

    seconds(kind, b) = call_s[kind] + per_byte_s[kind] * b
    pass(b)          = pass_s + pass_s_per_byte * b

``pass`` is a unit's forward and backward that makes no collective: ZeRO-1's micro-batches before the step's last
(weights kept gathered, gradients accumulated unsynced). FSDP2 still runs its hooks and accumulates the unit's
unsharded gradients; on CPU ranks about a millisecond per unit (gpt-mini, 2 ranks: ZeRO-1's step minus the
unsharded one grew 31, 40, 55 ms of CPU at 1, 2, 4 micro-batches, 5 units). The reduce-scatter's figure holds one
micro-batch's hooks already (it is timed on units that sync every backward), so ZeRO-1 is charged ``M - 1`` passes.

fitted through two unit sizes by :mod:`fxpipe.runtime.calibration.calibrate_fsdp` and charged per unit by
:func:`fxpipe.sim.sharding_cost.unit_collectives`. A ZeRO-2 reduce-scatter (weights stay gathered: no unshard, no
reshard) and ZeRO-3's calls are timed apart: the all-gather kind carries the unshard and the reshard.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

KINDS = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class FsdpCallCost:
    """Seconds per call and per byte of the unit, for each of FSDP2's two collective kinds (module docstring)."""

    all_gather_s: float = 0.0
    all_gather_s_per_byte: float = 0.0
    reduce_scatter_s: float = 0.0
    reduce_scatter_s_per_byte: float = 0.0
    pass_s: float = 0.0
    pass_s_per_byte: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"FsdpCallCost.{name} must be a finite number >= 0 (seconds); got {value!r}: "
                                 "calibrate again (`fxpipe calibrate`) or fix the cluster file")

    def seconds(self, kind: str, unit_bytes: float) -> float:
        """FSDP2's host time around one ``kind`` call on a unit of ``unit_bytes`` whole bytes."""
        if kind not in KINDS:
            raise ValueError(f"FSDP2 collective kind must be one of {KINDS}; got {kind!r}")
        return getattr(self, f"{kind}_s") + getattr(self, f"{kind}_s_per_byte") * max(0.0, unit_bytes)

    def pass_seconds(self, unit_bytes: float) -> float:
        """FSDP2's host time of one unit's forward and backward without a collective (module docstring: ``pass``)."""
        return self.pass_s + self.pass_s_per_byte * max(0.0, unit_bytes)

    def to_json(self) -> dict[str, float]:
        """The figures by field name (``Cluster.to_json``'s ``fsdp_calls``; read by
        :func:`fxpipe.core.cluster_spec.optional_fsdp_calls`)."""
        return asdict(self)


# calibration's figure names (fxpipe.runtime.calibration.calibrate_fsdp), in FsdpCallCost's field order
FIGURE_KEYS = ("fsdp_all_gather_call", "fsdp_all_gather_per_byte", "fsdp_reduce_scatter_call",
               "fsdp_reduce_scatter_per_byte", "fsdp_pass_call", "fsdp_pass_per_byte")
# the fields a cluster file may leave out (written before the pass was measured): 0
OPTIONAL_FIELDS = ("pass_s", "pass_s_per_byte")


def fsdp_calls_from_figures(figures: dict[str, float]) -> FsdpCallCost | None:
    """The fit from calibrated link figures; None where they were not measured (GPUs, caches written before)."""
    if not all(key in figures for key in FIGURE_KEYS):
        return None
    return FsdpCallCost(*(max(0.0, figures[key]) for key in FIGURE_KEYS))


def call_seconds(calls: FsdpCallCost | None, flat_s: float, kind: str, unit_bytes: float) -> float:
    """FSDP2's host time of one call: the fit where the cluster has one, else its flat figure per call
    (``Cluster.fsdp_call_overhead_s``, cluster files written before the fit)."""
    return calls.seconds(kind, unit_bytes) if calls is not None else flat_s
