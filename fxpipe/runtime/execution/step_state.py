"""What one step (or forward-only pass) keeps between its actions, per micro-batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.runtime.execution.stage_routes import ShapedStep
from fxpipe.runtime.transport.comm import Pending


@dataclass
class StepState:
    """Everything one step keeps between actions, per micro-batch."""

    inputs: tuple[Any, ...]
    targets: Any
    shaped: ShapedStep  # the batch's layout: rows, routes and messages per micro-batch
    partial: bool = False  # inputs/targets hold only this replica's rows (RowMap), not the global batch
    received: dict[int, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    output_grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    input_grads: dict[int, dict[str, Any]] = field(default_factory=dict)
    sends: list[Pending] = field(default_factory=list)
    reductions: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = field(default_factory=list)
    # this rank's weighted slice losses and (loss_reduction="token_mean") counts, read once at the end
    loss_parts: list[torch.Tensor] = field(default_factory=list)
    count_parts: list[torch.Tensor | float] = field(default_factory=list)
    loss: float = 0.0  # the global batch's loss, once the step is finished
