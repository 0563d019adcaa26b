"""gpt3-13b on one 8-GPU H100 node (dgx-h100:1): the best unsharded plan against sharding="auto" over sequence
length and global batch, and the one-stage (pure FSDP) plan's memory and speed, which say why sharding buys little
here. Recompute is chosen per block on every stage, sharded and tensor-parallel ones included; ZeRO-2/3's per-unit
collectives overlap compute (fxpipe.sim.unit_overlap): the pure FSDP plan's collectives are listed exposed and whole.

Run: python benchmarks/sharding_study_13b.py --write   (writes benchmarks/sharding_study_13b.md; costing each
sequence length on the meta device takes about a minute, each pair of plans 10-60 s on a loaded 2-core machine)

With ``--pcie`` (writes benchmarks/sharding_study_13b_pcie.md instead; a few minutes): the same model on one 8-GPU
H100 PCIe server without NVLink, at fine-tuning batches and long sequences (benchmarks/sharding_pcie.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from tabulate import tabulate

from fxpipe import models
from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import parse_cluster
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import PlanningError
from fxpipe.planning import costed_model, model_loss, plan_chain
from fxpipe.sim.simulate import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.sharding_pcie import pcie_report, zero_collectives  # noqa: E402
from benchmarks.sharding_study import MAX_BLOCKS, GiB, describe, ratio  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/sharding_study_13b.py --write"
CLUSTER = "dgx-h100:1"
SEQUENCES = (2048, 4096)
BATCHES = (4, 8, 32, 128)
PRECISIONS = ("bf16", "fp32")  # fp32: no autocast, so matmuls at the fp32 rate and activations twice the bytes
# long context, where a row's activations (about 700 GiB at bf16) outgrow what any layout keeps: per-block recompute
EXTRA = (("bf16", 8192, (8, 32)),)


def chain_for(seq: int, precision: str) -> CostChain:
    model, example_inputs = models.build("gpt3-13b", device="meta", block_size=seq)
    return costed_model(model, example_inputs, parse_cluster(CLUSTER), costs="analytic", max_blocks=MAX_BLOCKS,
                        precision=precision, **model_loss("gpt3-13b", example_inputs)).chain


def fsdp_peak_gib(chain: CostChain, batch: int, recompute: str) -> str:
    """Peak GiB per device of the one-stage plan on all 8 GPUs, ZeRO-3 (per-block units, resharding after forward),
    one row per GPU per micro-batch: what pure FSDP needs under the planner's memory model. ``"never"``: no memory
    limit (the planner would keep the weights gathered there: the figure is the resharding stage's, simulated);
    ``"always"``: within the device, where a whole-stage checkpoint does not fit, so every block is recomputed
    inside its own unit."""
    cluster = parse_cluster(CLUSTER)
    limit = 2**60 if recompute == "never" else cluster.device.memory_bytes
    try:
        plan = partition(chain, cluster, batch, layout="dp", sharding="parameters", recompute=recompute,
                         memory_limit_bytes=limit, num_microbatches=batch // cluster.num_devices)
    except PlanningError:
        return "does not fit"
    freed = plan.with_updates(stages=tuple(replace(stage, reshard_after_forward=None) for stage in plan.stages))
    return f"{max(simulate(freed, chain, cluster).peak_memory_bytes) / GiB:.0f}"


def fsdp_speed(chain: CostChain, batch: int, precision: str) -> list[str]:
    """samples/s of the one-stage plan on all 8 GPUs, ZeRO-3, within the devices' memory (recompute as it chooses),
    its reshard_after_forward, and its collectives per step: left exposed beside compute, and whole (the charge on
    devices whose collectives block, as the model charged every cluster before)."""
    cluster = parse_cluster(CLUSTER)
    try:
        plan = plan_chain(chain, cluster, batch, precision=precision, layout="dp", sharding="parameters")
    except PlanningError:
        return ["infeasible", "-", "-"]
    assert plan.predicted is not None
    exposed, whole = zero_collectives(plan, chain, cluster)
    kept = {True: "freed", False: "kept", None: "-"}[plan.stages[0].reshard_after_forward]
    return [f"{plan.predicted.throughput_samples_per_s:.2f} (M={plan.num_microbatches}, {kept})",
            f"{exposed:.3f}", f"{whole:.3f}"]


def best(chain: CostChain, batch: int, sharding: str, precision: str):  # type: ignore[no-untyped-def]
    try:
        return plan_chain(chain, parse_cluster(CLUSTER), batch, precision=precision, sharding=sharding)
    except PlanningError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--pcie", action="store_true", help="the H100 PCIe node study instead (benchmarks/sharding_pcie.py)")
    args = parser.parse_args()
    if args.pcie:
        text = pcie_report(f"{COMMAND} --pcie")
        if args.write:
            RESULTS.with_name("sharding_study_13b_pcie.md").write_text(text)
        print(text)
        return
    rows, facts = [], []
    grid = [(p, q, BATCHES) for p in PRECISIONS for q in SEQUENCES] + list(EXTRA)
    for precision, seq, batches in grid:
        start = time.perf_counter()
        chain = chain_for(seq, precision)
        saved = sum(block.saved_bytes.per_sample for block in chain.blocks) / GiB
        state = 4 * sum(block.param_bytes for block in chain.blocks) / GiB
        facts.append([precision, seq, f"{state:.0f}", f"{saved:.1f}", fsdp_peak_gib(chain, 8, "never"),
                      fsdp_peak_gib(chain, 8, "always"), *fsdp_speed(chain, 32, precision),
                      round(time.perf_counter() - start, 1)])
        print(facts[-1], flush=True)
        for batch in batches:
            start = time.perf_counter()
            plain, auto = best(chain, batch, "none", precision), best(chain, batch, "auto", precision)
            value = ratio(plain, auto)
            rows.append([precision, seq, batch, *describe(plain), *describe(auto),
                         f"{value:.2f}x" if value else ("now feasible" if auto and not plain else "infeasible"),
                         round(time.perf_counter() - start, 1), round(os.getloadavg()[0], 1)])
            print(rows[-1], flush=True)
    text = [f"# gpt3-13b on {CLUSTER}: sharding over sequence length and batch", "",
            f"Command: `{COMMAND}` (analytic costs, chains of {MAX_BLOCKS} blocks; a 2-core machine "
            "shared with other jobs: plan s is wall time, load the 1-minute load average). Source: "
            "benchmarks/sharding_study_13b.py.", "",
            tabulate(rows, headers=["precision", "seq", "batch", "unsharded plan", "levels", "samples/s", "peak GiB", "auto plan",
                                    "levels", "samples/s", "peak GiB", "auto vs unsharded", "plan s", "load"],
                     tablefmt="github"), "",
            "One-stage plan on all 8 GPUs, ZeRO-3 with per-block units resharding after forward, batch 8 (one row per "
            "GPU per micro-batch): what pure FSDP needs under the planner's memory model (keep: no memory limit; "
            "recompute: within 80 GB, every block recomputed inside its FSDP unit); and the same plan's speed at batch "
            "32 within 80 GB, whether it keeps its weights from forward to backward, and its ZeRO-3 collectives per "
            "step, left exposed beside compute (now) and whole (as charged before).", "",
            tabulate(facts, headers=["precision", "seq", "Adam state GiB (16 B/param)", "saved activations GiB per row",
                                     "FSDP peak GiB, keep", "FSDP peak GiB, recompute", "FSDP samples/s, batch 32",
                                     "its ZeRO-3 collectives s/step, exposed", "whole", "cost+plan s"], tablefmt="github"), ""]
    if args.write:
        RESULTS.write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
