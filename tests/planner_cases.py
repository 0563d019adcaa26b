"""Small hand-built cost chains and clusters shared by the planner tests."""

from __future__ import annotations

import random

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine

GiB = 2**30


def cluster(num_hosts: int, per_host: int, *, memory_gib: float = 16, intra: float = 25e9,
            inter: float = 1e9) -> Cluster:
    device = DeviceSpec("dev", int(memory_gib * GiB), (("float32", 1e13),), 1e12)
    return Cluster(f"{num_hosts}x{per_host}", num_hosts, per_host, device, LinkSpec(intra), LinkSpec(inter))


def chain(forward_ms: list[float], param_bytes: list[int], *, cut_bytes_per_row: float = 1e4,
          saved_bytes_per_row: float = 1e5) -> CostChain:
    """Blocks with per-row forward time (backward twice that), weights, activations and cut sizes."""
    blocks = tuple(
        Block(f"b{i}", (f"n{i}a", f"n{i}b"), Affine(0, f * 1e-3), Affine(0, 2 * f * 1e-3), p,
              Affine(0, saved_bytes_per_row))
        for i, (f, p) in enumerate(zip(forward_ms, param_bytes, strict=True)))
    cuts = tuple(Affine(0, cut_bytes_per_row) for _ in range(len(blocks) - 1))
    return CostChain(blocks, cuts, Affine(0, 1e3), Affine(0, 1e2), "test")


def random_case(seed: int, max_blocks: int = 8, max_devices: int = 8) -> tuple[CostChain, Cluster, int]:
    """A random chain (mixed compute, weights, activations) on 1-2 hosts and a global batch."""
    rng = random.Random(seed)
    num_blocks = rng.randint(2, max_blocks)
    num_hosts = rng.choice([1, 2])
    per_host = rng.randint(1, max_devices // num_hosts)
    if num_hosts * per_host < 2:
        per_host = 2
    blocks = tuple(
        Block(f"b{i}", (f"n{i}",),
              forward_s=Affine(rng.choice([0.0, 1e-4]), rng.uniform(1e-5, 1e-3)),
              backward_s=Affine(rng.choice([0.0, 2e-4]), rng.uniform(2e-5, 2e-3)),
              param_bytes=int(10 ** rng.uniform(5, 8.5)),
              saved_bytes=Affine(0, 10 ** rng.uniform(4, 7)))
        for i in range(num_blocks))
    cuts = tuple(Affine(0, 10 ** rng.uniform(3, 6.5)) for _ in range(num_blocks - 1))
    device = DeviceSpec("dev", int(rng.choice([1, 4, 16]) * GiB), (("float32", 1e13),), 1e12)
    result = Cluster(f"rand{seed}", num_hosts, per_host, device, LinkSpec(25e9, 5e-6),
                     LinkSpec(rng.choice([1e9, 3e9, 12.5e9]), 2e-5))
    batch = rng.choice([16, 32, 64])
    return CostChain(blocks, cuts, Affine(0, 1e4), Affine(0, 1e3), f"random:{seed}"), result, batch


def mixed_case(seed: int) -> tuple[CostChain, Cluster, int]:
    """A chain of 24-96 blocks of mixed compute, weights (0.05-1 GiB) and activations on 3-12 hosts of 8 devices
    (8-32 GiB each; a 1 or 12.5 GB/s link between hosts) and a global batch: the large-cluster cases
    benchmarks/uniform_layout_hunt.py plans."""
    rng = random.Random(seed)
    num_blocks = rng.choice([24, 40, 64, 96])
    memory_gib = rng.choice([8, 16, 32])
    blocks = tuple(Block(f"b{i}", (f"n{i}",), Affine(rng.choice([0, 1e-4]), rng.uniform(0.5, 1.5) * 1e-3),
                         Affine(0, rng.uniform(1, 3) * 1e-3), int(rng.uniform(0.05, 1.0) * GiB),
                         Affine(0, rng.uniform(1e6, 3e8))) for i in range(num_blocks))
    cuts = tuple(Affine(0, rng.uniform(1e4, 1e7)) for _ in range(num_blocks - 1))
    hosts = rng.choice([3, 4, 8, 12])
    result = cluster(hosts, 8, memory_gib=memory_gib, inter=rng.choice([1e9, 12.5e9]))
    return CostChain(blocks, cuts, Affine(0, 1e4), Affine(0, 1e3), f"mixed:{seed}"), result, rng.choice([64, 256, 1024])
