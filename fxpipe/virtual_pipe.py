"""The PipelinedModule of a virtual-stage plan: a rank holds all its device group's chunks (docs/virtual_stages.md)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.pipe_inputs import positional_inputs
from fxpipe.pipe_lifecycle import PipeLifecycle

if TYPE_CHECKING:
    from fxpipe.compile_options import CompileOptions
    from fxpipe.core.program import SplitProgram
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver
    from fxpipe.runtime.transport.comm import DistContext


class VirtualPipelinedModule(PipeLifecycle):
    """This rank's chunks of a virtual-stage pipeline; ``step``, ``evaluate``, ``predict`` for the whole job.

    Every rank calls them with the same global batch (as on ``fxpipe.api.PipelinedModule``). ``parameters()`` /
    ``named_parameters()`` cover every chunk this rank runs, each parameter once; ``state_dict()`` gives whole
    tensors under the original names, so checkpoints load across plans and values of v.
    """

    def __init__(self, driver: VirtualDriver, graph_module: torch.fx.GraphModule) -> None:
        self.driver = driver
        self.graph_module = graph_module

    plan = property(lambda self: self.driver.plan, doc="The Plan this module runs.")
    program = property(lambda self: self.driver.program, doc="The SplitProgram (all chunks' code).")
    rank = property(lambda self: self.driver.rank, doc="This process's rank.")
    stage_index = property(lambda self: self.driver.stage_index, doc="The first chunk this rank runs.")
    replica_index = property(lambda self: self.driver.replica_index, doc="Which replica of its device group.")
    chunks = property(lambda self: self.driver.chunks, doc="The chunks (plan stages) this rank runs.")

    def step(self, inputs: Any, targets: Any, *, partial: bool = False) -> float:
        """Forward and backward of the global batch; gradients land in ``parameters()``; returns the loss.

        ``partial=True``: each rank passes only the rows it reads (``input_rows()``, ``target_rows()``; None where
        it reads none), as on ``fxpipe.api.PipelinedModule``."""
        if partial and inputs is None:
            inputs = {name: None for name in self.driver.program.model_inputs}
        positional = positional_inputs(self.driver.program.model_inputs, inputs, partial)
        return self._collective(self.driver.step, positional, targets, partial=partial)

    def evaluate(self, inputs: Any, targets: Any) -> float:
        """The loss of the global batch, forward only, gradients untouched (collective)."""
        from fxpipe.runtime.virtual_inference import evaluate

        return self._collective(evaluate, self.driver, self._positional(inputs), targets)

    def predict(self, inputs: Any) -> Any:
        """The model's output for the global batch on every rank (collective, forward only)."""
        from fxpipe.runtime.virtual_inference import predict

        return self._collective(predict, self.driver, self._positional(inputs))

    __call__ = predict

    def _positional(self, inputs: Any) -> tuple[Any, ...]:
        return positional_inputs(self.driver.program.model_inputs, inputs)

    def _compiled_stages(self) -> bool:
        return any(runner.compiled is not None for runner in self.driver.runners.values())

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        yield from self.driver.named

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for _, param in self.driver.named:
            yield param

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers of this rank's chunks under their original names (detached, whole: a sharded
        chunk's gathered over its group's replicas, a tensor-parallel shard over its group: collectives there)."""
        return {name: self.driver.whole(name, tensor) for name, tensor in chunk_tensors(self.driver)}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy the entries this rank's chunks hold from a full (or partial) state dict keyed by original names."""
        from fxpipe.runtime.parallel.sharded_stage import copy_full_into

        held = chunk_tensors(self.driver)
        missing = sorted({name for name, _ in held} - set(state))
        if missing:
            raise KeyError(f"state dict lacks {missing} held by chunks {list(self.driver.chunks)}")
        for name, tensor in held:  # every copy of a tied weight; a sharded chunk's rows of it
            copy_full_into(tensor, self.driver.part(name, state[name]))

    def train(self, mode: bool = True) -> VirtualPipelinedModule:
        for runner in self.driver.runners.values():
            runner.module.train(mode)
        return self

    def eval(self) -> VirtualPipelinedModule:
        return self.train(False)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model (every chunk of every rank, each parameter once);
        call on every rank after ``step``: the same total everywhere."""
        from fxpipe.runtime.virtual_clipping import clip_virtual_grad_norm

        return clip_virtual_grad_norm(self.driver, max_norm, norm_type, error_if_nonfinite)

    def input_rows(self) -> tuple[tuple[int, int], ...] | None:
        """Global-batch row ranges ``[start, stop)`` whose inputs this rank's chunks read (None: they read none);
        every chunk of a device group reads the same rows."""
        from fxpipe.runtime.transport.rows import input_rows

        ranges = (input_rows(self.driver.program, chunk, self._rows()) for chunk in self.chunks)
        return next((found for found in ranges if found is not None), None)

    def target_rows(self) -> tuple[tuple[int, int], ...] | None:
        """Global-batch row ranges whose targets this rank reads: the last chunk's replicas only, else None."""
        from fxpipe.runtime.transport.rows import target_rows

        return target_rows(self.driver.program, self.chunks[-1], self._rows())

    def _rows(self) -> Any:
        from fxpipe.runtime.transport.rows import RowMap

        return RowMap.of(self.plan, self.replica_index, self.plan.stages[self.chunks[0]].replicas)

    def __repr__(self) -> str:
        return (f"VirtualPipelinedModule(layout={self.plan.layout!r}, virtual_stages={self.plan.virtual_stages}, "
                f"rank={self.rank}, chunks={list(self.driver.chunks)}, schedule={self.plan.schedule!r})")


