"""fxpipe's plans beside published H100 runs at their scale (Megatron-LM's weak-scaling table, Llama 3 405B).

Run: python benchmarks/scale_study.py --write   (writes benchmarks/scale_study.md; about 20 minutes on a loaded
2-core machine, most of it tracing and costing the six models; ``--cache DIR`` keeps their chains, so that a
second run only plans)

Each model is a Hugging Face Llama-style config built on the meta device (rotary attention, RMSNorm, a gated
MLP), costed once with the analytic device model in bf16 (``fxpipe.planning.costed_model``: autocast's dtypes,
matmuls at the H100 preset's achievable bf16 rate, fxpipe.core.hardware.H100_MATMUL_FLOPS, fp32 master weights and Adam state) and planned three
times on the same H100 cluster (8 GPUs per node, NVLink inside, 400 Gb/s per GPU between nodes): by fxpipe's
planner with one stage per device group and with ``virtual_stages="auto"`` (interleaved chunks where predicted
faster), and with the published configuration forced as a layout (``RxT`` per stage: R replicas of a T-way
tensor-parallel group; at the published virtual-stage count where the source gives one), each with
``sharding="auto"`` (Megatron's runs shard the optimizer state over data parallel ranks) and per-block recompute
where activations do not fit, and with sequence parallelism on tensor-parallel stages (``sequence_parallel=True``,
as the published runs use it and as ``fxpipe.compile(..., sequence_parallel=True)`` would run these plans).
MFU is model FLOPs as Megatron counts them (3 x the forward matmul FLOPs: 6N + 12 L h s per token) over the
devices x 989.5 TFLOP/s (docs/glossary.md); predictions come from the analytic model, not a measurement.

Megatron-LM's rows: the README's "training speed and scalability" table (H100, seq 4096, vocab 131072, DP 48 in
every row). Its model shapes are in an image (images/model_table.png) the tools of this study could not read;
the shapes here are GPT shapes (L layers of width h, MLP 4h, untied output head) chosen to land on the table's
parameter counts (the 177B row is the README's own "GPT-3 with a larger vocabulary"), as Llama-style blocks whose
gated MLP has width 8h/3 (rounded to 256: the same parameters and FLOPs as a 4h MLP). The global batch is 1,152
sequences, the README's stated batch for its 177B strong-scaling runs (24 sequences per data parallel rank).
Published MFU: 47% (7.1B) and 42% (70B) as issue 33 quotes the table; for the other rows only the README's text
("from 41% for the smallest model to 47-48% for the largest").

Llama 3 405B: the Llama 3 paper (arXiv 2407.21783, Table 4): TP8 CP1 PP16 on 8,192 GPUs (DP 64) at 430
TFLOP/s per GPU, 43% MFU, and on 16,384 GPUs (DP 128) at 400 TFLOP/s, 41%; seq 8192, 16M tokens per batch
(2,048 sequences); the model's published config (126 layers, 16384 wide, 128 heads, 8 KV heads, MLP 53248,
vocabulary 128256).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tabulate import tabulate

from fxpipe.core.block_recompute import BLOCK_CHOICES, effective_choices
from fxpipe.core.chain import CostChain, build_chain
from fxpipe.core.cluster import Cluster, parse_cluster
from fxpipe.core.hardware import H100_MATMUL_FLOPS
from fxpipe.core.plan import Plan
from fxpipe.core.utilization import model_flops_utilization, tokens_per_s_per_device
from fxpipe.hf_examples import llama
from fxpipe.passes.partition.request import PlanningError
from fxpipe.planning import costed_model, plan_chain

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/scale_study.py --write"
PRECISION = "bf16"
SHARDING = "auto"
SEQUENCE_PARALLEL = True  # Megatron's and Llama 3's runs shard norms and adds over the tokens too
MAX_BLOCKS = 64  # the default chain: at most 64 blocks, enough for 16 pipeline stages


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder: ``layers`` blocks of width ``hidden``, ``heads`` query and ``kv_heads`` KV heads."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


def gpt_shape(layers: int, hidden: int, heads: int, vocab: int = 131072) -> Shape:
    """A GPT's parameters and FLOPs as a Llama block: full attention heads, a gated MLP of width 8h/3 (to 256)."""
    return Shape(layers, hidden, heads, heads, round(8 * hidden / 3 / 256) * 256, vocab)


