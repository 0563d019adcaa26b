"""The front door's tensor-parallel wiring: shard this rank's stage with the graph pass, give it the runtime's group."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.compile_parallel_loss import output_value, parallel_loss_for
from fxpipe.compile_sequence_boundary import sequence_boundary
from fxpipe.core import meta
from fxpipe.passes.recompute_regions import tensor_parallel_regions
from fxpipe.passes.tensor_parallel_ops import register_group
from fxpipe.passes.tp_shard import TensorParallelStage, shard_stage
from fxpipe.runtime.faults.guard import release_group, setup_group, setup_phase
from fxpipe.runtime.parallel.tensor_parallel import GroupCommunicator, TensorParallelParam, check_tied_alike

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram, StageProgram
    from fxpipe.runtime.execution.driver import PipelineDriver


def group_key(stage_index: int, replica_index: int) -> str:
    """The key generated collectives name their group by (one group per stage replica)."""
    return f"stage{stage_index}.replica{replica_index}"


def shard_for_member(module: torch.fx.GraphModule, stage: StageProgram, program: SplitProgram, degree: int,
                     member: int, key: str, sequence_parallel: bool = False, parallel_loss: bool = False,
                     sequence_boundary: frozenset[str] = frozenset(), objects: Mapping[str, Any] | None = None,
                     ) -> tuple[TensorParallelStage, list[TensorParallelParam]]:
    """Member ``member``'s stage of a ``degree``-way group (the graph pass ``shard_stage``, on the stage's inputs
    at the plan's shapes: its module, notes and logits left vocabulary-split under ``parallel_loss``) and how it
    holds each parameter under its original name. Its collectives call group ``key``'s communicator. ``objects``:
    the Python values (sizes) among the stage's inputs at the plan's shapes, where a cut passes any."""
    example = [torch.zeros(spec.shape, dtype=spec.dtype) if spec.is_tensor else (objects or {}).get(spec.name)
               for spec in (program.values[name] for name in stage.input_values)]
    # on a copy: the pass shares whole layers with its input, which must stay the program's plain stage (fake-tensor
    # shape runs and export use it) when FSDP2 later turns the member's parameters into DTensors
    sharded = shard_stage(copy.deepcopy(module), degree, member, group_key=key, example_inputs=example,
                          sequence_parallel=sequence_parallel, parallel_loss=parallel_loss,
                          sequence_boundary=sequence_boundary)
    param_names = stage.param_names
    original = dict(param_names)
    params = [TensorParallelParam(original.get(param.path, param.name), param.dim, param.full_shape,
                                  param.partial_grad, param.parts) for param in sharded.parameters]
    described = {param.name for param in params}  # anything the pass did not describe is whole on every member
    params += [param for param in whole_parameters(sharded.module, param_names) if param.name not in described]
    return sharded, params


def whole_parameters(module: torch.nn.Module, param_names: Sequence[tuple[str, str]]) -> list[TensorParallelParam]:
    """Every parameter of ``module`` described as whole on every member, by original name."""
    params = dict(module.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    described = []
    for path, original in param_names:
        if path in params and original not in seen:
            seen.add(original)
            described.append(TensorParallelParam(original, None, tuple(params[path].shape)))
    return described


def apply_tensor_parallel(driver: PipelineDriver, sequence_parallel: bool = False,
                          traced: torch.nn.Module | None = None) -> GroupCommunicator | None:
    """Shard this rank's stage over its tensor-parallel group; returns the group's communicator (None at T = 1).
    The unsharded stage's parameters become placeholders, in the program and the ``traced`` model
    (:func:`release_unsharded`).

    Every rank of a plan with tensor-parallel stages joins one setup phase: the pass runs no collective, and a
    rank it fails on tells the others instead of leaving them waiting (shards come from the synced whole tensors).
    """
    if all(stage.tensor_parallel == 1 for stage in driver.plan.stages):
        return None
    groups = driver.tensor_parallel
    made = GroupCommunicator(groups.group, groups.degree, groups.member, exchange=driver.exchange) \
        if groups.degree > 1 else None
    setup = setup_group()
    try:
        with setup_phase("tensor-parallel sharding", setup):
            if made is not None:
                key = group_key(driver.stage_index, driver.replica_index)
                register_group(key, made)
                module = driver.runner.module
                assert isinstance(module, torch.fx.GraphModule), type(module)
                # boundary values between sequence-parallel stages of this T cross as token shares
                names, split = sequence_boundary(driver.program, driver.plan, driver.stage_index) \
                    if sequence_parallel else (frozenset(), {})
                sharded, params = shard_for_member(module, driver.stage, driver.program, groups.degree, groups.member,
                                                   key, sequence_parallel, driver.is_last, names)
                # per-block recompute on the shard: its regions rerun the member's collectives in backward
                sharded = dataclasses.replace(sharded, module=tensor_parallel_regions(
                    sharded.module, driver.plan.stages[driver.stage_index]))
                driver.apply_tensor_parallel(sharded.module, params, split)
                driver.tp_notes = sharded.notes + use_parallel_loss(driver, sharded, module, key)
                release_unsharded(driver.stage, [stage.module for stage in driver.program.stages], traced)
    finally:
        release_group(setup)
    check_tied_alike([(driver.stage_index, driver.tp_params)], driver.program.tie_groups)
    driver.tp_communicator = made
    return made


def release_unsharded(stage: StageProgram, modules: Sequence[torch.nn.Module], traced: torch.nn.Module | None) -> None:
    """Drop the unsharded stage's parameter storage, in place: each of its parameters becomes a meta-device
    placeholder of its shape wherever ``modules`` (the program's stages: a tied weight) or the ``traced`` model
    (its parameters under the stage's original names) hold it.

    The member runs its shard; the program's stage modules (whose layers are the user's model's own under torch.fx)
    serve shape runs, which need shapes only, and export, which builds the stage from gathered tensors on demand.
    Without this every member kept the whole stage next to its shards."""
    held = {id(param) for param in stage.module.parameters()}
    if traced is not None:
        originals = {original for _, original in stage.param_names}
        canonical = traced.meta.get(meta.PARAM_NAMES, {}) if isinstance(traced, torch.fx.GraphModule) else {}
        held |= {id(param) for path, param in traced.named_parameters(remove_duplicate=False)
                 if canonical.get(path, path) in originals}
    for owner in (*modules, *([traced] if traced is not None else [])):
        for submodule in owner.modules():
            for name, param in list(submodule._parameters.items()):
                if param is not None and id(param) in held:
                    submodule._parameters[name] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)


def use_parallel_loss(driver: PipelineDriver, sharded: TensorParallelStage, unsharded: torch.fx.GraphModule,
                      key: str) -> tuple[str, ...]:
    """Give the last stage the vocabulary-parallel cross-entropy when its logits stayed split and the user's loss
    is that cross-entropy; otherwise its logits are gathered before the user's loss. A note says which."""
    if sharded.vocab_parallel_logits is None:
        return ()
    node_name, start, vocab = sharded.vocab_parallel_logits
    value = output_value(driver.stage, unsharded, node_name)
    assert driver.runner.loss_fn is not None and value is not None, (driver.runner.loss_fn, node_name)
    loss = parallel_loss_for(driver.runner.loss_fn, driver.program, value, key, start, vocab)
    if loss is None:
        return (f"loss_fn is not the token cross-entropy of {value!r}: its vocabulary-split logits are gathered "
                "before it",)
    driver.runner.loss_fn = loss
    return (f"loss: vocabulary-parallel cross-entropy on {value!r} (columns {start}.."
            f"{start + vocab // driver.tensor_parallel.degree} of {vocab} here); the whole logits are never built",)
