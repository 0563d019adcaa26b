"""What both torch.distributed.pipelining benchmarks use (vs_torch_pipelining.py, vs_torch_schedules.py): the torch
side running fxpipe's own stage code under torch's PipelineStage and schedules, and one step of each system."""

from __future__ import annotations

import copy
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
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
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
    """This rank's torch.distributed.pipelining stages, schedule and tied-gradient groups."""

    schedule: Any  # a torch.distributed.pipelining schedule (TORCH_SCHEDULES)
    modules: list[StageAdapter]  # this rank's stages, in ``stage_indices`` order
    parameters: list[torch.nn.Parameter]
    names: dict[int, str]
    # per tied weight held here: the ranks' process group (None: every copy is on this rank) and this rank's copies
    tied: list[tuple[Any, list[torch.nn.Parameter]]]
    stage_indices: tuple[int, ...]
    num_stages: int


# torch's schedules that run the same stages, one per rank: single-stage ones take the stage, the interleaved
# family a list of this rank's stages (here one).
TORCH_SCHEDULES: dict[str, tuple[Any, bool]] = {
    "Schedule1F1B": (Schedule1F1B, False), "ScheduleGPipe": (ScheduleGPipe, False),
    "ScheduleInterleavedZeroBubble": (ScheduleInterleavedZeroBubble, True),
}
# torch's schedules of several chunks per rank (chunks c, c + G, ... for a loop; g and 2G - 1 - g for ZBV's V)
TORCH_VIRTUAL_SCHEDULES: dict[str, tuple[Any, bool]] = {
    "ScheduleInterleaved1F1B": (ScheduleInterleaved1F1B, True), "ScheduleZBVZeroBubble": (ScheduleZBVZeroBubble, True),
}


def build_torch_side(workload: Workload, stages: list[list[str]], schedule_name: str = "Schedule1F1B", *,
                     compiled: bool = False, stage_indices: tuple[int, ...] | None = None) -> TorchSide:
    """The same layer-cut stage code as fxpipe's, run by torch's PipelineStage + ``schedule_name``
    (``compiled``: the stage GraphModule under ``torch.compile`` with its defaults, as fxpipe's ``torch_compile=True``;
    ``stage_indices``: the stages this rank runs, default its rank alone)."""
    from fxpipe.passes import trace
    from fxpipe.passes.codegen import split_stages

    model, example_inputs = workload.build()
    program = split_stages(trace(model, example_inputs), stages)
    rank, num_stages = dist.get_rank(), len(stages)
    indices = (rank,) if stage_indices is None else tuple(stage_indices)
    adapters, names = [], {}
    for index in indices:
        stage = program.stages[index]
        # stages of one program may share a tied Parameter object; torch's schedules (ZBV's split weight gradients)
        # need each stage's own copy, as on separate ranks: the tied sum below adds the copies
        module = copy.deepcopy(stage.module) if len(indices) > 1 else stage.module
        inner: Any = torch.compile(module) if compiled else module  # an OptimizedModule: a Module too
        adapters.append(StageAdapter(inner, _argument_order(program, index), _last_output(program, index)))
        names.update({id(module.get_parameter(path)): original for path, original in stage.param_names
                      if _is_parameter(module, path)})
    pipeline_stages = [PipelineStage(adapter, index, num_stages, torch.device("cpu"))
                       for adapter, index in zip(adapters, indices, strict=True)]
    schedule_cls, takes_list = (TORCH_SCHEDULES | TORCH_VIRTUAL_SCHEDULES)[schedule_name]
    if not takes_list and len(pipeline_stages) != 1:
        raise ValueError(f"{schedule_name} runs one stage per rank; rank {rank} was given stages {indices}")
    schedule = schedule_cls(pipeline_stages if takes_list else pipeline_stages[0], workload.num_microbatches,
                            loss_fn=workload.loss_fn())
    parameters = list(dict.fromkeys(p for adapter in adapters for p in adapter.parameters()))
    return TorchSide(schedule, adapters, parameters, names, _tied_groups(program, rank, indices, parameters, names),
                     indices, num_stages)


def _tied_groups(program: Any, rank: int, indices: tuple[int, ...], parameters: list[torch.nn.Parameter],
                 names: dict[int, str]) -> list[tuple[Any, list[torch.nn.Parameter]]]:
    """Per tied weight, the group of ranks holding a copy (every rank creates every group, in the same order;
    a stage's rank is found from every rank's stage list, gathered once) and this rank's copies."""
    placement: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(placement, indices)
    rank_of = {stage: r for r, stages in enumerate(placement) for stage in stages}
    tied = []
    for name, owners in sorted(program.tie_groups):
        ranks = sorted({rank_of[stage] for stage in owners})
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        copies = [p for p in parameters if names.get(id(p)) == name]
        if rank in ranks:
            tied.append((group, copies))
    return tied


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
    first, last = 0 in side.stage_indices, side.num_stages - 1 in side.stage_indices
    side.schedule.step(*(inputs if first else ()), **({"target": targets, "losses": []} if last else {}),
                       return_outputs=False)
    for group, copies in side.tied:  # the copies on this rank summed locally, then across the ranks holding one
        total = sum((p.grad if p.grad is not None else torch.zeros_like(p) for p in copies[1:]),
                    copies[0].grad if copies[0].grad is not None else torch.zeros_like(copies[0]))
        if group is not None:
            dist.all_reduce(total, group=group)
        for parameter in copies:
            parameter.grad = total if parameter is copies[0] else total.clone()


def fxpipe_step(pipe: Any, parameters: list[torch.nn.Parameter], inputs: tuple[Any, ...], targets: Any) -> None:
    zero_grads(parameters)
    pipe.step(inputs, targets)


def gradient_gap(pipe: Any, side: TorchSide) -> float:
    """Largest |fxpipe grad - torch grad| over this rank's parameters after one step of each."""
    fx_grads = {name: p.grad for name, p in pipe.named_parameters()}
    gap = 0.0
    for parameter in side.parameters:
        name = side.names[id(parameter)]
        if parameter.grad is not None and fx_grads.get(name) is not None:
            gap = max(gap, float((parameter.grad - fx_grads[name]).abs().max()))
    return gap
