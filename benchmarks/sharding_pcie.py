"""gpt3-13b on one 8-GPU H100 PCIe server (no NVLink): the best unsharded plan against sharding="auto" at fine-tuning
batches and long sequences, the terms that decide the headline case, and how it moves with the link and the memory.

Run: python benchmarks/sharding_study_13b.py --write --pcie   (writes benchmarks/sharding_study_13b_pcie.md)
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tabulate import tabulate

from fxpipe import models
from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster, _local_gpu_cluster
from fxpipe.core.hardware import H100_80GB, H100_MATMUL_FLOPS, H100_PCIE_80GB
from fxpipe.core.plan import Plan
from fxpipe.passes.partition.request import PlanningError
from fxpipe.planning import autocast_dtype, costed_model, model_loss, plan_chain
from fxpipe.sim.sharding_cost import plan_sharding_comms
from fxpipe.sim.sharding_memory import chain_in_precision
from fxpipe.sim.tensor_parallel_cost import collective_seconds, splits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.sharding_study import MAX_BLOCKS, GiB, describe, ratio  # noqa: E402

MODEL = "gpt3-13b"
# What `local:8` plans for on an 8x "NVIDIA H100 PCIe" server without calibration (fxpipe.core.cluster's
# _local_gpu_cluster, called here rather than copied): the H100 PCIe datasheet preset (hardware.H100_PCIE_80GB;
# its matmuls at the datasheet peak, no published achievable figure) and hardware.PCIE_GPU_P2P between GPUs (20 GB/s
# effective, the PCIe 4.0 x16 figure; the H100 PCIe card is PCIe 5.0, hence the link sensitivity below).
GPU_NAME = "NVIDIA H100 PCIe"
SEQUENCES = (4096, 8192)
BATCHES = (8, 16, 32, 64)  # fine-tuning batches, in sequences
# fp32 master weights either way: bf16 autocast over them, or FSDP2's bf16 compute copies (docs/sharding.md)
PRECISIONS = ("bf16", "bf16-params")
HEADLINE = (8192, 8)  # (sequence, global batch) of the case the terms table and the sensitivity look at
LINKS_GB_PER_S = (10.0, 20.0, 40.0)  # half, the preset's and twice its GPU-to-GPU figure
MEMORY_GIB = (80.0, 79.0)  # the preset's nominal 80 GiB; 79 GiB is a little under what the card reports
# The preset runs the PCIe card's matmuls at its datasheet peak; the H100 SXM's published achievable bf16 rate is this
# fraction of its peak (hardware.H100_MATMUL_FLOPS): the headline case is also planned with the PCIe card at it.
SXM_MATMUL_FRACTION = dict(H100_MATMUL_FLOPS)["bfloat16"] / H100_80GB.flops_per_s("bfloat16")
SHARDINGS = ("none", "auto")
DEEP_PIPELINE = "1:1:1:1:1:1:1:1"  # the unsharded plan without tensor parallelism, shown in the terms table
Plans = dict[tuple[str, str], Plan | None]  # (precision, "none" or "auto") -> the best plan, None when none fits


def pcie_cluster(link_gb_per_s: float | None = None, memory_gib: float | None = None,
                 matmul_fraction: float | None = None) -> Cluster:
    """The 8-GPU H100 PCIe node, optionally with another GPU-to-GPU bandwidth, device memory or matmul rate (a
    fraction of the datasheet peak)."""
    cluster = _local_gpu_cluster("local:8 (8x H100 PCIe)", 8, GPU_NAME, H100_PCIE_80GB.memory_bytes, None)
    if link_gb_per_s is not None:
        link = replace(cluster.intra_host, bandwidth_bytes_per_s=link_gb_per_s * 1e9)
        cluster = replace(cluster, intra_host=link, inter_host=link)
    if memory_gib is not None:
        cluster = replace(cluster, device=replace(cluster.device, memory_bytes=int(memory_gib * GiB)))
    if matmul_fraction is not None:
        rates = tuple((dtype, peak * matmul_fraction) for dtype, peak in cluster.device.peak_flops)
        cluster = replace(cluster, device=replace(cluster.device, matmul_flops=rates))
    return cluster


def pcie_chains(seq: int, cluster: Cluster) -> dict[str, CostChain]:
    """The model's cost chain per precision at ``seq`` tokens (analytic costs on the meta device), costed once:
    costed_model reads a precision's autocast dtype only, bf16 for both (plan_chain adds bf16-params' copies)."""
    assert len({autocast_dtype(precision) for precision in PRECISIONS}) == 1, PRECISIONS
    model, example_inputs = models.build(MODEL, device="meta", block_size=seq)
    chain = costed_model(model, example_inputs, cluster, costs="analytic", max_blocks=MAX_BLOCKS,
                         precision=PRECISIONS[0], **model_loss(MODEL, example_inputs)).chain
    return dict.fromkeys(PRECISIONS, chain)


def pcie_plans(chains: dict[str, CostChain], cluster: Cluster, batch: int) -> Plans:
    """The planner's best plan per precision, without sharding and with ``sharding="auto"``."""
    plans: Plans = {}
    for precision, chain in chains.items():
        for sharding in SHARDINGS:
            try:
                plans[precision, sharding] = plan_chain(chain, cluster, batch, precision=precision, sharding=sharding)
            except PlanningError:
                plans[precision, sharding] = None
    return plans