def chunk_tensors(driver: VirtualDriver) -> list[tuple[str, torch.Tensor]]:
    """``(original name, tensor)`` of every parameter and buffer of every chunk on this rank, chunk by chunk (a tied
    weight once per chunk holding it)."""
    from fxpipe.runtime.sync import stage_state

    return [item for runner in driver.runners.values() for item in stage_state(runner.module, runner.stage.param_names)]


def deferred_chunk_batch_norm(driver: VirtualDriver, mode: str) -> Any:
    """``batch_norm`` "deferred" or "sync" on every chunk of this rank, as on one stage (fxpipe.runtime.numerics.
    batchnorm): running statistics summed over every micro-batch and replica of the device group, committed once
    per step; "sync" also normalises each micro-batch over the group's replicas (they run the same list, so the
    collectives pair up). None when the chunks hold no batch norm."""
    from fxpipe.runtime.numerics.batchnorm import DeferredCommit, install_deferred

    modules = [runner.module for runner in driver.runners.values()]
    group = driver.groups.replicas
    layers = [layer for module in modules for layer in install_deferred(module, group if mode == "sync" else None)]
    return DeferredCommit(layers, group) if layers else None


def build_virtual_pipe(program: SplitProgram, plan: Any, options: CompileOptions, context: DistContext,
                       target_dim: int, compile_settings: Mapping[str, Any] | None,
                       graph_module: torch.fx.GraphModule) -> VirtualPipelinedModule:
    """The setup ``fxpipe.compile`` runs for a virtual-stage plan after code generation (every rank)."""
    from fxpipe.compile_virtual_tensor_parallel import shard_virtual_chunks
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver
    from fxpipe.runtime.virtual_compile import compile_chunks
    from fxpipe.runtime.virtual_sync import synchronize_chunks

    driver = VirtualDriver(program, plan, options.loss_fn, context=context, autocast_dtype=options.autocast_dtype,
                           timeout_s=options.timeout_s, loss_reduction=options.loss_reduction,
                           target_batch_dim=target_dim, stall_timeout_s=options.stall_timeout_s)
    synchronize_chunks(chunk_tensors(driver), driver.groups, plan, driver.group_index, options.sync_params)
    shard_virtual_chunks(driver, graph_module, options.sequence_parallel)
    if options.batch_norm != "microbatch":
        driver.batch_norm = deferred_chunk_batch_norm(driver, options.batch_norm)
    if compile_settings is not None:
        compile_chunks(driver, compile_settings, options.batch_norm)  # on the tensor-parallel shards
    driver.shard_chunks(options.param_dtype)  # on whole, synced tensors (FSDP2 cuts each replica's rows from its own copy)
    if context.rank == 0:
        from fxpipe.report import print_plan

        print_plan(plan, options.verbose)
    return VirtualPipelinedModule(driver, graph_module)
