"""The whole job's gradient norm and clipping on virtual stages: each parameter counted once, one allreduce."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fxpipe.runtime.clipping import (
    check_finite,
    check_norm_type,
    local_share,
    reduce_op,
    scale_gradients,
    total_norm,
)
from fxpipe.runtime.parallel.sharded_stage import is_sharded, local_part
from fxpipe.runtime.transport.comm import Pending

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
    share = local_share(counted, norm_type, driver.context.device)
    if driver.context.world_size > 1:
        op = dist.ReduceOp.MAX if reduce_op(norm_type) == "max" else dist.ReduceOp.SUM
        work = dist.all_reduce(share, op=op, async_op=True)
        assert work is not None
        driver.exchange.wait([Pending(work, -1, "gradient norm allreduce over all ranks", share)])
    total = total_norm(share, norm_type)
    if error_if_nonfinite:
        check_finite(total, norm_type)
    scale_gradients((param for _, param in driver.named), max_norm, total)
    return total
