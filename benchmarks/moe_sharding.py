"""HF Mixtral-8x22B on H100 clusters of 6-14 nodes: the best unsharded plan against sharding="auto".

An MoE layer is the realistic block fxpipe can neither cut nor split: the tensor-parallel pass leaves fused
expert weights whole and there is no expert parallelism. At 2.5B parameters a layer holds 45 GiB of state under
bf16-params (18 B/param), so two never share an 80 GB device, and an unsharded plan needs a device per layer,
while ZeRO stages hold a share of many layers. This is where sharding can win beyond the twin argument of
benchmarks/sharding_study.md (a sharded stage's unsharded twin splits its layers over its replicas, which fails
when a replica would get less than one block).

Run: python benchmarks/moe_sharding.py --write   (analytic costs on the meta device, bf16-params, seq 4096;
costing each chain takes ~30 s, each plan a few seconds; writes benchmarks/moe_sharding.md)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from kept_notes import write_keeping_notes
from sharding_study import describe, ratio

from fxpipe.core.cluster import parse_cluster
from fxpipe.passes.partition.request import PlanningError
from fxpipe.planning import costed_model, plan_chain

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import short_layout  # noqa: E402

RESULTS = Path(__file__).with_name("moe_sharding.md")
PRECISION = "bf16-params"
SEQ = 4096
NODES = (6, 7, 8, 10, 12, 14)
BATCHES = (256, 512)
CHAIN_BLOCKS = (64, 128)  # 64: a block is one layer's MoE with the next layer's attention; 128: each apart


def mixtral_8x22b() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Mixtral-8x22B's published shape (56 layers, hidden 6144, 8 experts of 16384, 48 heads, 8 kv heads, vocab 32768)."""
    import transformers

    config = transformers.MixtralConfig(num_hidden_layers=56, hidden_size=6144, intermediate_size=16384,
                                        num_local_experts=8, num_experts_per_tok=2, num_attention_heads=48,
                                        num_key_value_heads=8, vocab_size=32768, max_position_embeddings=SEQ,
                                        router_jitter_noise=0.0)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    return model, {"input_ids": torch.zeros(2, SEQ, dtype=torch.long, device="meta")}


def rows(max_blocks: int) -> list[list[str]]:
    model, inputs = mixtral_8x22b()
    start = time.perf_counter()
    chain = costed_model(model, inputs, parse_cluster("8x8:h100"), costs="analytic", max_blocks=max_blocks,
                         precision=PRECISION).chain
    print(f"chain of {chain.num_blocks} blocks costed in {time.perf_counter() - start:.0f} s", flush=True)
    found = []
    for nodes in NODES:
        cluster = parse_cluster(f"{nodes}x8:h100")
        for batch in BATCHES:
            start = time.perf_counter()
            plans = []
            for sharding in ("none", "auto"):
                try:
                    plans.append(plan_chain(chain, cluster, batch, precision=PRECISION, sharding=sharding))
                except PlanningError:
                    plans.append(None)
            seconds = time.perf_counter() - start
            value = ratio(plans[0], plans[1])
            verdict = f"{value:.2f}x" if value else ("now feasible" if plans[1] and not plans[0] else "infeasible")
            unsharded, sharded = describe(plans[0]), describe(plans[1])
            found.append([str(chain.num_blocks), cluster.name, str(batch), short_layout(unsharded[0]), unsharded[2],
                          unsharded[3], short_layout(sharded[0]), sharded[1].split(",")[0], sharded[2], sharded[3],
                          verdict, f"{seconds:.1f}", f"{os.getloadavg()[0]:.1f}"])
            print(" | ".join(found[-1]), flush=True)
    return found


def main() -> None:
    from tabulate import tabulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args()
    found = [row for max_blocks in CHAIN_BLOCKS for row in rows(max_blocks)]
    headers = ["blocks", "cluster", "batch", "unsharded plan", "samples/s", "peak GiB", "auto plan",
               "first stage", "samples/s", "peak GiB", "auto vs unsharded", "plan s", "load"]
    text = (f"# {__doc__.splitlines()[0]}\n\nCommand: `python benchmarks/moe_sharding.py --write` (plan s: both "
            "plans, wall time on a 2-core machine; load: the 1-minute load average).\n\n"
            + tabulate(found, headers=headers, tablefmt="github") + "\n")
    print(text)
    if args.write:
        write_keeping_notes(RESULTS, text)


if __name__ == "__main__":
    main()
