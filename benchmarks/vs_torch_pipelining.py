"""fxpipe vs torch.distributed.pipelining (Schedule1F1B) on the same GPT stages: throughput and activation memory.

Run: python benchmarks/vs_torch_pipelining.py [--steps 10] [--warmup 2] [--write]

Fairness: both systems run the very same stage code. fxpipe's codegen splits the traced GPT at
transformer-block boundaries; torch.distributed.pipelining gets an identical, separately built copy of
each stage GraphModule wrapped in ``PipelineStage`` (manual stages, so both trace the same graph once and
only the runtimes differ). Both run synchronous 1F1B with the same warm-up (torch ``Schedule1F1B``:
min(M, S - s) forwards; fxpipe early-backward policy A: the same), the same micro-batches, and sum the
tied embedding / LM-head gradient across its two owner stages (fxpipe does it itself; for torch an
all-reduce over the two owners follows ``schedule.step``). Gradients are zeroed (set to None) in both
steps; no optimizer step is timed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleavedZeroBubble,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    ActivationMeter,
    Workload,
    bench_main,
    compile_fxpipe,
    interleaved,
    machine_notes,
    median,
    mib,
    run_ranks,
    stage_names,
    zero_grads,
)

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/vs_torch_pipelining.py --write"
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 32, 8)


class StageAdapter(torch.nn.Module):
    """A codegen stage GraphModule with torch.distributed.pipelining's calling convention.

    Torch passes the previous stage's outputs positionally, in that stage's output order; the last
    stage returns the bare model output (the loss function's first argument).
    """

    def __init__(self, module: torch.nn.Module, argument_order: list[int], output_tree: Any) -> None:
        super().__init__()
        self.module = module
        self.argument_order = argument_order
        self.output_tree = output_tree

    def forward(self, *args: Any) -> Any:
        outputs = self.module(*(args[i] for i in self.argument_order))
        return outputs if self.output_tree is None else outputs[0]


@dataclass
class TorchSide:
    """This rank's torch.distributed.pipelining stage, schedule and tied-gradient group."""

    schedule: Any  # a torch.distributed.pipelining schedule (TORCH_SCHEDULES)
    module: StageAdapter
    parameters: list[torch.nn.Parameter]
    names: dict[int, str]
    tied: list[tuple[Any, list[torch.nn.Parameter]]]  # (process group of the owner stages, their params)
    stage_index: int
    num_stages: int


# torch's schedules that run the same stages (one per rank): single-stage ones take the stage, the
# interleaved family a list of this rank's stages (here one; ZBV needs two per rank, so it does not apply).
TORCH_SCHEDULES: dict[str, tuple[Any, bool]] = {
    "Schedule1F1B": (Schedule1F1B, False), "ScheduleGPipe": (ScheduleGPipe, False),
    "ScheduleInterleavedZeroBubble": (ScheduleInterleavedZeroBubble, True),
}


def build_torch_side(workload: Workload, stages: list[list[str]], schedule_name: str = "Schedule1F1B") -> TorchSide:
    """The same layer-cut stage code as fxpipe's, run by torch's PipelineStage + ``schedule_name``."""
    from fxpipe.passes import trace
    from fxpipe.passes.codegen import split_stages

    model, example_inputs = workload.build()
    program = split_stages(trace(model, example_inputs), stages)
    rank, num_stages = dist.get_rank(), len(stages)
    stage = program.stages[rank]
    adapter = StageAdapter(stage.module, _argument_order(program, rank), _last_output(program, rank))
    pipeline_stage = PipelineStage(adapter, rank, num_stages, torch.device("cpu"))
    schedule_cls, takes_list = TORCH_SCHEDULES[schedule_name]
    schedule = schedule_cls([pipeline_stage] if takes_list else pipeline_stage, workload.num_microbatches,
                            loss_fn=workload.loss_fn())
    names = {id(stage.module.get_parameter(path)): original for path, original in stage.param_names
             if _is_parameter(stage.module, path)}
    parameters = list(dict.fromkeys(adapter.parameters()))
    tied = []
    for owners in sorted({tuple(sorted(owners)) for _, owners in program.tie_groups}):
        group = dist.new_group(list(owners))  # every rank creates every group, in the same order
        shared = {name for name, stages in program.tie_groups if tuple(sorted(stages)) == owners}
        if rank in owners:
            tied.append((group, [p for p in parameters if names.get(id(p)) in shared]))
    return TorchSide(schedule, adapter, parameters, names, tied, rank, num_stages)


def _is_parameter(module: torch.nn.Module, path: str) -> bool:
    owner_path, _, attribute = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return owner._parameters.get(attribute) is not None


def _argument_order(program: Any, stage_index: int) -> list[int]:
    """Where each of this stage's inputs sits among the previous stage's outputs (what torch passes)."""
    stage = program.stages[stage_index]
    if stage_index == 0:
        return list(range(len(stage.input_values)))
    previous = list(program.stages[stage_index - 1].output_values)
    missing = [name for name in stage.input_values if name not in previous]
    if missing:
        raise ValueError(f"stage {stage_index} reads {missing}, which stage {stage_index - 1} does not output; "
                         "torch's PipelineStage passes only adjacent-stage values; cut elsewhere")
    return [previous.index(name) for name in stage.input_values]


def _last_output(program: Any, stage_index: int) -> Any:
    if stage_index != len(program.stages) - 1:
        return None
    if not isinstance(program.output_tree, str):
        raise ValueError(f"model output {program.output_tree!r} is not a single tensor; the benchmark's loss "
                         "adapter handles single-tensor outputs only")
    return program.output_tree


def torch_step(side: TorchSide, inputs: tuple[Any, ...], targets: Any) -> None:
    """One torch.distributed.pipelining iteration plus the tied-gradient sum fxpipe also does."""
    zero_grads(side.parameters)
    if side.stage_index == 0:
        side.schedule.step(*inputs, return_outputs=False)
    elif side.stage_index == side.num_stages - 1:
        side.schedule.step(target=targets, losses=[], return_outputs=False)
    else:
        side.schedule.step(return_outputs=False)
    for group, parameters in side.tied:
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, group=group)


