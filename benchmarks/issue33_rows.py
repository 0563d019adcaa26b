"""Issue 33's own table re-planned: Llama-3 70B and 8B shapes on the meta device, bf16, analytic costs, sharding auto.

Run: python benchmarks/issue33_rows.py --cache DIR   (traces two models: several minutes on a small machine;
``--cache`` keeps their cost graphs as benchmarks/scale_study.py does; the printed lines of one run are in
issue33_rows.md). Each line: fxpipe's plan with one stage per group and with ``virtual_stages="auto"`` (v, schedule
and the per-block recompute choices), the published layout forced at its published v, and the ratio of fxpipe's
``virtual_stages="auto"`` plan over it. Megatron-Bridge's 70B recipe on 64 GPUs (TP4 PP8 VP5) is also forced at v=1,
and planned again on a chain of one block per layer (80 + 2: 40 equal chunks need it; the default 64 cannot).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_study as study  # noqa: E402  (a sibling benchmark script)

from fxpipe.planning import plan_chain  # noqa: E402

LLAMA3_70B = study.Shape(80, 8192, 64, 8, 28672, 128256)
LLAMA3_8B = study.Shape(32, 4096, 32, 8, 14336, 128256)
CASES = (
    study.Case("Llama-3-70B", LLAMA3_70B, 4096, "96x8:h100", 384, study._stages(48, 8, 2), "42%", "issue 33"),
    study.Case("Llama-3-70B", LLAMA3_70B, 4096, "8x8:h100", 256, study._stages(2, 4, 8), "-",
               "issue 33: Megatron-Bridge, TP4 PP8 VP5", virtual_stages=5),
    study.Case("Llama-3-8B", LLAMA3_8B, 4096, "2x8:h100", 256, study._stages(8, 2, 1), "-", "issue 33"),
)


def print_row(case: study.Case, chain: study.CostChain, chain_s: float) -> None:
    """One case planned three ways (study.study_case), and a published layout with virtual stages also at v=1."""
    row = study.study_case(case, chain, chain_s)
    published = study.compact(case.layout) + (f" v={case.virtual_stages}" if case.virtual_stages > 1 else "")
    print(case.name, case.cluster, "GBS", case.global_batch_size, f"chain {len(chain.blocks)} blocks",
          f"| fxpipe v=1: {study.describe(row.planned, row.why[0])}",
          f"plan {row.planned_s:.1f} s ({row.planned_cpu_s:.1f} CPU)",
          f"| fxpipe v=auto: {study.describe(row.virtual, row.why[2], show_v=True)}",
          f"recompute [{study.recompute_choices(row.virtual)}]",
          f"plan {row.virtual_s:.1f} s ({row.virtual_cpu_s:.1f} CPU)",
          f"| forced {published}: {study.describe(row.forced, row.why[1])}",
          f"recompute [{study.recompute_choices(row.forced)}]",
          "| ratio", study.ratio(row), flush=True)
    if case.virtual_stages > 1:  # the same layout without its virtual stages
        flat, _, _, why = study._timed(partial(plan_chain, chain, row.cluster, case.global_batch_size,
                                               layout=case.layout, precision=study.PRECISION,
                                               sharding=study.SHARDING, sequence_parallel=study.SEQUENCE_PARALLEL))
        print("   forced", study.compact(case.layout), "v=1:", study.describe(flat, why),
              f"recompute [{study.recompute_choices(flat)}]", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cache", type=Path, help="a folder to keep traced chains in and reuse them from")
    args = parser.parse_args(argv)
    chains: dict[tuple[study.Shape, int, int], tuple[study.CostChain, float]] = {}  # the 70B rows share a model
    for case in CASES:
        # G x v equal chunks need a chain cut finely enough: about one block per layer (and the two ends)
        for max_blocks in (study.MAX_BLOCKS, case.shape.layers + 2)[:1 + (case.virtual_stages > 1)]:
            key = (case.shape, case.seq_len, max_blocks)
            if key not in chains:
                chains[key] = study.cached_chain(case, args.cache, max_blocks)
            print_row(case, *chains[key])


if __name__ == "__main__":
    main()
