"""Forward-only passes over the pipeline: ``evaluate`` (the global batch's loss) and ``predict`` (its outputs, on
every rank), run as the forward-only schedule under ``torch.no_grad``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.core import schedule as schedules
from fxpipe.core.program import tree_leaves
from fxpipe.runtime.execution.driver import PipelineDriver
from fxpipe.runtime.execution.stage import rebuild_tree
from fxpipe.runtime.execution.step_state import StepState
from fxpipe.runtime.transport.comm import (
    Pending,
    buffer_shape,
    check_header,
    header_view,
    pack,
    packed_bytes,
    unpack,
)
from fxpipe.runtime.transport.rows import RowMap

Op = schedules.Op


def evaluate(driver: PipelineDriver, inputs: tuple[Any, ...], targets: Any) -> float:
    """The loss of the global batch under the step's reduction rules, gradients untouched (collective)."""
    state = _run(driver, inputs, targets, keep_outputs=False)
    loss = driver.runner.evaluated_loss(*driver.reduce_loss(state))
    error = driver.runner.probe.take_error()  # an open loss probe checks evaluate's slices too
    if error is not None:
        raise error
    return loss


def predict(driver: PipelineDriver, inputs: tuple[Any, ...]) -> Any:
    """The model's output for the global batch, in the structure the model returns, on every rank (collective)."""
    state = _run(driver, inputs, None, keep_outputs=True)
    values = _gather_outputs(driver, state)
    return rebuild_tree(driver.program.output_tree, values)


@contextmanager
def _forward_only(driver: PipelineDriver) -> Iterator[None]:
    driver.forward_only = True
    try:
        with torch.no_grad():
            yield
    finally:
        driver.forward_only = False


def _run(driver: PipelineDriver, inputs: tuple[Any, ...], targets: Any, *, keep_outputs: bool) -> StepState:
    """Run this rank's forward-only actions; the last stage keeps its outputs (predict) or slice losses."""
    if driver.failures is not None:
        driver.failures.step_index += 1
    # predict ends without the loss allreduce, so its batch check cannot fold into one
    shaped = driver.begin(inputs, targets, fold=not keep_outputs)
    driver.inbox.start_step(shaped.forward_messages(), shaped.forward_actions.following)
    state = StepState(inputs, targets, shaped)
    driver.runner.reset()
    with _forward_only(driver):
        for action in shaped.forward_actions.actions:
            m = action.microbatch_index
            if action.op is Op.RECV_ACTIVATION:
                driver.recv_activation(state, m)
            elif action.op is Op.FORWARD:
                values, slice_targets, rows = driver.stage_inputs(state, m)
                outputs, loss, count = driver.runner.infer(values, slice_targets, rows, shaped.layout.num_rows)
                if loss is not None:
                    state.loss_parts.append(loss)
                    state.count_parts.append(count)
                if keep_outputs or not driver.is_last:
                    state.outputs[m] = outputs
            elif action.op is Op.SEND_ACTIVATION:
                driver.send_activation(state, m)
                del state.outputs[m]  # the sends hold what they still need: one micro-batch in flight
        driver.exchange.wait(state.sends)
        driver.inbox.verify()
    if driver.sharded is not None:  # ZeRO-1/2 keep gathered weights after forward; the optimizer updates shards
        driver.sharded.reshard()
    return state


def _gather_outputs(driver: PipelineDriver, state: StepState) -> dict[str, Any]:
    """Every output leaf of the global batch on every rank: each last-stage replica broadcasts its rows.

    Batched tensors are put together in global row order; an unbatched tensor or a Python object is the
    first replica's of the first micro-batch.
    """
    program, plan, layout = driver.program, driver.plan, state.shaped.layout
    last = plan.stages[-1]
    leaves = sorted(set(tree_leaves(program.output_tree)))
    tensors = [name for name in leaves if program.values[name].is_tensor]
    values: dict[str, Any] = {}
    for name in tensors:
        spec = program.values[name]
        shape = buffer_shape(layout.shapes[name], spec.batched, layout.num_rows, spec.batch_dim)
        dtype = layout.dtypes[name] or spec.dtype or torch.get_default_dtype()
        values[name] = torch.empty(shape, dtype=dtype, device=driver.context.device)
    for replica_index in range(last.replicas):  # a tensor-parallel replica's first member speaks for its group
        rank = last.replica_devices(replica_index)[0]
        rows = RowMap.split(layout.microbatch_ranges, replica_index, last.replicas)
        pieces = [(name, m, rows.per_microbatch[m]) for m in range(len(layout.microbatch_ranges)) for name in tensors
                  if program.values[name].batched or (m == 0 and replica_index == 0)]
        received = _broadcast_pieces(driver, state, rank, pieces)
        for (name, _, (start, stop)), piece in zip(pieces, received, strict=True):
            spec = program.values[name]
            target = values[name].narrow(spec.batch_dim, start, stop - start) if spec.batched else values[name]
            target.copy_(piece)
    objects = [name for name in leaves if not program.values[name].is_tensor]
    if objects:
        box = [{name: state.outputs[0][name] for name in objects} if driver.rank == last.devices[0] else None]
        if driver.context.world_size > 1:
            dist.broadcast_object_list(box, src=last.devices[0])
        values.update(box[0] or {})
    return values


def _broadcast_pieces(driver: PipelineDriver, state: StepState, source: int,
                      pieces: list[tuple[str, int, tuple[int, int]]]) -> list[torch.Tensor]:
    """``pieces`` (value, micro-batch, global rows) of last-stage replica ``source`` as one packed broadcast."""
    program, layout = driver.program, state.shaped.layout
    if driver.rank == source:
        own = [state.outputs[m][name] for name, m, _ in pieces]
        if driver.context.world_size == 1:
            return own
        _broadcast(driver, pack(own), source)
        return own
    layouts: list[tuple[tuple[int, ...], torch.dtype]] = []
    for name, _, (start, stop) in pieces:
        spec = program.values[name]
        layouts.append((buffer_shape(layout.shapes[name], spec.batched, stop - start, spec.batch_dim),
                        layout.dtypes[name] or spec.dtype or torch.get_default_dtype()))
    buffer = torch.empty(packed_bytes(layouts), dtype=torch.uint8, device=driver.context.device)
    _broadcast(driver, buffer, source)
    check_header(header_view(buffer, len(layouts)).tolist(), layouts, [name for name, _, _ in pieces],
                 f"rank {driver.rank}: broadcast of predict outputs from rank {source} (the last stage)")
    return unpack(buffer, layouts)


def _broadcast(driver: PipelineDriver, buffer: torch.Tensor, source: int) -> None:
    """One broadcast over all ranks, waited on as every transfer is (a dead or stalled rank is named)."""
    work = dist.broadcast(buffer, src=source, async_op=True)
    assert work is not None
    driver.exchange.wait([Pending(work, source, f"broadcast of predict outputs from rank {source}", buffer)])