def fastest(plans: Plans, sharding: str) -> Plan | None:
    """The fastest plan over the precisions for ``sharding`` ("none" or "auto"), None when none fits."""
    found = [plan for (_, level), plan in plans.items() if level == sharding and plan is not None]
    return min(found, key=lambda plan: plan.predicted.iteration_time_s if plan.predicted else float("inf"),
               default=None)


def speedup(plans: Plans) -> float | None:
    """The best sharded plan against the best unsharded one, both over every precision (None unless both fit)."""
    return ratio(fastest(plans, "none"), fastest(plans, "auto"))


def zero_collectives(plan: Plan, chain: CostChain, cluster: Cluster) -> tuple[float, float]:
    """A plan's ZeRO collectives per step on its busiest stage: left exposed beside compute (the planner's charge), and
    whole (the charge on devices whose collectives block: fxpipe.sim.unit_overlap overlaps none on CPU ranks)."""
    blocking = replace(cluster, device=replace(cluster.device, name="CPU"))
    costed = chain_in_precision(chain, plan.precision)
    exposed, whole = (max(comm.step_seconds(plan.num_microbatches) for comm in plan_sharding_comms(plan, costed, net))
                      for net in (cluster, blocking))
    return exposed, whole


def tensor_parallel_seconds(plan: Plan, chain: CostChain, cluster: Cluster) -> float:
    """A plan's tensor-parallel collectives per step on its busiest stage: forward and backward of every micro-batch
    (a recomputed block's second forward not counted), as fxpipe.sim.tensor_parallel_cost charges them."""
    per_stage = [0.0]
    for stage in plan.stages:
        rows = plan.global_batch_size / plan.num_microbatches / stage.replicas
        blocks = chain.blocks[stage.first_block:stage.stop_block]
        per_stage.append(plan.num_microbatches * sum(
            2 * collective_seconds(cluster, block.tp.comm_bytes.at(rows), stage.tensor_parallel)
            for block in blocks if block.tp is not None and splits(block, stage.tensor_parallel)))
    return max(per_stage)


def terms_row(name: str, plan: Plan | None, chain: CostChain, cluster: Cluster) -> list[object]:
    """One plan of the headline case: what its step time is made of."""
    if plan is None or plan.predicted is None:
        return [name, "infeasible", *["-"] * 7]
    choices = Counter(choice for stage in plan.stages for choice in stage.block_recompute)
    exposed, whole = zero_collectives(plan, chain, cluster)
    return [name, " ".join(describe(plan)[:2]), f"{plan.predicted.iteration_time_s:.2f}",
            f"{plan.predicted.bubble_fraction:.3f}", f"{tensor_parallel_seconds(plan, chain, cluster):.2f}",
            f"{exposed:.2f}", f"{whole:.2f}", " ".join(f"{count} {key}" for key, count in sorted(choices.items())),
            describe(plan)[3]]


def cell(plan: Plan | None) -> str:
    layout, levels, speed, peak = describe(plan)
    return layout if plan is None else f"{layout} ({levels}) {speed}/s, {peak} GiB"


def verdict(plans: Plans) -> str:
    value = speedup(plans)
    if value is not None:
        return f"{value:.3f}x"
    return "now feasible" if fastest(plans, "auto") is not None else "infeasible"


def grid_rows(sequences: Sequence[int], batches: Sequence[int]) -> tuple[list[list[object]], dict[int, dict[str, CostChain]]]:
    """One row per (sequence, batch): each precision's unsharded and auto plans, and the best-against-best ratio."""
    cluster, rows, chains = pcie_cluster(), [], {}
    for seq in sequences:
        chains[seq] = pcie_chains(seq, cluster)
        for batch in batches:
            start = time.perf_counter()
            plans = pcie_plans(chains[seq], cluster, batch)
            same = ratio(plans["bf16-params", "none"], plans["bf16-params", "auto"])
            rows.append([seq, batch, *(cell(plans[key]) for key in plans), verdict(plans),
                         f"{same:.3f}x" if same else "-", round(time.perf_counter() - start, 1),
                         round(os.getloadavg()[0], 1)])
            print(rows[-1], flush=True)
    return rows, chains


