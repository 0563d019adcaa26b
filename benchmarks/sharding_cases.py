"""The best unsharded plan against sharding="auto" for a few (model, cluster, batch) cases given on the command line:
the look-arounds of benchmarks/sharding_study_13b.md's reading, outside its grid.

Run: python benchmarks/sharding_cases.py [--max-blocks N] MODEL:CLUSTER:BATCH[:KEY=VALUE...] ...
(e.g. ``gpt3-13b:dgx-h100:2:64``; KEY=VALUE are zoo config overrides, except ``memory_gib=N``, the devices' memory;
CLUSTER ``h100-pcie`` is benchmarks/sharding_pcie.py's 8-GPU H100 PCIe node; analytic costs, bf16 on H100/H200
presets and fp16 on V100 ones, as benchmarks/sharding_study.py; prints one line per case)
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace

from sharding_pcie import pcie_cluster
from sharding_study import MAX_BLOCKS, GiB, describe, low_precision, ratio

from fxpipe import models
from fxpipe.core.cluster import Cluster, parse_cluster
from fxpipe.passes.partition.request import PlanningError
from fxpipe.planning import costed_model, model_loss, plan_chain


def run_case(case: str, max_blocks: int) -> str:
    name, *rest = case.split(":")
    overrides = {key: int(value) for key, value in (part.split("=") for part in rest if "=" in part)}
    numbers = [part for part in rest if "=" not in part]
    spec, batch = ":".join(numbers[:-1]), int(numbers[-1])
    start = time.perf_counter()
    cluster = case_cluster(spec, overrides.pop("memory_gib", None))
    model, example_inputs = models.build(name, device="meta", **overrides)
    chain = costed_model(model, example_inputs, cluster, costs="analytic", max_blocks=max_blocks,
                         precision=low_precision(cluster), **model_loss(name, example_inputs)).chain
    plans = []
    for sharding in ("none", "auto"):
        try:
            plans.append(plan_chain(chain, cluster, batch, precision=low_precision(cluster), sharding=sharding))
        except PlanningError:
            plans.append(None)
    value = ratio(plans[0], plans[1])
    verdict = f"{value:.2f}x" if value else ("now feasible" if plans[1] and not plans[0] else "infeasible")
    return (f"{case}: unsharded {describe(plans[0])}, auto {describe(plans[1])}: {verdict} "
            f"({time.perf_counter() - start:.0f} s, load {os.getloadavg()[0]:.1f})")


def case_cluster(spec: str, memory_gib: int | None) -> Cluster:
    """``spec``'s cluster (``h100-pcie``: the PCIe node of benchmarks/sharding_pcie.py), with ``memory_gib`` per device."""
    if spec == "h100-pcie":
        return pcie_cluster(memory_gib=memory_gib)
    cluster = parse_cluster(spec)
    if memory_gib is None:
        return cluster
    return replace(cluster, device=replace(cluster.device, memory_bytes=memory_gib * GiB))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+")
    parser.add_argument("--max-blocks", type=int, default=MAX_BLOCKS)
    args = parser.parse_args()
    for case in args.cases:
        print(run_case(case, args.max_blocks), flush=True)


if __name__ == "__main__":
    main()
