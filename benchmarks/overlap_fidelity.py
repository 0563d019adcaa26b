"""Overlap that costs something, on real CPU ranks: a data-parallel step with its gradients all-reduced in
buckets overlapping the last backward, and the same step all-reducing after backward, measured against
the simulator with the overlap cost (``Cluster.overlap_compute_slowdown``/``overlap_comm_slowdown``
measured by ``fxpipe.runtime.calibration.calibrate_overlap`` in the same ranks) and with overlap free (the old model).

Run: python benchmarks/overlap_fidelity.py [--steps 15] [--warmup 2] [--write]

Two gloo ranks (1 thread each) on this machine: each measures the link figures and the overlap cost
(``measure_pair_link``), then compiles both plans and times their steps interleaved (A B B A ...: the
VM's drift hits both alike). The chain is measured in this process before the ranks start.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    Workload,
    bench_main,
    interleaved,
    machine_notes,
    median,
    run_ranks,
    zero_grads,
)
from benchmarks.runtime_fidelity import measured_chain  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/overlap_fidelity.py --write"
# Parameters large next to the compute (2 rows of 16 tokens per rank): the allreduce matters.
WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 256), ("block_size", 16)), 4, 1)
BUCKET_BYTES = 2 * 2**20


def overlap_rank(rank: int, world_size: int, plans: dict[str, str], workload: Workload, num_warmup: int,
                 num_steps: int) -> dict[str, Any]:
    import torch

    import fxpipe
    from fxpipe.core.plan import Plan
    from fxpipe.runtime.calibration.calibrate_measure import measure_pair_link

    figures = measure_pair_link(rank, torch.device("cpu"), None)
    inputs, targets = workload.batch()
    steps = {}
    for name, plan_json in plans.items():
        model, example_inputs = workload.build()
        pipe = fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(),
                              global_batch_size=workload.global_batch_size, plan=Plan.from_json(plan_json))
        params = list(pipe.parameters())

        def step(pipe: Any = pipe, params: list[Any] = params) -> None:
            zero_grads(params)
            pipe.step(inputs, targets)

        steps[name] = step
    return {"figures": figures, "times": interleaved(steps, num_warmup, num_steps)}


def local_cluster_from(figures: dict[str, float]) -> Any:
    """``local:2`` with the link figures, overlap cost and sharding collectives the ranks just measured."""
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.core.cluster_spec import sharding_links
    from fxpipe.core.hardware import LinkSpec

    link = LinkSpec(figures["link_bandwidth"], figures["link_latency"])
    reduce_scatter, all_gather = sharding_links(figures)
    return replace(parse_cluster("local:2"), intra_host=link, inter_host=link,
                   intra_host_collective=LinkSpec(figures["allreduce_bandwidth"], figures["allreduce_latency"]),
                   message_overhead_s=figures["message_overhead"],
                   overlap_compute_slowdown=figures["overlap_compute_slowdown"],
                   overlap_comm_slowdown=figures["overlap_comm_slowdown"],
                   reduce_scatter_collective=reduce_scatter, all_gather_collective=all_gather)


def run_and_report(num_warmup: int, num_steps: int) -> str:
    import fxpipe.runtime.calibration.calibrate  # noqa: F401
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.passes.partition.dapple import partition
    from fxpipe.sim.simulate import simulate

    chain = measured_chain(WORKLOAD)
    base = partition(chain, parse_cluster("local:2"), WORKLOAD.global_batch_size, layout="dp", num_microbatches=1)
    plans = {"overlapped": base.with_updates(allreduce_bucket_bytes=BUCKET_BYTES),
             "after backward": base.with_updates(allreduce_bucket_bytes=0)}
    ranks = run_ranks(overlap_rank, 2, {name: plan.to_json() for name, plan in plans.items()}, WORKLOAD,
                      num_warmup, num_steps)
    figures = ranks[0]["figures"]
    cluster = local_cluster_from(figures)
    free = replace(cluster, overlap_compute_slowdown=0.0, overlap_comm_slowdown=0.0)
    rows = []
    for name, plan in plans.items():
        measured = median([max(pair) for pair in zip(*(r["times"][name] for r in ranks), strict=True)])
        costly = simulate(plan, chain, cluster).iteration_time_s
        old = simulate(plan, chain, free).iteration_time_s
        rows.append([name, f"{1e3 * costly:.1f}", f"{(measured - costly) / measured:+.1%}", f"{1e3 * old:.1f}",
                     f"{(measured - old) / measured:+.1%}", f"{1e3 * measured:.1f}"])
    headers = ["step", "simulated ms (overlap costs)", "error", "simulated ms (overlap free)", "error", "measured ms"]
    return "\n".join([
        "# Overlap fidelity: bucketed allreduce beside the last backward, measured vs simulated", "",
        f"Command: `{COMMAND}` ({num_steps} steps each after {num_warmup} warm-up, interleaved; median of the "
        "slower rank's step)", "",
        f"Workload: {WORKLOAD.describe()}, data parallel on 2 ranks, {BUCKET_BYTES // 2**20} MiB buckets or one "
        f"allreduce after backward; chain of {chain.num_blocks} measured blocks.", "",
        f"Machine: {machine_notes()}.", "",
        f"Measured in the ranks: overlap_compute_slowdown {figures['overlap_compute_slowdown']:.2f}, "
        f"overlap_comm_slowdown {figures['overlap_comm_slowdown']:.2f}; allreduce "
        f"{figures['allreduce_bandwidth'] / 1e9:.2f} GB/s, {1e6 * figures['allreduce_latency']:.0f} us latency.", "",
        str(tabulate(rows, headers=headers, tablefmt="github")), "",
        "Error = (measured - simulated) / measured.", "",
    ])


if __name__ == "__main__":
    bench_main(None, __doc__, RESULTS, run_and_report, steps=15, warmup=2)