def fxpipe_step(pipe: Any, parameters: list[torch.nn.Parameter], inputs: tuple[Any, ...], targets: Any) -> None:
    zero_grads(parameters)
    pipe.step(inputs, targets)


def _gradient_gap(pipe: Any, side: TorchSide) -> float:
    """Largest |fxpipe grad - torch grad| over this rank's parameters after one step of each."""
    fx_grads = {name: p.grad for name, p in pipe.named_parameters()}
    gap = 0.0
    for parameter in side.parameters:
        name = side.names[id(parameter)]
        if parameter.grad is not None and fx_grads.get(name) is not None:
            gap = max(gap, float((parameter.grad - fx_grads[name]).abs().max()))
    return gap


def throughput_rank(rank: int, world_size: int, workload: Workload, num_warmup: int,
                    num_steps: int) -> dict[str, Any]:
    """Both systems on this rank's stage, stepped alternately; per-step seconds of each."""
    stages = stage_names(workload, world_size)
    pipe = compile_fxpipe(workload, world_size)
    side = build_torch_side(workload, stages)
    inputs, targets = workload.batch()
    fx_params = list(pipe.parameters())
    steps = {"fxpipe": lambda: fxpipe_step(pipe, fx_params, inputs, targets),
             "torch": lambda: torch_step(side, inputs, targets)}
    times = interleaved(steps, num_warmup, num_steps)
    return {"times": times, "gradient_gap": _gradient_gap(pipe, side)}


def memory_rank(rank: int, world_size: int, workload: Workload, num_steps: int) -> dict[str, int]:
    """Peak bytes autograd saves for backward on this rank's stage, per system (hooks around whole steps)."""
    stages = stage_names(workload, world_size)
    pipe = compile_fxpipe(workload, world_size)
    side = build_torch_side(workload, stages)
    inputs, targets = workload.batch()
    fx_params = list(pipe.parameters())
    meters = {"fxpipe": ActivationMeter.for_parameters(fx_params),
              "torch": ActivationMeter.for_parameters(side.parameters)}
    steps = {"fxpipe": lambda: fxpipe_step(pipe, fx_params, inputs, targets),
             "torch": lambda: torch_step(side, inputs, targets)}
    for _ in range(num_steps):
        for name, step in steps.items():
            with meters[name].measure():
                step()
            dist.barrier()
    return {name: meter.peak_bytes for name, meter in meters.items()}


