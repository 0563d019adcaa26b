"""The whole job's gradient norm and clipping on virtual stages: each parameter counted once, one allreduce."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fxpipe.runtime.clipping import check_norm_type, clip_by_counted
from fxpipe.runtime.parallel.sharded_stage import is_sharded, local_part

if TYPE_CHECKING:
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver


@torch.no_grad()
def clip_virtual_grad_norm(driver: VirtualDriver, max_norm: float, norm_type: float = 2.0,
                           error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip this rank's gradients by the whole model's norm, which it returns (collective, like
    ``fxpipe.runtime.clipping.clip_grad_norm``). After ``step`` every replica of a device group holds the same
    gradients and every holder of a tied weight the same sum, so one copy counts: the first replica's, on the
    group of the lowest chunk holding it. A sharded chunk's replicas hold disjoint rows: each counts its own."""
    norm_type = check_norm_type(norm_type)
    owners = dict(driver.program.tie_groups)
    counted = [local_part(param.grad) for name, param in driver.named if param.grad is not None
               and (driver.replica_index == 0 or is_sharded(param.grad))
               and min(owners.get(name, driver.chunks)) in driver.chunks]
    return clip_by_counted(driver, counted, [param for _, param in driver.named], max_norm, norm_type,
                           error_if_nonfinite)
