"""The front door's tensor-parallel wiring for virtual stages: every chunk of this rank sharded for its group member."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.compile_tensor_parallel import group_key, release_unsharded, shard_for_member, use_parallel_loss
from fxpipe.passes.tensor_parallel_ops import register_group
from fxpipe.runtime.execution.stage import unique_params
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.faults.guard import release_group, setup_group, setup_phase
from fxpipe.runtime.parallel.tensor_parallel import GroupCommunicator, TensorParallelParam, check_tied_alike

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram, StageProgram
    from fxpipe.runtime.execution.stage import StageRunner
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver
    from fxpipe.runtime.parallel.tensor_parallel import TensorParallelGroups

Held = list[tuple[int, dict[str, TensorParallelParam]]]  # per chunk of this rank: its parameters by original name


@dataclass(frozen=True)
class ChunkView:
    """What use_parallel_loss reads of a driver, for the last chunk: its program, runner and group."""

    stage: StageProgram
    program: SplitProgram
    runner: StageRunner
    tensor_parallel: TensorParallelGroups


def shard_virtual_chunks(driver: VirtualDriver, traced: torch.nn.Module | None = None,
                         sequence_parallel: bool = False) -> GroupCommunicator | None:
    """Shard every chunk of this rank over its T-way group (fxpipe.compile_tensor_parallel's pass, per chunk); returns
    the group's communicator (None at T = 1). The unsharded chunks' parameters become placeholders. Under
    ``sequence_parallel`` each chunk runs its norms and adds on token shares but takes and gives whole values at
    its ends (token-share boundaries between chunks: not yet).

    Every rank of a plan with tensor-parallel groups calls it (one setup phase, then one gather checking that tied
    weights are split alike): after the parameter sync, which runs on whole tensors, and before torch.compile and
    sharding over the replicas (both work on the shards)."""
    if all(stage.tensor_parallel == 1 for stage in driver.plan.stages):
        return None
    groups = driver.tensor_parallel
    made = GroupCommunicator(groups.group, groups.degree, groups.member, exchange=driver.exchange) \
        if groups.degree > 1 else None
    held: Held = [(chunk, {}) for chunk in driver.chunks]  # T = 1 here: every chunk holds its weights whole
    setup = setup_group()
    try:
        with setup_phase("tensor-parallel sharding", setup):
            if made is not None:
                held = _shard_each(driver, made, sequence_parallel)
                modules = [stage.module for stage in driver.program.stages]
                for chunk in driver.chunks:  # after every shard is cut: two chunks of a V may share a tied weight
                    release_unsharded(driver.program.stages[chunk], modules, traced)
    finally:
        release_group(setup)
    check_tied_alike(held, driver.program.tie_groups)
    driver.tp_params = {name: param for _, params in held for name, param in params.items()}
    driver.partial_grads = frozenset(name for name, param in driver.tp_params.items() if param.partial)
    driver.tp_communicator = made
    driver.named = driver.summed = unique_params(item for c in driver.chunks for item in driver.runners[c].parameters())
    return made


def _shard_each(driver: VirtualDriver, made: GroupCommunicator, sequence_parallel: bool) -> Held:
    """Cut each chunk's shard (its collectives call ``made`` under the chunk's key), the last chunk's loss
    vocabulary-parallel where it applies; refuse a tied weight whose gradient is partial over the group."""
    groups, held, notes = driver.tensor_parallel, [], []
    tied = {name for name, _ in driver.program.tie_groups}
    objects = example_objects(driver.program, driver.context.device)
    for chunk in driver.chunks:
        key = group_key(chunk, driver.replica_index)
        register_group(key, made)
        runner, stage = driver.runners[chunk], driver.program.stages[chunk]
        module = runner.module
        assert isinstance(module, torch.fx.GraphModule), type(module)
        sharded, params = shard_for_member(module, stage, driver.program, groups.degree, groups.member, key,
                                           sequence_parallel, chunk == driver.last_chunk, objects=objects)
        partial_tied = sorted(p.name for p in params if p.partial and p.name in tied)
        if partial_tied:
            raise PipelineSetupError(f"tied weights {partial_tied} have gradients partial over a tensor-parallel "
                                     f"group on chunk {chunk}; untie them or use T = 1 there")
        runner.use_module(sharded.module)
        view: Any = ChunkView(stage, driver.program, runner, groups)  # reads only ChunkView's fields
        notes += [*sharded.notes, *use_parallel_loss(view, sharded, module, key)]
        held.append((chunk, {param.name: param for param in params}))
    driver.tp_notes = tuple(notes)
    return held


def example_objects(program: SplitProgram, device: torch.device) -> dict[str, Any]:
    """The Python values (sizes) that cross between chunks at the plan's shapes: the stages run in order on fake
    tensors (no memory, no data). Chunks cut at any node may pass them; the pass needs them to trace a chunk."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxpipe.runtime.transport.fake_run import run_stages

    if all(spec.is_tensor for spec in program.values.values()):
        return {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        known: dict[str, Any] = {name: torch.empty(program.values[name].shape, dtype=program.values[name].dtype,
                                                   device=device) for name in program.model_inputs
                                 if program.values[name].is_tensor}
        run_stages(program, device, None, mode, known)
    return {name: value for name, value in known.items() if not program.values[name].is_tensor}