def num_params(shape: Shape) -> float:
    """Parameters: attention, MLP and norms per layer, the input embedding and the untied output head."""
    head_dim = shape.hidden // shape.heads
    attention = 2 * shape.hidden * shape.hidden + 2 * shape.hidden * head_dim * shape.kv_heads
    per_layer = attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    return shape.layers * per_layer + 2 * shape.vocab * shape.hidden + shape.hidden


@dataclass(frozen=True)
class Case:
    """One published run: the model, the cluster it ran on, its batch and layout, and its published MFU."""

    name: str
    shape: Shape
    seq_len: int
    cluster: str
    global_batch_size: int
    layout: str  # the published configuration in fxpipe's notation (PP stages of DP x TP)
    published_mfu: str
    source: str
    virtual_stages: int = 1  # the published run's model chunks per pipeline stage (Megatron's VP), where known


def _stages(replicas: int, tensor: int, pipeline: int) -> str:
    return ":".join([f"{replicas}x{tensor}"] * pipeline)


MEGATRON = "Megatron-LM README table"
LLAMA3 = "Llama 3 paper, Table 4"
LLAMA3_405B = Shape(126, 16384, 128, 8, 53248, 128256)
CASES = (
    Case("7.1B", gpt_shape(30, 4096, 32), 4096, "12x8:h100", 1152, _stages(48, 2, 1), "47%", MEGATRON),
    Case("70B", gpt_shape(84, 8192, 64), 4096, "96x8:h100", 1152, _stages(48, 8, 2), "42%", MEGATRON),
    Case("177B", gpt_shape(96, 12288, 96), 4096, "288x8:h100", 1152, _stages(48, 8, 6), "41-48%", MEGATRON),
    Case("314B", gpt_shape(96, 16384, 128), 4096, "384x8:h100", 1152, _stages(48, 8, 8), "41-48%", MEGATRON),
    Case("462B", gpt_shape(112, 18432, 144), 4096, "768x8:h100", 1152, _stages(48, 8, 16), "41-48%", MEGATRON),
    Case("Llama 3 405B", LLAMA3_405B, 8192, "1024x8:h100", 2048, _stages(64, 8, 16), "43%", LLAMA3),
    Case("Llama 3 405B", LLAMA3_405B, 8192, "2048x8:h100", 2048, _stages(128, 8, 16), "41%", LLAMA3),
)


@dataclass(frozen=True)
class Row:
    """One case: fxpipe's plans (one stage per group, and ``virtual_stages="auto"``) and the forced published layout
    at its published v (None: no plan; ``why`` says why: plan, forced, virtual), with timings."""

    case: Case
    cluster: Cluster
    chain_s: float  # tracing and costing the model once
    planned: Plan | None
    planned_s: float
    planned_cpu_s: float  # the machine is shared: CPU seconds say what planning itself took
    forced: Plan | None
    forced_s: float
    why: tuple[str, str, str] = ("", "", "")
    virtual: Plan | None = None  # virtual_stages="auto": v = 1 unless a virtual plan is predicted faster
    virtual_s: float = 0.0
    virtual_cpu_s: float = 0.0


def chain_for(case: Case) -> CostChain:
    """The case's model on the meta device, traced and costed in bf16 on its cluster's devices."""
    return cached_chain(case, None)[0]


def _timed(plan: Callable[[], Plan]) -> tuple[Plan | None, float, float, str]:
    """The plan (None and the reason when there is none), wall seconds and this process's CPU seconds."""
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        found: Plan | None = plan()
        why = ""
    except PlanningError as error:
        found, why = None, str(error).split("\n")[0]
    return found, time.perf_counter() - start, time.process_time() - cpu_start, why


def study_case(case: Case, chain: CostChain | None = None, chain_s: float = 0.0) -> Row:
    """Plan one case three ways (``chain``: the case's costed chain when already built)."""
    cluster = parse_cluster(case.cluster)
    if chain is None:
        start = time.perf_counter()
        chain = chain_for(case)
        chain_s = time.perf_counter() - start
    options: dict[str, Any] = {"precision": PRECISION, "sharding": SHARDING, "sequence_parallel": SEQUENCE_PARALLEL}
    planned, planned_s, planned_cpu_s, planned_why = _timed(
        lambda: plan_chain(chain, cluster, case.global_batch_size, **options))
    virtual, virtual_s, virtual_cpu_s, virtual_why = _timed(
        lambda: plan_chain(chain, cluster, case.global_batch_size, virtual_stages="auto", **options))
    forced, forced_s, _, forced_why = _timed(lambda: plan_chain(
        chain, cluster, case.global_batch_size, layout=case.layout, virtual_stages=case.virtual_stages, **options))
    return Row(case, cluster, chain_s, planned, planned_s, planned_cpu_s, forced, forced_s,
               (planned_why, forced_why, virtual_why), virtual, virtual_s, virtual_cpu_s)


