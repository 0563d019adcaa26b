"""Speed limits that used to be wall-clock asserts in unit tests (flaky on a loaded 2-core CI machine).

Run: ``python benchmarks/unit_speed.py`` (from the repository root). Prints one row per case with its
limit and exits 1 when a case is over its limit; the unit tests keep only the functional checks.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from fxpipe import models as zoo  # noqa: E402
from fxpipe.core.chain import build_chain  # noqa: E402
from fxpipe.passes import annotate_costs, trace  # noqa: E402


def _chain_of_ten_thousand_nodes() -> None:
    from test_chain import _long_graph

    graph = _long_graph(10_000)
    start = time.perf_counter()
    build_chain(graph, max_blocks=64)
    _report("build_chain, 10,000 nodes -> 64 blocks", time.perf_counter() - start, 2.0)


def _timed(label: str, limit_s: float, action: Callable[[], object]) -> None:
    start = time.perf_counter()
    action()
    _report(label, time.perf_counter() - start, limit_s)


FAILURES: list[str] = []


def _report(label: str, seconds: float, limit_s: float) -> None:
    verdict = "ok" if seconds < limit_s else "OVER"
    print(f"{label:<52} {seconds:8.2f} s   limit {limit_s:6.1f} s   {verdict}", flush=True)
    if seconds >= limit_s:
        FAILURES.append(label)


def main() -> int:
    torch.set_num_threads(1)
    _chain_of_ten_thousand_nodes()
    small_bert, small_inputs = zoo.build("bert-48", device="meta", num_layers=4)
    _timed("annotate_costs, bert-48 (4 layers) on meta", 60.0,
           lambda: annotate_costs(trace(small_bert, small_inputs)))
    bert, bert_inputs = zoo.build("bert-48", device="meta")
    _timed("trace, paper-size bert-48 on meta", 10.0, lambda: trace(bert, bert_inputs))
    traced = trace(bert, bert_inputs)
    _timed("annotate_costs, paper-size bert-48 on meta", 30.0, lambda: annotate_costs(traced))
    for name in (n for n in zoo.names() if zoo.get(n).paper_params is not None):
        _timed(f"zoo.build({name!r}, device='meta')", 20.0, lambda name=name: zoo.build(name, device="meta"))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    raise SystemExit(main())