def sensitivity_rows(chains: dict[str, CostChain]) -> list[list[object]]:
    """The headline case with the GPU-to-GPU link and the device memory moved (the same chains: analytic block times
    depend on the device's rates only), then with the matmul rate lowered (costed again)."""
    rows: list[list[object]] = []
    settings = [(link, memory, None) for link in LINKS_GB_PER_S for memory in MEMORY_GIB]
    for link, memory, fraction in [*settings, (None, None, SXM_MATMUL_FRACTION)]:
        cluster = pcie_cluster(link, memory, fraction)
        costed = chains if fraction is None else pcie_chains(HEADLINE[0], cluster)
        plans = pcie_plans(costed, cluster, HEADLINE[1])
        rows.append([cluster.intra_host.bandwidth_bytes_per_s / 1e9, cluster.device.memory_bytes / GiB,
                     f"{fraction:.3f}" if fraction else "1 (peak)", cell(fastest(plans, "none")),
                     cell(fastest(plans, "auto")), verdict(plans)])
        print(rows[-1], flush=True)
    return rows


def pcie_report(command: str) -> str:
    """The whole study as markdown (prints progress as it goes)."""
    start = time.perf_counter()
    rows, chains = grid_rows(SEQUENCES, BATCHES)
    seq, batch = HEADLINE
    cluster = pcie_cluster()
    plans = pcie_plans(chains[seq], cluster, batch)
    names = {key: f"{key[0]} {'unsharded' if key[1] == 'none' else 'auto'}" for key in plans}
    terms = [terms_row(names[key], plan, chains[seq][key[0]], cluster) for key, plan in plans.items()]
    deep = plan_chain(chains[seq]["bf16"], cluster, batch, precision="bf16", sharding="none", layout=DEEP_PIPELINE)
    terms.append(terms_row(f"bf16 unsharded, layout {DEEP_PIPELINE} forced", deep, chains[seq]["bf16"], cluster))
    sensitivity = sensitivity_rows(chains[seq])
    return "\n".join([
        f"# {MODEL} on one 8-GPU H100 PCIe node (no NVLink): sharding at fine-tuning batches", "",
        f"Command: `{command}` (analytic costs, chains of {MAX_BLOCKS} blocks, {time.perf_counter() - start:.0f} s "
        "wall on a 2-core machine shared with other jobs; plan s is wall time, load the 1-minute load average). "
        "Source: benchmarks/sharding_pcie.py. Cluster: what `local:8` plans for on 8 \"NVIDIA H100 PCIe\" "
        "GPUs uncalibrated (the H100 PCIe datasheet preset, 20 GB/s GPU to GPU: fxpipe/core/hardware.py).", "",
        "Each cell: the planner's best plan (layout, micro-batches; levels per stage: - unsharded, Z1/Z2/Z3), its "
        "predicted samples/s and peak GiB per device. \"best auto vs best unsharded\" takes the faster precision on "
        "each side; the next column compares within bf16-params.", "",
        tabulate(rows, headers=["seq", "batch", *names.values(), "best auto vs best unsharded", "bf16-params auto vs unsharded",
                                "plan s", "load"], tablefmt="github"), "",
        f"Seq {seq}, batch {batch}: what each plan's step is made of, per device on its busiest stage (s per step; "
        "tensor-parallel collectives of forward and backward, a recomputed block's second forward not counted; ZeRO "
        "collectives left exposed beside compute, as the planner charges them, and whole; block recompute choices: "
        "keep, block, attention).", "",
        tabulate(terms, headers=["precision, sharding", "plan", "iteration s", "bubble", "TP collectives s",
                                 "ZeRO exposed s", "ZeRO whole s", "blocks", "peak GiB"], tablefmt="github"), "",
        f"Seq {seq}, batch {batch} with the GPU-to-GPU link, the device memory or the matmul rate moved (best over "
        "both precisions; the last row: the card's matmuls at the H100 SXM's achievable fraction of its peak).", "",
        tabulate(sensitivity, headers=["link GB/s", "memory GiB", "matmul rate / peak", "best unsharded", "best auto",
                                           "best auto vs best unsharded"], tablefmt="github"), ""])
