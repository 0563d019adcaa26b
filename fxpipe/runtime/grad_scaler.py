"""fp16 loss scaling for a pipeline (``pipe.grad_scaler()``): torch's GradScaler whose overflow check spans the job."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.runtime.execution.stage import rank_runners
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.parallel.sharded_stage import local_part
from fxpipe.runtime.transport.comm import Pending

if TYPE_CHECKING:
    from fxpipe.runtime.execution.driver import PipelineDriver


class PipelineGradScaler(torch.amp.GradScaler):
    """A ``torch.amp.GradScaler`` for a pipelined model: its found-inf flag is the same on every rank.

    ``pipe.step`` scales each slice's loss by :meth:`get_scale` where its backward starts (the last
    stage), so gradients arrive scaled on every stage. :meth:`unscale_` (also run by :meth:`step` when
    not called before it) checks this rank's gradients, then takes the maximum of the flags of every
    rank of the job in one allreduce: a step that overflowed on any stage is skipped on all of them, and
    :meth:`update` moves every rank's scale alike. As torch's ``ShardedGradScaler`` does for FSDP; a
    sharded stage's gradients (DTensors) are checked and unscaled shard by shard.

    ``unscale_`` is collective: every rank calls it (or ``step``) once per optimizer per iteration.
    """

    def __init__(self, driver: PipelineDriver, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        device = driver.context.device
        super().__init__(device.type, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self._driver = driver
        if self._enabled:  # now, not at the first scale(): only the last stage scales, every rank unscales
            self._lazy_init_scale_growth_tracker(device)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        """torch's check-and-unscale of this rank's gradients, then the job-wide flag: ``{scale device: flag}``.

        Every rank returns one flag, also a rank whose optimizer holds no gradient (a frozen stage), since
        every rank joins the allreduce.
        """
        assert self._scale is not None, "enabled scalers initialise their scale in __init__"
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")  # torch's words
                    if param.grad.is_sparse:
                        if param.grad.dtype is torch.float16:  # overflow shows only once duplicates are summed
                            param.grad = param.grad.coalesce()
                        grad = param.grad._values()
                    else:
                        grad = local_part(param.grad)  # a sharded stage's DTensor: this rank's shard, in place
                    by_device[grad.device][grad.dtype].append(grad)
            flags = []
            for device, by_dtype in by_device.items():
                flag = found_inf.to(device, copy=True)
                for grads in by_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
                flags.append(flag.to(self._scale.device))
            combined = torch.stack(flags).amax() if flags else found_inf.to(self._scale.device, copy=True)
        return {combined.device: self._agree(combined)}

    def _agree(self, flag: torch.Tensor) -> torch.Tensor:
        """The maximum of every rank's found-inf flag, on every rank (one allreduce over the default group)."""
        driver = self._driver
        if driver.context.world_size > 1:
            flag = flag.reshape(1).to(driver.context.device)
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
            assert work is not None
            driver.exchange.wait([Pending(work, -1, "grad scaler found-inf allreduce over all ranks", flag)])
        return flag.reshape(()).to(self._scale.device if self._scale is not None else flag.device)


class GradScalerError(PipelineSetupError):
    """``pipe.grad_scaler()`` called for a pipe that already has one."""


def make_grad_scaler(driver: PipelineDriver, **kwargs: Any) -> PipelineGradScaler:
    """The pipe's scaler, made once: ``pipe.step`` scales each slice's loss by it from now on."""
    existing = driver.runner.scaler
    if existing is not None:
        raise GradScalerError(
            f"this pipe already has a grad scaler (scale {existing.get_scale()}, enabled={existing.is_enabled()}); "
            "pipe.step scales the loss by that one, and a second would unscale by another scale: use pipe.scaler")
    scaler = PipelineGradScaler(driver, **kwargs)
    # a virtual-stage rank: every chunk's runner (the last chunk's scales its loss; checkpoints read driver.runner)
    for runner in rank_runners(driver).values():
        runner.scaler = scaler
    return scaler
