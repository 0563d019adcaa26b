"""PipeDream's hierarchical planner (Narayanan et al., SOSP 2019): minimise the slowest replicated stage."""

from __future__ import annotations

from dataclasses import dataclass

from fxpipe.passes.partition.block_partition import param_weights
from fxpipe.passes.partition.candidates import CandidateCosts

# Legend (PipeDream section 3.1): A^k(i->j, m) is the time of the slowest stage of the best pipeline
# of layers i..j on m workers of level k; T^k(i->j, m) the time of one stage of those layers replicated
# on m workers: (1/m) * max(A^{k-1}(i->j, m_{k-1}), 2 (m-1) W_ij / B_k); a cut after layer s costs
# 2 a_s / B_k. Level 1 workers are devices inside a host, level 2 workers are whole hosts.


@dataclass(frozen=True)
class Stage:
    """One stage of a level's solution: layers ``[first, stop)`` on ``workers`` workers of that level."""

    first: int
    stop: int
    workers: int


class _Level:
    """A^k for every layer range of one level, by dynamic programming; `solve` reconstructs stages."""

    def __init__(self, inner: list[list[float]], param_bytes: list[float], cut_bytes: list[float],
                 bandwidth: float, num_workers: int) -> None:
        self.inner = inner  # inner[i][j]: A^{k-1}(i->j) for layers [i, j)
        self.param_prefix = [0.0]
        for value in param_bytes:
            self.param_prefix.append(self.param_prefix[-1] + value)
        self.cut_bytes = cut_bytes
        self.bandwidth = bandwidth
        self.num_workers = num_workers
        self.memo: dict[tuple[int, int, int], tuple[float, tuple[Stage, ...]]] = {}

    def replicated(self, first: int, stop: int, workers: int) -> float:
        weights = self.param_prefix[stop] - self.param_prefix[first]
        sync = 2 * (workers - 1) * weights / self.bandwidth
        return max(self.inner[first][stop], sync) / workers

    def best(self, first: int, stop: int, workers: int) -> tuple[float, tuple[Stage, ...]]:
        key = (first, stop, workers)
        if key in self.memo:
            return self.memo[key]
        result: tuple[float, tuple[Stage, ...]] = (self.replicated(first, stop, workers),
                                                   (Stage(first, stop, workers),))
        for split in range(first + 1, stop):
            comm = 2 * self.cut_bytes[split - 1] / self.bandwidth
            if comm >= result[0]:
                continue
            for last_workers in range(1, workers):
                tail = self.replicated(split, stop, last_workers)
                if max(comm, tail) >= result[0]:
                    continue
                head_time, head = self.best(first, split, workers - last_workers)
                value = max(head_time, comm, tail)
                if value < result[0]:
                    result = (value, (*head, Stage(split, stop, last_workers)))
        self.memo[key] = result
        return result


def pipedream_layout(model: CandidateCosts, rows: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """PipeDream's plan at micro-batch ``rows``: ``(first, stop, devices)`` per flattened stage."""
    chain, cluster = model.chain, model.cluster
    num_blocks = chain.num_blocks
    compute = [[0.0] * (num_blocks + 1) for _ in range(num_blocks + 1)]
    for first in range(num_blocks):
        for stop in range(first + 1, num_blocks + 1):
            cost = model.cost(first, stop, rows, 1)
            compute[first][stop] = cost.forward_s + cost.backward_s
    params = param_weights(chain)
    cuts = [c.at(rows) for c in chain.cut_bytes]
    per_host = cluster.devices_per_host
    level1 = _Level(compute, params, cuts, cluster.intra_host.bandwidth_bytes_per_s, per_host)
    host_time = [[level1.best(i, j, per_host)[0] if j > i else 0.0 for j in range(num_blocks + 1)]
                 for i in range(num_blocks + 1)]
    collective = cluster.inter_host_collective or cluster.inter_host
    level2 = _Level(host_time, params, cuts, collective.bandwidth_bytes_per_s, cluster.num_hosts)
    stages = []
    host = 0
    for outer in level2.best(0, num_blocks, cluster.num_hosts)[1]:
        hosts = range(host, host + outer.workers)
        offset = 0
        for inner in level1.best(outer.first, outer.stop, per_host)[1]:
            devices = tuple(h * per_host + offset + d for h in hosts for d in range(inner.workers))
            stages.append((inner.first, inner.stop, tuple(sorted(devices))))
            offset += inner.workers
        host += outer.workers
    return stages

