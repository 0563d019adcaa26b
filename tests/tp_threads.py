"""A thread-based tensor-parallel communicator for single-process tests: T members run in T threads."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from fxpipe.passes.tp_shard import TensorParallelParameter


class ThreadGroup:
    """``size`` members exchanging tensors through shared slots and a barrier (sums in rank order)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list[Any] = [None] * size
        self.counts = [0] * size

    def member(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def _exchange(self, tensor: Tensor) -> list[Tensor]:
        self.group.counts[self.rank] += 1
        self.group.slots[self.rank] = tensor.detach().clone()
        self.group.barrier.wait()
        values = list(self.group.slots)
        self.group.barrier.wait()
        return values

    def all_reduce(self, tensor: Tensor) -> Tensor:
        values = self._exchange(tensor)
        total = values[0].clone()
        for value in values[1:]:
            total += value
        return total

    def all_gather(self, tensor: Tensor, dim: int) -> Tensor:
        return torch.cat(self._exchange(tensor), dim)

    def reduce_scatter(self, tensor: Tensor, dim: int) -> Tensor:
        return self.all_reduce(tensor).chunk(self.size, dim)[self.rank].contiguous()


def run_members(size: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(rank)`` in ``size`` threads; the results in rank order (re-raises the first failure)."""
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def full_gradient(members: Sequence[tuple[TensorParallelParameter, Tensor]]) -> Tensor:
    """One parameter's gradient as one process has it, from every member's (parameter, gradient)."""
    parameter = members[0][0]
    grads = [grad for _, grad in members]
    if parameter.dim is None:
        return torch.stack(grads).sum(0) if parameter.partial_grad else grads[0]
    if parameter.parts is None:
        return torch.cat(grads, parameter.dim)
    size = len(grads)
    local_parts = [part // size for part in parameter.parts]
    pieces = [grad.split(local_parts, parameter.dim) for grad in grads]
    return torch.cat([torch.cat([piece[i] for piece in pieces], parameter.dim) for i in range(len(local_parts))],
                     parameter.dim)
