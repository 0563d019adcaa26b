"""Per-device bytes of a stage's weights, gradients and optimizer state under each sharding level (ZeRO-1/2/3).

Legend: P the stage's parameter bytes (fp32 master weights), r its replicas, f the optimizer's bytes kept
per parameter byte (:data:`fxpipe.sim.stagecost.OPTIMIZER_STATE_FACTORS`: weights 1 + gradients 1 +
state f - 2), U the parameter bytes of the stage's largest block (the largest unit gathered or reduced
at once):

    none:        P + P + (f-2) P                 every replica holds everything (DAPPLE)
    optimizer:   P + P + (f-2) P / r             ZeRO-1: the state is split
    gradients:   P + P / r + (f-2) P / r + U     ZeRO-2: gradients too; one unit's full gradients in flight
    parameters:  f P / r + U                     ZeRO-3: weights too; one unit's full weights gathered

A stage of one replica has nothing to split: every level is ``none`` there.
"""

from __future__ import annotations

from fxpipe.core.sharding import check_level


def model_state_bytes(param_bytes: float, factor: float, sharding: str = "none", replicas: int = 1,
                      unit_bytes: float = 0.0) -> float:
    """Weights + gradients + optimizer state per device of a stage (module docstring's table)."""
    check_level(sharding)
    if sharding == "none" or replicas <= 1:
        return param_bytes * factor
    state = (factor - 2.0) * param_bytes / replicas
    if sharding == "optimizer":
        return 2.0 * param_bytes + state
    if sharding == "gradients":
        return param_bytes + param_bytes / replicas + state + unit_bytes
    return factor * param_bytes / replicas + unit_bytes