def cached_chain(case: Case, cache: Path | None, max_blocks: int = MAX_BLOCKS) -> tuple[CostChain, float]:
    """The case's chain of at most ``max_blocks`` blocks and the seconds tracing and costing took, from ``cache``
    (a folder of pickles of the cost graph) when it has the model.

    Tracing and costing a 100-layer model takes minutes on a small machine, planning seconds: the cache lets the
    planner be rerun alone, and its cost graph is cut into a chain of any size again in under a second. Delete it
    when the cost model or the tensor-parallel pass changes."""
    shape, device = case.shape, case.cluster.rsplit(":", 1)[-1]  # costs depend on the device, not the node count
    name = (f"{shape.layers}x{shape.hidden}-h{shape.heads}kv{shape.kv_heads}-i{shape.intermediate}-v{shape.vocab}-"
            f"s{case.seq_len}-{device}.graph.pkl")
    path = None if cache is None else cache / name
    if path is not None and path.exists():
        with path.open("rb") as file:
            saved: dict[str, Any] = pickle.load(file)  # our own files, written below
    else:
        start = time.perf_counter()
        model, inputs = llama(num_layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                              vocab_size=shape.vocab, seq_len=case.seq_len, batch_size=2, device="meta",
                              intermediate=shape.intermediate, kv_heads=shape.kv_heads)
        costed = costed_model(model, inputs, parse_cluster(case.cluster), costs="analytic", precision=PRECISION)
        saved = {"graph": costed.cost_graph, "model_flops_per_sample": costed.chain.model_flops_per_sample,
                 "tokens_per_sample": costed.chain.tokens_per_sample, "seconds": time.perf_counter() - start}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("wb") as file:
                pickle.dump(saved, file)
    chain = replace(build_chain(saved["graph"], max_blocks=max_blocks),  # as costed_model cuts it
                    model_flops_per_sample=saved["model_flops_per_sample"], tokens_per_sample=saved["tokens_per_sample"])
    return chain, saved["seconds"]


def study(cases: Sequence[Case], progress: Callable[[str], None] = lambda _: None,
          cache: Path | None = None, max_blocks: int = MAX_BLOCKS) -> list[Row]:
    rows: list[Row] = []
    chains: dict[tuple[Shape, int], tuple[CostChain, float]] = {}  # both 405B rows share one chain
    for case in cases:
        key = (case.shape, case.seq_len)
        if key not in chains:
            chains[key] = cached_chain(case, cache, max_blocks)
        row = study_case(case, *chains[key])
        rows.append(row)
        progress(f"{case.name} on {case.cluster}: chain {row.chain_s:.0f} s, plan {row.planned_s:.1f} s "
                 f"({row.planned_cpu_s:.1f} s CPU), v=auto {row.virtual_s:.1f} s ({row.virtual_cpu_s:.1f} s CPU), "
                 f"forced {row.forced_s:.1f} s")
    return rows


def describe(plan: Plan | None, why: str = "", show_v: bool = False) -> list[str]:
    """Layout (v and schedule under virtual stages, or with ``show_v``), micro-batches and sharding levels,
    iteration seconds, bubble, MFU, tokens/s/GPU of a plan (or why there is none)."""
    if plan is None or plan.predicted is None:
        return [f"no plan ({why})" if why else "no plan", "-", "-", "-", "-"]
    mfu = model_flops_utilization(plan)
    tokens = tokens_per_s_per_device(plan)
    levels = sorted({stage.sharding for stage in plan.stages})
    virtual = f" v={plan.virtual_stages} {plan.schedule}" if show_v or plan.virtual_stages > 1 else ""
    return [f"{compact(plan.layout)}{virtual} M={plan.num_microbatches} ({','.join(levels)})",
            f"{plan.predicted.iteration_time_s:.2f}", f"{plan.predicted.bubble_fraction:.0%}",
            "-" if mfu is None else f"{mfu:.1%}", "-" if tokens is None else f"{tokens:,.0f}"]


def recompute_choices(plan: Plan | None) -> str:
    """How many of the plan's blocks (over all its stages or chunks) keep their activations, recompute the whole
    block, or recompute only attention's core (``StagePlan.block_recompute``); "-" without a plan."""
    if plan is None:
        return "-"
    counts = Counter(choice for stage in plan.stages for choice in effective_choices(
        stage.stop_block - stage.first_block, stage.recompute, stage.block_recompute))
    return ", ".join(f"{choice} {counts[choice]}" for choice in BLOCK_CHOICES if counts[choice])


