"""Analytic latency vs exact simulation on random chains and plans, and the simulator's speed.

Run: python benchmarks/simulate_accuracy.py [--cases 200] [--seed 0] [--speed]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.sim.simulate import simulate

DEVICE = DeviceSpec("bench", 16 * 2**30, (("float32", 1.5e13),), 9e11)


def random_cluster(rng: random.Random) -> Cluster:
    num_hosts, per_host = rng.choice([(1, 4), (2, 4), (2, 8), (4, 2), (8, 1)])
    return Cluster(f"{num_hosts}x{per_host}", num_hosts, per_host, DEVICE,
                   intra_host=LinkSpec(rng.choice([25e9, 10e9]), 5e-6),
                   inter_host=LinkSpec(rng.choice([3e9, 1e9, 3e8]), 2e-5))


def random_chain(rng: random.Random, num_blocks: int) -> CostChain:
    """Blocks of 1-20 ms forward per 32 rows, backward 1.5-2.5x forward, activations of 0.1-8 MB per 32 rows."""
    blocks = []
    for index in range(num_blocks):
        forward = rng.uniform(1e-3, 20e-3) / 32
        blocks.append(Block(f"b{index}", (), Affine(rng.uniform(0, 1e-4), forward),
                            Affine(rng.uniform(0, 2e-4), forward * rng.uniform(1.5, 2.5)),
                            rng.randrange(0, 200 * 2**20), Affine(0, rng.uniform(1e5, 4e6))))
    cuts = tuple(Affine(0, rng.uniform(1e5, 8e6) / 32) for _ in range(num_blocks - 1))
    return CostChain(tuple(blocks), cuts, source="random")


def random_plan(rng: random.Random, chain: CostChain, cluster: Cluster) -> Plan:
    """Random cuts, replica counts and a device order; M from powers of two up to 64."""
    num_stages = rng.randint(1, min(4, chain.num_blocks, cluster.num_devices))
    cuts = sorted(rng.sample(range(1, chain.num_blocks), num_stages - 1))
    bounds = [0, *cuts, chain.num_blocks]
    free = list(range(cluster.num_devices))
    if rng.random() < 0.5:
        rng.shuffle(free)
    spare = cluster.num_devices - num_stages
    stages, replicas_left = [], spare
    for index in range(num_stages):
        extra = rng.randint(0, replicas_left) if rng.random() < 0.6 else 0
        replicas_left -= extra
        devices, free = tuple(free[: 1 + extra]), free[1 + extra:]
        stages.append(StagePlan(index, bounds[index], bounds[index + 1], len(devices), devices))
    max_replicas = max(stage.replicas for stage in stages)
    num_microbatches = rng.choice([m for m in (1, 2, 4, 8, 16, 32, 64) if m >= 1])
    microbatch_size = max_replicas * rng.choice([1, 2, 4, 8])
    return Plan(microbatch_size * num_microbatches, num_microbatches, tuple(stages),
                warmup_policy=rng.choice(["A", "B"]), num_blocks=chain.num_blocks,
                num_devices=cluster.num_devices)


def random_case(seed: int) -> tuple[Plan, CostChain, Cluster]:
    rng = random.Random(seed)
    cluster = random_cluster(rng)
    chain = random_chain(rng, rng.randint(2, 12))
    return random_plan(rng, chain, cluster), chain, cluster


def relative_errors(num_cases: int, seed: int) -> list[float]:
    """|analytic - simulated| / simulated for ``num_cases`` random cases (early-backward schedules)."""
    errors = []
    for case in range(num_cases):
        plan, chain, cluster = random_case(seed * 100_003 + case)
        simulated = simulate(plan, chain, cluster, timeline=False).iteration_time_s
        errors.append(abs(analytic_iteration_time(plan, chain, cluster) - simulated) / simulated)
    return errors


def speed(num_microbatches: int, layout: tuple[int, ...], repeats: int = 3) -> float:
    """Seconds per simulate call (timeline off) on a 4x16-device cluster."""
    rng = random.Random(1)
    cluster = Cluster("4x16", 4, 16, DEVICE, LinkSpec(25e9, 5e-6), LinkSpec(3e9, 2e-5))
    chain = random_chain(rng, 16)
    bounds = [round(i * chain.num_blocks / len(layout)) for i in range(len(layout) + 1)]
    devices, stages = iter(range(cluster.num_devices)), []
    for index, replicas in enumerate(layout):
        stages.append(StagePlan(index, bounds[index], bounds[index + 1], replicas,
                                tuple(next(devices) for _ in range(replicas))))
    rows = max(layout) * 2
    plan = Plan(rows * num_microbatches, num_microbatches, tuple(stages), num_blocks=chain.num_blocks)
    start = time.perf_counter()
    for _ in range(repeats):
        simulate(plan, chain, cluster, timeline=False)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speed", action="store_true", help="also time simulate() at M=512 on 64 devices")
    args = parser.parse_args()
    errors = sorted(relative_errors(args.cases, args.seed))
    print(f"analytic vs simulated over {args.cases} random cases (seed {args.seed}): "
          f"mean {statistics.mean(errors):.2%}, median {statistics.median(errors):.2%}, "
          f"p90 {errors[int(0.9 * (len(errors) - 1))]:.2%}, worst {errors[-1]:.2%}, "
          f"exact (<1e-9) {sum(e < 1e-9 for e in errors)}")
    if args.speed:
        for layout in [(64,), (32, 32), (63, 1), (16, 16, 16, 16), (8,) * 8, (1,) * 16, (33, 17, 9, 5)]:
            print(f"simulate M=512 layout {':'.join(map(str, layout)):>14}: {speed(512, layout):.3f} s")


if __name__ == "__main__":
    main()
