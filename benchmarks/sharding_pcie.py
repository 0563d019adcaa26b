"""13B-class models on one 8-GPU H100 PCIe server (no NVLink): the best unsharded plan against sharding="auto" at
fine-tuning batches and long sequences, the terms that decide the headline cases, and how they move with the link,
the memory and the matmul rate.

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
from fxpipe.hf_examples import llama
from fxpipe.passes.partition.request import PlanningError
from fxpipe.planning import autocast_dtype, costed_model, model_loss, plan_chain
from fxpipe.sim.sharding_cost import plan_sharding_comms
from fxpipe.sim.sharding_memory import chain_in_precision
from fxpipe.sim.tensor_parallel_cost import block_collective_seconds, splits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.sharding_study import MAX_BLOCKS, GiB, describe, ratio  # noqa: E402

# The models, each with the sequence lengths it is planned at. gpt3-13b: the zoo's GPT-3 13B, whose attention is
# unfused (it materialises the T x T probabilities, memory-bound at long sequences). llama2-13b: Llama 2 13B's shape
# (40 layers, 5120 wide, 40 heads, MLP 13824, 32000 tokens: meta-llama/Llama-2-13b-hf's config.json) as Hugging Face's
# LlamaForCausalLM with its default SDPA attention (fxpipe.hf_examples.llama); 16384 tokens is Code Llama's long-context
# fine-tuning length (Roziere et al. 2023, "Code Llama: Open Foundation Models for Code", section 2.4).
SEQUENCES = {"gpt3-13b": (4096, 8192), "llama2-13b": (4096, 8192, 16384)}
# What `local:8` plans for on an 8x "NVIDIA H100 PCIe" server without calibration (fxpipe.core.cluster's
# _local_gpu_cluster, called here rather than copied): the H100 PCIe datasheet preset (hardware.H100_PCIE_80GB;
# its matmuls at the datasheet peak, no published achievable figure) and hardware.PCIE_GPU_P2P between GPUs (20 GB/s
# effective, the PCIe 4.0 x16 figure; the H100 PCIe card is PCIe 5.0, hence the link sensitivity below).
GPU_NAME = "NVIDIA H100 PCIe"
BATCHES = (8, 16, 32, 64)  # fine-tuning batches, in sequences
# fp32 master weights either way: bf16 autocast over them, or FSDP2's bf16 compute copies (docs/sharding.md)
PRECISIONS = ("bf16", "bf16-params")
# (model, sequence, global batch) of the cases the terms and sensitivity tables look at; the first is the test's
HEADLINES = (("llama2-13b", 16384, 16), ("gpt3-13b", 8192, 8))
LINKS_GB_PER_S = (10.0, 20.0, 40.0)  # half, the preset's and twice its GPU-to-GPU figure
MEMORY_GIB = (80.0, 79.25, 79.0)  # the preset's nominal 80 GiB, and a little less (torch reports under 80 GiB)
# The preset runs the PCIe card's matmuls at its datasheet peak; the H100 SXM's published achievable bf16 rate is this
# fraction of its peak (hardware.H100_MATMUL_FLOPS): the headline case is also planned with the PCIe card at it.
SXM_MATMUL_FRACTION = dict(H100_MATMUL_FLOPS)["bfloat16"] / H100_80GB.flops_per_s("bfloat16")
SHARDINGS = ("none", "auto")
LEVEL_NAMES = {"none": "unsharded", "auto": "auto"}
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


def pcie_chains(name: str, seq: int, cluster: Cluster) -> dict[str, CostChain]:
    """Model ``name``'s cost chain per precision at ``seq`` tokens (analytic costs on the meta device), costed once:
    costed_model reads a precision's autocast dtype only, bf16 for both (plan_chain adds bf16-params' copies). The
    Llama's loss is the documented estimate (fxpipe.passes.losscost), as in benchmarks/scale_study.py."""
    assert len({autocast_dtype(precision) for precision in PRECISIONS}) == 1, PRECISIONS
    if name == "llama2-13b":
        model, example_inputs = llama(num_layers=40, hidden=5120, heads=40, vocab_size=32000, seq_len=seq,
                                      batch_size=2, device="meta", intermediate=13824, kv_heads=40)
        loss = {}
    else:
        model, example_inputs = models.build(name, device="meta", block_size=seq)
        loss = model_loss(name, example_inputs)
    chain = costed_model(model, example_inputs, cluster, costs="analytic", max_blocks=MAX_BLOCKS,
                         precision=PRECISIONS[0], **loss).chain
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
            sum(block_collective_seconds(block, cluster, rows, stage.tensor_parallel))
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


Chains = dict[tuple[str, int], dict[str, CostChain]]  # (model, sequence) -> precision -> chain


def grid_rows(sequences: dict[str, Sequence[int]], batches: Sequence[int]) -> tuple[list[list[object]], Chains]:
    """One row per (model, sequence, batch): each precision's unsharded and auto plans, and the best-against-best
    ratio."""
    cluster, rows, chains = pcie_cluster(), [], {}
    for name, seq in ((name, seq) for name, lengths in sequences.items() for seq in lengths):
        chains[name, seq] = pcie_chains(name, seq, cluster)
        for batch in batches:
            start = time.perf_counter()
            plans = pcie_plans(chains[name, seq], cluster, batch)
            same = ratio(plans["bf16-params", "none"], plans["bf16-params", "auto"])
            rows.append([name, seq, batch, *(cell(plans[key]) for key in plans), verdict(plans),
                         f"{same:.3f}x" if same else "-", round(time.perf_counter() - start, 1),
                         round(os.getloadavg()[0], 1)])
            print(rows[-1], flush=True)
    return rows, chains


