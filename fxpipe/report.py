"""Human-readable tables of plans and simulations (what `fxpipe plan` and `fxpipe show` print)."""

from __future__ import annotations

import math
import sys

from tabulate import tabulate

from fxpipe.core.chain import CostChain
from fxpipe.core.cluster import Cluster
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.utilization import utilization_text
from fxpipe.sim.stagecost import backward_seconds

# What each ``predicted.cost_source`` means for the figure above it (how far off: docs/clusters.md).
COST_SOURCE_NOTES = {
    "measured": "measured (block times timed on this machine's ranks)",
    "analytic": "analytic (device model, not measured: optimistic; see docs/clusters.md, Honest predictions)",
    "profile": "profile (block times from the profile file)",
}


def format_bytes(num_bytes: float) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _device_ranges(devices: tuple[int, ...]) -> str:
    if not devices:
        return "-"
    parts: list[str] = []
    start = previous = devices[0]
    for device in (*devices[1:], None):
        if device is not None and device == previous + 1:
            previous = device
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if device is not None:
            start = previous = device
    return ",".join(parts)


def stage_table(plan: Plan, chain: CostChain | None = None, cluster: Cluster | None = None) -> str:
    """One row per stage: blocks, replicas, devices, forward/backward ms, gradient sync ms (the allreduce, or a
    sharded stage's collectives of the step), params, activations (kept or recomputed in backward, whose
    time then includes the forward again), sharding level, memory. With a tensor-parallel stage, a column T
    (each replica's group size) follows the replicas, and times, params and memory are one group member's."""
    capacity = cluster.device.memory_bytes if cluster is not None else 0
    grouped = any(stage.tensor_parallel > 1 for stage in plan.stages)
    rows = []
    for stage in plan.stages:
        if chain is not None:
            names = [b.name for b in chain.blocks[stage.first_block:stage.stop_block]]
            blocks = f"{stage.first_block}-{stage.stop_block - 1} ({names[0]}..{names[-1]})" if len(names) > 1 \
                else f"{stage.first_block} ({names[0]})"
        else:
            blocks = f"{stage.first_block}-{stage.stop_block - 1}"
        memory = format_bytes(stage.peak_memory_bytes)
        if capacity:
            memory += f" / {format_bytes(capacity)}"
        backward_s = backward_seconds(stage.forward_s, stage.backward_s, stage.recompute)
        rows.append([
            stage.stage_index, blocks, stage.replicas, *([stage.tensor_parallel] if grouped else []),
            _device_ranges(stage.devices),
            f"{stage.forward_s * 1e3:.2f}", f"{backward_s * 1e3:.2f}", f"{stage.allreduce_s * 1e3:.2f}",
            format_bytes(stage.param_bytes), format_bytes(stage.activation_bytes),
            "recompute" if stage.recompute else _per_block(stage.block_recompute), _level(stage), memory,
        ])
    headers = ["stage", "blocks", "replicas", *(["T"] if grouped else []), "devices", "fwd ms", "bwd ms", "allreduce ms",
               "params", "act/micro-batch", "activations", "sharding", "memory/device"]
    return str(tabulate(rows, headers=headers, tablefmt="simple"))


def _level(stage: StagePlan) -> str:
    """The sharding column: a ZeRO-3 stage says whether it frees its weights after forward or keeps them."""
    if stage.sharding != "parameters" or stage.reshard_after_forward is None:
        return stage.sharding
    return f"parameters ({'reshard' if stage.reshard_after_forward else 'kept'} after fwd)"


