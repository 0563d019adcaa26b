"""Evaluate and predict on virtual stages: the group's forwards alone, the loss or the last chunk's rows gathered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.core import schedule as schedules
from fxpipe.runtime.execution.stage import rebuild_tree

if TYPE_CHECKING:
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver, VirtualState


def _run(driver: VirtualDriver, inputs: tuple[Any, ...], targets: Any) -> VirtualState:
    """This rank's forward-only actions under no_grad (each forward's sends as the step posts them)."""
    state = driver.start(inputs, targets, forward_only=True)
    driver.forward_only = True
    try:
        with torch.no_grad():
            driver.run_actions(state, state.shaped.forward_actions, {schedules.Op.FORWARD: driver.forward})
        driver.finish_transfers(state)
        if driver.sharding is not None:
            driver.sharding.reshard()
    except BaseException as error:
        driver.mark_failed(error)
        raise
    finally:
        driver.forward_only = False
    return state


def evaluate(driver: VirtualDriver, inputs: tuple[Any, ...], targets: Any) -> float:
    """The loss of the global batch under the step's reduction rules, gradients untouched (collective)."""
    state = _run(driver, inputs, targets)
    loss = driver.runner.evaluated_loss(*driver.reduce_loss(state))
    error = driver.runner.probe.take_error()
    if error is not None:
        raise error
    return loss


def predict(driver: VirtualDriver, inputs: tuple[Any, ...]) -> Any:
    """The model's output for the global batch, in the structure the model returns, on every rank (collective).

    The last chunk's replicas each hold their rows of every micro-batch; every rank gathers them all (one
    all_gather_object) and joins them in row order."""
    state = _run(driver, inputs, None)
    last = driver.last_chunk
    mine = []
    if last in driver.chunks:
        for m, (start, stop) in enumerate(state.shaped.rows.per_microbatch):
            if stop > start:
                mine.append((start, {n: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                                     for n, v in state.outputs[last, m].items()}))
    gathered: list[Any] = [None] * driver.context.world_size
    dist.all_gather_object(gathered, mine)
    pieces = sorted((piece for part in gathered for piece in part), key=lambda piece: piece[0])
    starts = sorted({start for start, _ in pieces})
    by_start = {start: values for start, values in pieces}  # the members of a T-way group give the same piece
    values: dict[str, Any] = {}
    for name in driver.program.stages[last].output_values:
        spec = driver.program.values[name]
        parts = [by_start[start][name] for start in starts]
        if spec.is_tensor and spec.batched:
            values[name] = torch.cat(parts, spec.batch_dim).to(driver.context.device)
        else:
            values[name] = parts[0].to(driver.context.device) if isinstance(parts[0], torch.Tensor) else parts[0]
    return rebuild_tree(driver.program.output_tree, values)
