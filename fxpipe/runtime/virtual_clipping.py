"""The whole job's gradient norm and clipping on virtual stages: each parameter counted once, one allreduce."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fxpipe.runtime.clipping import check_norm_type, clip_by_counted
from fxpipe.runtime.parallel.sharded_stage import is_sharded, local_part
from fxpipe.runtime.parallel.tensor_parallel import counts_in_norm

if TYPE_CHECKING:
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver


@torch.no_grad()
def clip_virtual_grad_norm(driver: VirtualDriver, max_norm: float, norm_type: float = 2.0,
                           error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip this rank's gradients by the whole model's norm, which it returns (collective, like
    ``fxpipe.runtime.clipping.clip_grad_norm``). After ``step`` every replica of a device group holds the same
    gradients and every holder of a tied weight the same sum, so one copy counts: the first replica's, on the
    group of the lowest chunk holding it. A sharded chunk's replicas hold disjoint rows: each counts its own; a
    tensor-parallel group's members each count their shards, member 0 the whole parameters."""
    norm_type = check_norm_type(norm_type)
    owners = dict(driver.program.tie_groups)
    counted, seen = [], set()
    for name, param in driver.named:  # a tied weight two chunks hold as two tensor-parallel shards: once
        if param.grad is None or name in seen or min(owners.get(name, driver.chunks)) not in driver.chunks:
            continue
        seen.add(name)
        if (driver.replica_index == 0 or is_sharded(param.grad)) \
                and counts_in_norm(driver.tp_params.get(name), driver.tensor_parallel.member):
            counted.append(local_part(param.grad))
    return clip_by_counted(driver, counted, [param for _, param in driver.named], max_norm, norm_type,
                           error_if_nonfinite)
