"""What both torch.distributed.pipelining benchmarks use (vs_torch_pipelining.py, vs_torch_schedules.py): the torch
side running fxpipe's own stage code under torch's PipelineStage and schedules, and one step of each system."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleavedZeroBubble,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import Workload, zero_grads  # noqa: E402


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


def build_torch_side(workload: Workload, stages: list[list[str]], schedule_name: str = "Schedule1F1B", *,
                     compiled: bool = False) -> TorchSide:
    """The same layer-cut stage code as fxpipe's, run by torch's PipelineStage + ``schedule_name``
    (``compiled``: the stage GraphModule under ``torch.compile`` with its defaults, as fxpipe's ``torch_compile=True``)."""
    from fxpipe.passes import trace
    from fxpipe.passes.codegen import split_stages

    model, example_inputs = workload.build()
    program = split_stages(trace(model, example_inputs), stages)
    rank, num_stages = dist.get_rank(), len(stages)
    stage = program.stages[rank]
    inner: Any = torch.compile(stage.module) if compiled else stage.module  # an OptimizedModule: a Module too
    adapter = StageAdapter(inner, _argument_order(program, rank), _last_output(program, rank))
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