def compact(layout: str) -> str:
    """A layout with runs of equal stages written once with their count: ``48x8:48x8:16`` -> ``48x8*2:16``."""
    runs: list[list[Any]] = []
    for stage in layout.split(":"):
        if runs and runs[-1][0] == stage:
            runs[-1][1] += 1
        else:
            runs.append([stage, 1])
    return ":".join(stage if count == 1 else f"{stage}*{count}" for stage, count in runs)


def fxpipe_plan(row: Row) -> Plan | None:
    """fxpipe's plan of the row: the ``virtual_stages="auto"`` one (it keeps v = 1 unless v > 1 is faster)."""
    return row.virtual if row.virtual is not None else row.planned


def _ratio(plan: Plan | None, other: Plan | None) -> str:
    if plan is None or other is None or plan.predicted is None or other.predicted is None:
        return "-"
    return f"{plan.predicted.iteration_time_s / other.predicted.iteration_time_s:.2f}"


def ratio(row: Row) -> str:
    """fxpipe's iteration over the forced layout's (at most 1: fxpipe's plan is no slower)."""
    return _ratio(fxpipe_plan(row), row.forced)


def table(rows: Sequence[Row]) -> str:
    body = []
    for row in rows:
        case = row.case
        published = compact(case.layout) + (f" v={case.virtual_stages}" if case.virtual_stages > 1 else "")
        body.append([case.name, f"{num_params(case.shape) / 1e9:.1f}", row.cluster.num_devices, case.seq_len,
                     case.global_batch_size, *describe(row.planned, row.why[0])[:2],
                     *describe(row.virtual, row.why[2], show_v=True), recompute_choices(row.virtual),
                     published + (f" (no plan: {row.why[1]})" if row.forced is None else ""),
                     *describe(row.forced)[1:4], case.published_mfu, ratio(row),
                     f"{row.planned_s:.1f} ({row.planned_cpu_s:.1f})", f"{row.virtual_s:.1f} ({row.virtual_cpu_s:.1f})",
                     f"{row.chain_s:.0f}"])
    headers = ["model", "params B", "GPUs", "seq", "batch", "fxpipe plan, v=1", "iter s", "fxpipe plan, v=auto",
               "iter s", "bubble", "MFU", "tokens/s/GPU", "blocks: recompute choice", "published layout", "iter s",
               "bubble", "MFU", "published MFU", "fxpipe / published", "plan s v=1 (CPU s)",
               "plan s v=auto (CPU s)", "trace+cost s"]
    return str(tabulate(body, headers=headers, tablefmt="github"))


def summary(rows: Sequence[Row]) -> list[str]:
    """Per row: fxpipe's plan no slower than the forced published layout, v=auto no slower than v=1, and each
    planning call within 60 s."""
    lines = []
    for row in rows:
        value = ratio(row)
        verdict = "no comparison" if value == "-" else ("met" if float(value) <= 1.0 + 1e-9 else "NOT met")
        own = _ratio(row.virtual, row.planned)
        speed = "met" if max(row.planned_s, row.virtual_s) < 60 else "NOT met"
        lines.append(f"- {row.case.name} on {row.cluster.num_devices} GPUs: no slower than published: {verdict} "
                     f"({value}); v=auto over v=1: {own}; planning under 60 s: {speed} (v=1 {row.planned_s:.1f} s "
                     f"wall, {row.planned_cpu_s:.1f} s CPU; v=auto {row.virtual_s:.1f} s wall, "
                     f"{row.virtual_cpu_s:.1f} s CPU)")
    return lines


LEFT_OUT = """What the predictions leave out, so that the forced published layouts predict well below their published
MFU: (1) interleaving in the published runs. Neither the Megatron-LM table nor the Llama 3 paper's Table 4 gives a
virtual-stage count, so their layouts are forced at v=1, and a forced PP16 with 24 micro-batches idles about
(16 - 1) / (24 + 16 - 1) of the time (the \"bubble\" column). fxpipe's own plans may take virtual stages
(``virtual_stages="auto"``, each device group at its own ZeRO level with per-block recompute on its chunks where
they do not fit); interleaving holds more micro-batches in flight per group, so a virtual plan recomputes more
blocks than the same groups at v=1, and on the rows where that costs more than the bubble saves it keeps v=1. (2) Overlap: each layer's tensor-parallel all-gather and reduce-scatter are added to its time (Megatron
overlaps them with --tp-comm-overlap). (3) The analytic device model: matmuls at the H100's achievable {matmul_tflops}
TFLOP/s, elementwise work by the roofline, no kernel fusion. The comparison between fxpipe's plan and the
forced layout is made under the same model, so these omissions weigh on both sides; the absolute MFU is the model's,
not a measurement."""


