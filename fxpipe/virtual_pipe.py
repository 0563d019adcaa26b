"""The PipelinedModule of a virtual-stage plan: a rank holds all its device group's chunks (docs/virtual_stages.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.api import PipelinedModule
from fxpipe.runtime.faults.errors import PipelineSetupError

if TYPE_CHECKING:
    from fxpipe.compile_options import CompileOptions
    from fxpipe.core.program import SplitProgram
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver
    from fxpipe.runtime.transport.comm import DistContext


class VirtualPipelinedModule(PipelinedModule):
    """This rank's chunks of a virtual-stage pipeline; ``step``, ``evaluate``, ``predict`` for the whole job.

    ``parameters()``/``named_parameters()`` cover every chunk this rank runs (a tied weight held by two of them
    appears once per chunk: each copy gets the same summed gradient); ``state_dict()`` gives whole tensors under
    the original names, so checkpoints load across plans and values of v.
    """

    driver: VirtualDriver  # type: ignore[assignment]

    stage_index = property(lambda self: self.driver.stage_index, doc="The first chunk this rank runs.")
    module = property(lambda self: self.driver.runner.module, doc="The GraphModule of this rank's last chunk.")

    def _collective(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return run(*args, **kwargs)
        except Exception as error:  # the job's root cause when this rank failed first (docs/faults.md)
            if self.driver.failures is not None:
                self.driver.failures.note_error(error)
            raise

    def evaluate(self, inputs: Any, targets: Any) -> float:
        from fxpipe.runtime.virtual_inference import evaluate

        return self._collective(evaluate, self.driver, self._positional(inputs), targets)

    def predict(self, inputs: Any) -> Any:
        from fxpipe.runtime.virtual_inference import predict

        return self._collective(predict, self.driver, self._positional(inputs))

    __call__ = predict

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        yield from self.driver.named

    def _stage_tensors(self) -> dict[str, torch.Tensor]:
        return dict(chunk_tensors(self.driver))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach() for name, tensor in self._stage_tensors().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        missing = sorted({name for name in self._stage_tensors()} - set(state))
        if missing:
            raise KeyError(f"state dict lacks {missing} held by chunks {list(self.driver.chunks)}")
        with torch.no_grad():
            for name, tensor in chunk_tensors(self.driver):  # every copy of a tied weight
                tensor.copy_(state[name])

    def train(self, mode: bool = True) -> PipelinedModule:
        for runner in self.driver.runners.values():
            runner.module.train(mode)
        return self

    def __repr__(self) -> str:
        return (f"VirtualPipelinedModule(layout={self.plan.layout!r}, virtual_stages={self.plan.virtual_stages}, "
                f"rank={self.rank}, chunks={list(self.driver.chunks)}, schedule={self.plan.schedule!r})")


def chunk_tensors(driver: VirtualDriver) -> list[tuple[str, torch.Tensor]]:
    """``(original name, tensor)`` of every parameter and buffer of every chunk on this rank, chunk by chunk (a tied
    weight once per chunk holding it)."""
    from fxpipe.runtime.sync import stage_state

    return [item for runner in driver.runners.values() for item in stage_state(runner.module, runner.stage.param_names)]


def unsupported(name: str) -> Callable[..., Any]:
    def refuse(self: VirtualPipelinedModule, *args: Any, **kwargs: Any) -> Any:
        raise PipelineSetupError(f"pipe.{name} is not supported with virtual stages yet (virtual_stages="
                                 f"{self.plan.virtual_stages}); use a plan without virtual stages for it")
    return refuse


for _name in ("clip_grad_norm_", "grad_scaler", "export", "input_rows", "target_rows", "compile_stats", "step_stats"):
    setattr(VirtualPipelinedModule, _name, unsupported(_name))


def build_virtual_pipe(program: SplitProgram, plan: Any, options: CompileOptions, context: DistContext,
                       target_dim: int, compile_settings: Mapping[str, Any] | None,
                       graph_module: torch.fx.GraphModule) -> VirtualPipelinedModule:
    """The setup ``fxpipe.compile`` runs for a virtual-stage plan after code generation (every rank)."""
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver
    from fxpipe.runtime.gradients.virtual_grads import broadcast_state
    from fxpipe.runtime.sync import check_sync_mode
    from fxpipe.runtime.virtual_compile import compile_chunks

    if options.batch_norm != "microbatch":
        raise PipelineSetupError(f"batch_norm={options.batch_norm!r} is not supported with virtual stages yet; "
                                 "use batch_norm='microbatch' (the default)")
    driver = VirtualDriver(program, plan, options.loss_fn, context=context, autocast_dtype=options.autocast_dtype,
                           timeout_s=options.timeout_s, loss_reduction=options.loss_reduction,
                           target_batch_dim=target_dim, stall_timeout_s=options.stall_timeout_s)
    mode = check_sync_mode(options.sync_params)
    if mode == "verify":
        raise PipelineSetupError("sync_params='verify' is not supported with virtual stages yet; use 'broadcast' "
                                 "(the default) or 'off'")
    if mode == "broadcast":
        broadcast_state(chunk_tensors(driver), driver.groups, plan, driver.group_index)
    if compile_settings is not None:
        compile_chunks(driver, compile_settings)
    if context.rank == 0:
        from fxpipe.report import print_plan

        print_plan(plan, options.verbose)
    return VirtualPipelinedModule(driver, graph_module)  # type: ignore[arg-type]  # a driver of several chunks
