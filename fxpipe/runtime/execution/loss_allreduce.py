"""The step's closing allreduce: the last stage's loss and count, the preemption vote and folded checks, summed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from fxpipe.runtime.faults import preemption
from fxpipe.runtime.transport.comm import DistContext, PeerExchange, Pending


def sum_loss_and_votes(exchange: PeerExchange, context: DistContext, loss_sum: float, count: float,
                       folded: Sequence[float]) -> tuple[float, float, bool, list[float]]:
    """``(loss_sum, count, preempted, folded)`` summed over every rank in one allreduce waited on through
    ``exchange`` (stall detection watches it); ``preempted``: a preemption signal reached some rank. A world
    of one only reads its own vote."""
    if context.world_size == 1:
        return loss_sum, count, preemption.vote() > 0, list(folded)
    total = torch.tensor([loss_sum, count, preemption.vote(), *folded], dtype=torch.float64, device=context.device)
    work = dist.all_reduce(total, op=dist.ReduceOp.SUM, async_op=True)
    assert work is not None
    exchange.wait([Pending(work, -1, "loss allreduce over all ranks", total)])
    loss_sum, count, stop_votes, *summed = total.tolist()
    return loss_sum, count, stop_votes > 0, summed
