"""A T=2 tensor-parallel stage on local CPU ranks: the planner's prediction vs measured iterations (issue 33 item 7).

Run: python benchmarks/tp_fidelity.py [--rounds 3] [--steps 10] [--warmup 3] [--pin] [--write]

The same measurement as benchmarks/small_fidelity.py (its ``_one_case``: ``fxpipe.compile(model, ..., plan=LAYOUT)``
with the default ``costs="auto"``, then warm-up and timed ``pipe.step`` + ``AdamW.step`` iterations behind a
barrier, rank 0's median), on 2 forked gloo ranks (1 thread each) for gpt-mini laid out as one stage of one
2-way tensor-parallel group (``1x2``: the graph pass splits its attention and MLP pairs and the vocabulary
head) and, as the control, as two data-parallel replicas (``dp``). "predicted" is the plan's
``predicted.iteration_time_s`` (the planner's T-way group costs, fxpipe/sim/tensor_parallel_cost.py, with the
runtime's fixed costs); the error is (measured - predicted) / measured, per round; the table gives medians.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    GPT_MINI_WIDTH,
    Workload,
    gpt_mini_width,
    machine_notes,
    median,
    run_ranks,
)
from benchmarks.kept_notes import write_keeping_notes  # noqa: E402
from benchmarks.rank_pinning import pin_rank  # noqa: E402
from benchmarks.small_fidelity import Case, _captured_planning, _one_case  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/tp_fidelity.py --write"
TARGET_ERROR = 0.20
GPT = Workload("gpt-mini", (), 8, 2)
CASES = (Case(GPT, "1x2"), Case(GPT, "dp"))
DEFAULT_WIDTH = GPT_MINI_WIDTH


def cases_for(widths: tuple[int, ...]) -> tuple[Case, ...]:
    """The T=2 stage and its data-parallel control for gpt-mini at each width (n_embd; one head per 32 channels
    beyond the default): wider blocks carry more compute per collective byte (rows x h^2 against rows x h)."""
    chosen: list[Case] = []
    for width in widths:
        workload = Workload(GPT.model, gpt_mini_width(width), GPT.global_batch_size, GPT.num_microbatches)
        chosen += [Case(workload, "1x2"), Case(workload, "dp")]
    return tuple(chosen)


def case_label(case: Case) -> str:
    width = dict(case.workload.overrides).get("n_embd", DEFAULT_WIDTH)
    return f"{case}{'' if width == DEFAULT_WIDTH else f' n_embd={width}'} local:2"


def tp_rank(rank: int, world_size: int, num_rounds: int, num_warmup: int, num_steps: int,
            pin: bool = False, cases: tuple[Case, ...] = CASES) -> list[list[dict[str, Any]]]:
    """Rounds of every case in turn (interleaved: a burst of load spoils one round of each); rank 0's figures.
    ``pin``: every thread of this rank on a core of its own, before the calibration and the steps."""
    if pin:
        pin_rank(rank)
    seen = _captured_planning()
    return [[_one_case(rank, case, num_warmup, num_steps, seen) for case in cases] for _ in range(num_rounds)]


def run(*, num_rounds: int = 3, num_warmup: int = 3, num_steps: int = 10, pin: bool = False,
        widths: tuple[int, ...] = (DEFAULT_WIDTH,)) -> dict[str, Any]:
    cases = cases_for(widths)
    rounds = run_ranks(tp_rank, 2, num_rounds, num_warmup, num_steps, pin, cases)[0]
    rows = []
    for index, case in enumerate(cases):
        per_round = [rounds[r][index] for r in range(num_rounds)]
        errors = [(x["iteration_s"] - x["predicted_s"]) / x["iteration_s"] for x in per_round]
        rows.append({"case": case_label(case), "rounds": per_round, "errors": errors, "error": median(errors),
                     "plan": per_round[0]["plan"],
                     **{key: median([x[key] for x in per_round]) for key in ("predicted_s", "iteration_s")}})
    return {"rows": rows, "num_rounds": num_rounds, "num_steps": num_steps, "num_warmup": num_warmup, "pin": pin,
            "widths": widths}


def report(result: dict[str, Any]) -> str:
    table = [[r["case"], r["plan"], f"{r['predicted_s'] * 1e3:.2f}", f"{r['iteration_s'] * 1e3:.2f}",
              f"{r['iteration_s'] / r['predicted_s']:.2f}", f"{r['error'] * 100:+.0f} %",
              " ".join(f"{e * 100:+.0f}" for e in r["errors"]), "yes" if abs(r["error"]) <= TARGET_ERROR else "NO",
              " ".join(f"{x['load']:.1f}" for x in r["rounds"]), " ".join(f"{x['stretch']:.2f}" for x in r["rounds"])]
             for r in result["rows"]]
    return "\n".join([
        "# Tensor-parallel fidelity: a T=2 stage's predicted vs measured iteration", "",
        f"Command: `{COMMAND} --rounds {result['num_rounds']} --steps {result['num_steps']} "
        f"--warmup {result['num_warmup']}{' --pin' if result['pin'] else ''}"
        f"{'' if result['widths'] == (DEFAULT_WIDTH,) else ' --widths ' + ','.join(map(str, result['widths']))}`", "",
        "Ranks' threads: " + ("each rank's on a core of its own (`--pin`)." if result["pin"]
                               else "placed by the OS scheduler (not pinned)."), "",
        f"Machine: {machine_notes()}.", "",
        tabulate(table, ["case", "plan", "predicted ms", "measured ms", "measured / predicted",
                         "error (meas - pred) / meas", "per-round errors %", f"within {TARGET_ERROR:.0%}",
                         "load per round", "wall/CPU at compile per round"], tablefmt="github"), "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=10, help="timed iterations per case and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before them")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    parser.add_argument("--pin", action="store_true",
                        help="pin every thread of each rank (gloo's included) to a core of its own")
    parser.add_argument("--widths", default=str(DEFAULT_WIDTH),
                        help="gpt-mini widths (n_embd) to run the T=2 stage and its control at, comma-separated")
    parser.add_argument("--cached", action="store_true",
                        help="plan with the calibration cache as it is (default: calibrate afresh, as the steps run)")
    args = parser.parse_args(argv)
    if not args.cached:  # the figures of this moment's load, not of whenever the shared cache was written
        os.environ["FXPIPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxpipe-calibration-")
    text = report(run(num_rounds=args.rounds, num_warmup=args.warmup, num_steps=args.steps, pin=args.pin,
                      widths=tuple(int(width) for width in args.widths.split(","))))
    print(text)
    if args.write:
        write_keeping_notes(RESULTS, text)


if __name__ == "__main__":
    main()