def sensitivity_rows(name: str, seq: int, batch: int, chains: dict[str, CostChain]) -> list[list[object]]:
    """A headline case with the GPU-to-GPU link and the device memory moved (the same chains: analytic block times
    depend on the device's rates only), then with the matmul rate lowered (costed again)."""
    rows: list[list[object]] = []
    settings = [(link, memory, None) for link in LINKS_GB_PER_S for memory in MEMORY_GIB]
    for link, memory, fraction in [*settings, (None, None, SXM_MATMUL_FRACTION)]:
        cluster = pcie_cluster(link, memory, fraction)
        costed = chains if fraction is None else pcie_chains(name, seq, cluster)
        plans = pcie_plans(costed, cluster, batch)
        rows.append([name, seq, batch, cluster.intra_host.bandwidth_bytes_per_s / 1e9, cluster.device.memory_bytes / GiB,
                     f"{fraction:.3f}" if fraction else "1 (peak)", cell(fastest(plans, "none")),
                     cell(fastest(plans, "auto")), verdict(plans)])
        print(rows[-1], flush=True)
    return rows


def terms_rows(name: str, seq: int, batch: int, chains: dict[str, CostChain]) -> list[list[object]]:
    """A headline case's plans, and the unsharded one without tensor parallelism (an 8-stage pipeline, forced)."""
    cluster = pcie_cluster()
    plans = pcie_plans(chains, cluster, batch)
    rows = [[name, seq, batch, *terms_row(f"{key[0]} {LEVEL_NAMES[key[1]]}", plan, chains[key[0]], cluster)]
            for key, plan in plans.items()]
    deep = plan_chain(chains["bf16"], cluster, batch, precision="bf16", sharding="none", layout=DEEP_PIPELINE)
    rows.append([name, seq, batch, *terms_row(f"bf16 unsharded, layout {DEEP_PIPELINE} forced", deep,
                                              chains["bf16"], cluster)])
    return rows


def pcie_report(command: str) -> str:
    """The whole study as markdown (prints progress as it goes)."""
    start = time.perf_counter()
    rows, chains = grid_rows(SEQUENCES, BATCHES)
    terms = [row for name, seq, batch in HEADLINES for row in terms_rows(name, seq, batch, chains[name, seq])]
    sensitivity = [row for name, seq, batch in HEADLINES
                   for row in sensitivity_rows(name, seq, batch, chains[name, seq])]
    case = ["model", "seq", "batch"]
    columns = [f"{precision} {LEVEL_NAMES[level]}" for precision in PRECISIONS for level in SHARDINGS]
    return "\n".join([
        "# 13B-class models on one 8-GPU H100 PCIe node (no NVLink): sharding at fine-tuning batches", "",
        f"Command: `{command}` (analytic costs, chains of {MAX_BLOCKS} blocks, {time.perf_counter() - start:.0f} s "
        "wall on a 2-core machine shared with other jobs; plan s is wall time, load the 1-minute load average). "
        "Source: benchmarks/sharding_pcie.py (its comments say what the models are). Cluster: what `local:8` plans "
        "for on 8 \"NVIDIA H100 PCIe\" GPUs uncalibrated (the H100 PCIe datasheet preset, 20 GB/s GPU to GPU: "
        "fxpipe/core/hardware.py).", "",
        "Each cell: the planner's best plan (layout, micro-batches; levels per stage: - unsharded, Z1/Z2/Z3, +rc "
        "whole-stage recompute), its predicted samples/s and peak GiB per device. \"best auto vs best unsharded\" "
        "takes the faster precision on each side; the next column compares within bf16-params.", "",
        tabulate(rows, headers=[*case, *columns, "best auto vs best unsharded", "bf16-params auto vs unsharded",
                                "plan s", "load"], tablefmt="github"), "",
        "The headline cases: what each plan's step is made of, per device on its busiest stage (s per step; "
        "tensor-parallel collectives of forward and backward, a recomputed block's second forward not counted; ZeRO "
        "collectives left exposed beside compute, as the planner charges them, and whole; per-block recompute "
        "choices: keep, block, attention).", "",
        tabulate(terms, headers=[*case, "precision, sharding", "plan", "iteration s", "bubble", "TP collectives s",
                                 "ZeRO exposed s", "ZeRO whole s", "blocks", "peak GiB"], tablefmt="github"), "",
        "The headline cases with the GPU-to-GPU link, the device memory or the matmul rate moved (best over both "
        "precisions; the last row of each: the card's matmuls at the H100 SXM's achievable fraction of its peak).", "",
        tabulate(sensitivity, headers=[*case, "link GB/s", "memory GiB", "matmul rate / peak", "best unsharded",
                                       "best auto", "best auto vs best unsharded"], tablefmt="github"), ""])