def reading(rows: Sequence[Row]) -> list[str]:
    """The figures' summary: targets met, and the predicted MFU of the published layouts beside the published one."""
    compared = [row for row in rows if ratio(row) != "-"]
    no_slower = [row for row in compared if float(ratio(row)) <= 1.0 + 1e-9]
    fast = [row for row in rows if max(row.planned_s, row.virtual_s) < 60]
    fast_cpu = [row for row in rows if max(row.planned_cpu_s, row.virtual_cpu_s) < 60]
    slowest = max((max(row.planned_s, row.virtual_s) for row in rows), default=0.0)
    forced = [model_flops_utilization(row.forced) for row in rows if row.forced is not None]
    known = [value for value in forced if value is not None]
    lines = [f"fxpipe's plan is no slower than the forced published layout on {len(no_slower)} of {len(rows)} rows "
             f"({len(compared)} with both plans); planning took under 60 s on {len(fast)} of {len(rows)} rows "
             f"(both calls; slowest {slowest:.0f} s, on a 2-core machine shared with "
             f"other jobs), and under 60 s of CPU time on {len(fast_cpu)} of {len(rows)}."]
    if known:
        lines.append(f"The published layouts predict {min(known):.0%}-{max(known):.0%} MFU under fxpipe's cost model, "
                     "against 41-48% published.")
    matmul_tflops = f"{dict(H100_MATMUL_FLOPS)['bfloat16'] / 1e12:g}"
    return [" ".join(lines), "", LEFT_OUT.format(matmul_tflops=matmul_tflops)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    parser.add_argument("--rows", default="", help="comma-separated row numbers (1-based) to run; default all")
    parser.add_argument("--cache", type=Path, help="a folder to keep traced chains in and reuse them from")
    parser.add_argument("--max-blocks", type=int, default=MAX_BLOCKS, help="blocks of each model's chain")
    args = parser.parse_args(argv)
    wanted = [int(text) - 1 for text in args.rows.split(",") if text] or range(len(CASES))
    reused = args.cache is not None and any(args.cache.glob("*.pkl"))  # chains traced by an earlier run
    start = time.perf_counter()
    rows = study([CASES[index] for index in wanted], lambda line: print(line, file=sys.stderr, flush=True),
                 args.cache, args.max_blocks)
    elapsed = time.perf_counter() - start
    flags = ((f" --rows {args.rows}" if args.rows else "") + (f" --cache {args.cache}" if args.cache else "")
             + (f" --max-blocks {args.max_blocks}" if args.max_blocks != MAX_BLOCKS else ""))
    cached = (" Chains came from --cache: traced and costed by an earlier run of this script at this commit (its "
              "\"trace+cost s\"); the wall time is planning." if reused else "")
    text = "\n".join([
        "# Scale study: fxpipe's plans beside published H100 runs", "",
        f"Command: `{COMMAND}{flags}` ({elapsed:.0f} s wall on a 2-core machine shared with other jobs). "
        f"Source: benchmarks/scale_study.py.{cached}", "",
        (__doc__ or "").split("\n\n", 1)[1].strip(), "",
        "Columns: \"fxpipe plan\" is the planner's layout (stages of `R` or `RxT`; `S*n`: n stages S in a row), "
        "its micro-batches and the sharding levels its stages use, with one stage per device group (v=1) and with "
        "`virtual_stages=\"auto\"` (its v and schedule; v=1 unless a virtual plan is predicted faster); \"iter s\" "
        "the predicted iteration, \"bubble\" its idle share; MFU and tokens/s/GPU from the v=auto plan; \"blocks: "
        "recompute choice\" how many of its blocks (over all stages or chunks) keep their activations, recompute "
        "the whole block, or only attention's core; \"published layout\" is the run's configuration forced (at its "
        "published v where the source gives one); \"fxpipe / published\" the ratio of the v=auto plan's "
        "predicted iteration over it (at most 1.00: fxpipe's plan is no slower); \"plan s\" each planning call's "
        "time (wall, and this process's CPU time: the machine is shared); \"trace+cost s\" building, tracing and "
        "costing the model once.", "",
        table(rows), "", "## Targets", "", *summary(rows), "", "## Reading", "", *reading(rows), ""])
    print(text)
    if args.write:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