def run(workload: Workload, *, throughput_ranks: int = 2, memory_ranks: int = 4, num_warmup: int = 2,
        num_steps: int = 10) -> dict[str, Any]:
    """Measure both; returns the figures (times by rank, peak saved bytes by rank, gradient gaps)."""
    throughput = run_ranks(throughput_rank, throughput_ranks, workload, num_warmup, num_steps)
    memory = run_ranks(memory_rank, memory_ranks, workload, 2)
    times = throughput[0]["times"]
    fx_s, torch_s = median(times["fxpipe"]), median(times["torch"])
    return {"workload": workload, "throughput_ranks": throughput_ranks, "memory_ranks": memory_ranks,
            "num_steps": num_steps, "fxpipe_s": fx_s, "torch_s": torch_s, "times": times,
            "throughput_ratio": torch_s / fx_s, "memory": memory,
            "paired_ratio": median([t / f for f, t in zip(times["fxpipe"], times["torch"], strict=True)]),
            "gradient_gap": max(r["gradient_gap"] for r in throughput)}


def report(result: dict[str, Any]) -> str:
    """The results page (markdown)."""
    workload: Workload = result["workload"]
    batch = workload.global_batch_size
    rows = [["fxpipe (early backward, policy A)", f"{result['fxpipe_s'] * 1e3:.1f}", f"{batch / result['fxpipe_s']:.1f}",
             f"{min(result['times']['fxpipe']) * 1e3:.1f}"],
            ["torch.distributed.pipelining Schedule1F1B", f"{result['torch_s'] * 1e3:.1f}",
             f"{batch / result['torch_s']:.1f}", f"{min(result['times']['torch']) * 1e3:.1f}"]]
    memory_rows = [[s, mib(m["fxpipe"]), mib(m["torch"]), f"{m['fxpipe'] / max(m['torch'], 1):.3f}"]
                   for s, m in enumerate(result["memory"])]
    ratio = result["throughput_ratio"]
    worst = max(m["fxpipe"] / max(m["torch"], 1) for m in result["memory"])
    return "\n".join([
        "# fxpipe vs torch.distributed.pipelining", "",
        f"Command: `{COMMAND}`", "", f"Workload: {workload.describe()}.", "",
        f"Machine: {machine_notes()}.", "",
        f"## Throughput ({result['throughput_ranks']} ranks x 1 thread, median of {result['num_steps']} "
        "interleaved steps after warm-up)", "",
        tabulate(rows, ["system", "median step ms", "samples/s", "best step ms"], tablefmt="github"), "",
        f"fxpipe throughput / torch throughput = **{ratio:.3f}** (target >= 1.0: "
        f"{'met' if ratio >= 1.0 else 'MISSED'}); median of per-round ratios (each round runs both back to back) "
        f"{result['paired_ratio']:.3f}. Largest gradient difference between the two after a step: "
        f"{result['gradient_gap']:.2e} (same computation).", "",
        f"## Peak activation memory per stage ({result['memory_ranks']} ranks)", "",
        "Bytes autograd holds for backward, counted with `torch.autograd.graph.saved_tensors_hooks` around "
        "each whole step on both systems: unique storages alive at the peak, parameters excluded.", "",
        tabulate(memory_rows, ["stage", "fxpipe MiB", "torch MiB", "fxpipe / torch"], tablefmt="github"), "",
        f"Worst stage ratio fxpipe / torch = **{worst:.3f}** (target <= 1.0: {'met' if worst <= 1.0 else 'MISSED'}).",
        "", __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    from benchmarks import vs_torch_schedules  # it imports this module's torch side

    def run_and_report(warmup: int, steps: int) -> str:
        first = report(run(DEFAULT_WORKLOAD, num_warmup=warmup, num_steps=steps))
        return first + "\n" + vs_torch_schedules.run_and_report(warmup, steps)

    bench_main(argv, __doc__, RESULTS, run_and_report, steps=10, warmup=2)


if __name__ == "__main__":
    main()