def summary_lines(plan: Plan) -> list[str]:
    lines = [
        f"plan {plan.layout}  planner={plan.planner}  schedule={plan.schedule} (warm-up {plan.warmup_policy})  "
        f"global batch={plan.global_batch_size}  micro-batches={plan.num_microbatches} "
        f"x {plan.microbatch_size} rows" + (f"  precision={plan.precision}" if plan.precision != "fp32" else "")
        + (f"  virtual stages={plan.virtual_stages} ({plan.chunk_layout}: {len(plan.stages)} chunks on "
           f"{plan.num_groups} groups)" if plan.chunk_groups else ""),
    ]
    predicted = plan.predicted
    if predicted is not None:
        speedup = predicted.speedup_over_dp  # NaN when DP was not evaluated (forced layout) or does not fit
        # DP here is data parallel on every device; a note may name a faster plan on fewer devices
        versus_dp = (f", {speedup:.2f}x the speed of data parallel on all {plan.num_devices} devices"
                     if math.isfinite(speedup) else ", not compared with data parallel (layout given, or it does not fit)")
        if plan.num_stages == 1 and plan.stages[0].tensor_parallel > 1:  # one stage of tensor-parallel groups
            stage = plan.stages[0]
            versus_dp = (f", {stage.replicas} replica(s) of {stage.tensor_parallel}-way tensor-parallel groups on "
                         f"{plan.world_size} of {plan.num_devices} devices" + (
                             f", {speedup:.2f}x the speed of data parallel" if math.isfinite(speedup) else ""))
        elif plan.num_stages == 1:  # the plan is data parallel: no speedup over itself to print
            unused = plan.num_devices and plan.world_size < plan.num_devices
            versus_dp = f", data parallel on {plan.world_size} of {plan.num_devices} devices" if unused else ""
        lines.append(f"predicted iteration {predicted.iteration_time_s * 1e3:.2f} ms, "
                     f"{predicted.throughput_samples_per_s:.1f} samples/s, bubble {predicted.bubble_fraction:.1%}"
                     + versus_dp)
        utilization = utilization_text(plan)
        if utilization:  # model FLOPs as Megatron counts them, over the datasheet peak (docs/glossary.md)
            lines.append(f"predicted {utilization} (peak {predicted.peak_flops_per_device / 1e12:.4g} TFLOP/s "
                         f"per device, {plan.world_size} devices)")
        if predicted.cost_source:
            lines.append(f"cost source: {COST_SOURCE_NOTES.get(predicted.cost_source, predicted.cost_source)}")
    if plan.planning_time_s > 0:  # a plan read from a file does not carry it (a fact of the run, not the plan)
        lines.append(f"planning time {plan.planning_time_s:.2f} s")
    lines += [f"note: {note}" for note in plan.notes]
    return lines


def baseline_table(plan: Plan) -> str:
    if not plan.baselines:
        return ""
    own = plan.predicted.iteration_time_s if plan.predicted else 0.0
    # v: model chunks per device group (docs/virtual_stages.md); the baselines plan one stage per group
    rows = [[plan.planner, plan.layout, plan.virtual_stages, plan.num_microbatches, f"{own * 1e3:.2f}", "1.00"]]
    for name, result in plan.baselines:
        if result.iteration_time_s is None:
            rows.append([name, result.layout or "-", 1, result.num_microbatches or "-", "infeasible", result.note])
            continue
        ratio = result.iteration_time_s / own if own > 0 else float("nan")
        rows.append([name, result.layout, 1, result.num_microbatches, f"{result.iteration_time_s * 1e3:.2f}",
                     f"{ratio:.2f}"])
    return str(tabulate(rows, headers=["planner", "layout", "v", "M", "iteration ms", "vs chosen"], tablefmt="simple"))


def print_plan(plan: Plan, verbose: bool | None) -> None:
    """``fxpipe.compile(..., verbose=)`` on rank 0: print :func:`format_plan` when True, or when None and stdout
    is a terminal (a script run by hand shows its plan; a job's log file or a test's capture does not)."""
    if verbose is None:
        verbose = sys.stdout.isatty()
    if verbose:
        print(format_plan(plan), flush=True)


def format_plan(plan: Plan, chain: CostChain | None = None, cluster: Cluster | None = None) -> str:
    parts = [*summary_lines(plan), "", stage_table(plan, chain, cluster)]
    table = baseline_table(plan)
    if table:
        parts += ["", table]
    return "\n".join(parts)


def _per_block(choices: tuple[str, ...]) -> str:
    """The activations column of a stage with per-block recompute: how many blocks take each choice."""
    if not choices:
        return "keep"
    return " ".join(f"{choices.count(c)} {c}" for c in ("attention", "block") if c in choices)
