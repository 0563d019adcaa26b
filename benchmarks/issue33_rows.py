"""Issue 33's own table re-planned: Llama-3 70B and 8B shapes on the meta device, bf16, analytic costs, sharding auto.

Run: python benchmarks/issue33_rows.py   (traces two models: several minutes on a small machine; the printed
lines of one run are in issue33_rows.md). Each line: fxpipe's plan, the forced published layout, their ratio.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_study as study  # noqa: E402  (a sibling benchmark script)

LLAMA3_70B = study.Shape(80, 8192, 64, 8, 28672, 128256)
LLAMA3_8B = study.Shape(32, 4096, 32, 8, 14336, 128256)
CASES = (
    study.Case("Llama-3-70B", LLAMA3_70B, 4096, "96x8:h100", 384, study._stages(48, 8, 2), "42%", "issue 33"),
    study.Case("Llama-3-70B", LLAMA3_70B, 4096, "8x8:h100", 256, study._stages(2, 4, 8), "-",
               "issue 33 (TP4 PP8; VP5 not modelled)"),
    study.Case("Llama-3-8B", LLAMA3_8B, 4096, "2x8:h100", 256, study._stages(8, 2, 1), "-", "issue 33"),
)


def main() -> None:
    chains: dict[tuple[study.Shape, int], tuple[object, float]] = {}
    for case in CASES:
        key = (case.shape, case.seq_len)
        if key not in chains:
            start = time.perf_counter()
            chains[key] = (study.chain_for(case), time.perf_counter() - start)
        chain, chain_s = chains[key]
        row = study.study_case(case, chain, chain_s)  # type: ignore[arg-type]
        print(case.name, case.cluster, "GBS", case.global_batch_size,
              "| fxpipe:", study.describe(row.planned, row.why[0]),
              f"plan {row.planned_s:.1f} s ({row.planned_cpu_s:.1f} CPU)",
              "| forced", study.compact(case.layout), study.describe(row.forced, row.why[1]),
              "| ratio", study.ratio(row), flush=True)


if __name__ == "__main__":
    main()
