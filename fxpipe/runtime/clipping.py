"""The whole job's gradient norm and clipping (``pipe.clip_grad_norm_``): each parameter counted once, one allreduce."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from fxpipe.runtime.parallel.sharded_stage import is_sharded, local_part
from fxpipe.runtime.parallel.tensor_parallel import TensorParallelParam, counts_in_norm
from fxpipe.runtime.transport.comm import Pending

if TYPE_CHECKING:
    from fxpipe.runtime.execution.driver import PipelineDriver
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver

# The reduced vector: [this rank's share of the total, a NaN seen, one presence flag per dtype of the
# per-gradient norms (as torch stacks them, the total takes their promoted dtype)]. A NaN travels as a
# flag because a MAX reduction need not propagate it.
NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SHARE, _NAN, _FIRST_DTYPE = 0, 1, 2
SHARE_SIZE = _FIRST_DTYPE + len(NORM_DTYPES)


class NormTypeError(ValueError):
    """A ``norm_type`` the whole-job norm cannot be assembled from per-rank shares."""


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float: a positive finite p (sum of ``|g|**p`` over ranks) or ``inf`` (max over ranks)."""
    value = float(norm_type)
    if not (value > 0):  # also NaN
        raise NormTypeError(f"pipe.clip_grad_norm_ got norm_type={norm_type!r}; use a positive p (2.0 is the "
                            "usual) or float('inf'): the whole model's norm is assembled from each rank's share, "
                            "which only these norms allow")
    return value


def counts_parameter(name: str, stage_index: int, replica_index: int,
                     tie_owners: Mapping[str, Sequence[int]]) -> bool:
    """Whether this rank's copy of parameter ``name`` enters the whole model's norm.

    After ``step`` every replica of a stage holds the same gradients (all-reduced), and every stage
    holding a tied parameter holds the same sum (``tie_owners``: original name -> owning stages, from
    ``program.tie_groups``). So exactly one copy counts: the first replica's of the lowest owning stage.
    """
    owners = tie_owners.get(name, (stage_index,))
    return replica_index == 0 and stage_index == min(owners)


def counted_gradients(named: Iterable[tuple[str, torch.nn.Parameter]], stage_index: int, replica_index: int,
                      tie_groups: Iterable[tuple[str, Sequence[int]]], tensor_parallel_member: int = 0,
                      tensor_parallel: Mapping[str, TensorParallelParam] | None = None) -> list[torch.Tensor]:
    """The gradients this rank adds to the whole model's norm (parameters without ``.grad`` skipped, as torch does).

    A sharded stage's gradient (a DTensor) is split over its replicas: every replica counts its own shard. On a
    tensor-parallel stage (``tensor_parallel``: how each parameter is held) every member counts its shards and
    member 0 the whole parameters.
    """
    owners = dict(tie_groups)
    counted = []
    for name, param in named:
        grad = param.grad
        if grad is None:
            continue
        if not counts_in_norm((tensor_parallel or {}).get(name), tensor_parallel_member):
            continue
        if is_sharded(grad):  # every replica holds its own shard of the reduced gradient: each counts its part
            if counts_parameter(name, stage_index, 0, owners):
                counted.append(local_part(grad))
        elif counts_parameter(name, stage_index, replica_index, owners):
            counted.append(grad)
    return counted


def local_share(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share (float64, ``SHARE_SIZE``) of the total: ``sum |g|**p`` or, for inf, ``max |g|``.

    Each gradient's norm is taken in its own dtype as torch does; the shares add in float64.
    """
    share = torch.zeros(SHARE_SIZE, dtype=torch.float64, device=device)
    if not grads:
        return share
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    norms = [norm for group in by_dtype.values() for norm in torch._foreach_norm(group, norm_type)]
    for dtype in {norm.dtype for norm in norms}:
        if dtype not in NORM_DTYPES:
            raise TypeError(f"a gradient norm has dtype {dtype}; pipe.clip_grad_norm_ handles gradients whose "
                            f"norms are one of {[str(d) for d in NORM_DTYPES]} (cast the parameters)")
        share[_FIRST_DTYPE + NORM_DTYPES.index(dtype)] = 1.0
    stacked = torch.stack([norm.to(device=device, dtype=torch.float64) for norm in norms])
    value = stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum()
    share[_NAN] = value.isnan().to(torch.float64)
    share[_SHARE] = torch.where(value.isnan(), 0.0, value)
    return share


def reduce_op(norm_type: float) -> str:
    """How shares combine across ranks: ``"max"`` for the inf-norm, else ``"sum"``."""
    return "max" if math.isinf(norm_type) else "sum"


def total_norm(reduced: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The whole model's norm from the reduced shares, in the promoted dtype of the gradient norms (float32 if none)."""
    values = reduced.tolist()
    present = [dtype for index, dtype in enumerate(NORM_DTYPES) if values[_FIRST_DTYPE + index] > 0]
    dtype = torch.float32
    if present:
        dtype = present[0]
        for other in present[1:]:
            dtype = torch.promote_types(dtype, other)
    value = values[_SHARE] if math.isinf(norm_type) else values[_SHARE] ** (1.0 / norm_type)
    if values[_NAN] > 0:
        value = math.nan
    return torch.tensor(value, dtype=dtype, device=reduced.device)


def check_finite(total: torch.Tensor, norm_type: float) -> None:
    """torch's ``error_if_nonfinite`` check; every rank holds the same total, so every rank raises alike."""
    if not bool(torch.isfinite(total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients of the whole pipelined model (all "
                           f"stages) is non-finite ({total.item()}), so it cannot be clipped. To disable this error "
                           "and scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")


def scale_gradients(params: Iterable[torch.nn.Parameter], max_norm: float, total: torch.Tensor) -> None:
    """Multiply every gradient by ``min(max_norm / (total + 1e-6), 1)``, as ``torch.nn.utils.clip_grad_norm_``."""
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(local_part(param.grad))  # a shard scales in place
    for grads in by_dtype.values():
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))


@torch.no_grad()
def clip_grad_norm(driver: PipelineDriver, named: Sequence[tuple[str, torch.nn.Parameter]], max_norm: float,
                   norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip this rank's gradients (``named``: its stage's parameters) by the whole model's norm, which it returns.

    Collective: every rank calls it with the same arguments; one allreduce over the default group.
    """
    norm_type = check_norm_type(norm_type)
    grads = counted_gradients(named, driver.stage_index, driver.replica_index, driver.program.tie_groups,
                              driver.tensor_parallel.member, driver.tp_params)
    return clip_by_counted(driver, grads, [param for _, param in named], max_norm, norm_type, error_if_nonfinite)


def clip_by_counted(driver: PipelineDriver | VirtualDriver, counted: Sequence[torch.Tensor],
                    params: Sequence[torch.nn.Parameter], max_norm: float, norm_type: float,
                    error_if_nonfinite: bool) -> torch.Tensor:
    """The job's norm from each rank's ``counted`` gradients (each gradient counted on one rank only), one
    allreduce over the default group waited on through the driver's exchange; ``params``' gradients scaled by it."""
    share = local_share(counted, norm_type, driver.context.device)
    if driver.context.world_size > 1:
        op = dist.ReduceOp.MAX if reduce_op(norm_type) == "max" else dist.ReduceOp.SUM
        work = dist.all_reduce(share, op=op, async_op=True)
        assert work is not None
        driver.exchange.wait([Pending(work, -1, "gradient norm allreduce over all ranks", share)])
    total = total_norm(share, norm_type)
    if error_if_nonfinite:
        check_finite(total, norm_type)
    scale_gradients(params, max_norm, total)
    return total
