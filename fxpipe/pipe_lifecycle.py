"""What every pipelined module does alike, one stage per rank or virtual stages: checkpoints, preemption, close."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from fxpipe.core.checkpoint import CheckpointablePipe
from fxpipe.runtime.faults.errors import PipelineSetupError

if TYPE_CHECKING:
    from fxpipe.runtime.autograd.measure import MeasureSetting, StepStats
    from fxpipe.runtime.compile.stage_compile import CompileStats


class PipeLifecycle:
    """Checkpoint, preemption and shutdown methods over ``self.driver`` (a PipelineDriver or a VirtualDriver); the
    subclass is a :class:`fxpipe.core.checkpoint.CheckpointablePipe`."""

    driver: Any

    def _collective(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``run(*args, **kwargs)``, a collective call (step, evaluate, predict) of every rank."""
        from fxpipe.runtime.numerics.caller_autocast import honour_caller_autocast

        driver = self.driver
        try:  # a torch.autocast region around the call is honoured as autocast_dtype is (docs/training_loop.md)
            with honour_caller_autocast(driver.context.device, driver.compiled_autocast,
                                        compiled_stages=self._compiled_stages(), use_autocast=driver.use_autocast):
                return run(*args, **kwargs)
        except Exception as error:  # the job's root cause when this rank failed first (docs/faults.md)
            if driver.failures is not None:
                driver.failures.note_error(error)
            raise

    def _compiled_stages(self) -> bool:
        """Whether this rank's stage runs compiled with torch.compile (traced without autocast)."""
        return self.driver.runner.compiled is not None

    def grad_scaler(self, *, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                    growth_interval: int = 2000, enabled: bool = True) -> torch.amp.GradScaler:
        """A ``torch.amp.GradScaler`` (torch's arguments and meaning) for fp16 training, made once per pipe.

        From now on ``step`` scales each slice's loss by the scaler's scale and still returns the unscaled
        loss; ``scaler.unscale_(opt)`` (or ``scaler.step(opt)``) agrees on overflow over every rank of the
        job, so every rank skips the same steps and ``update()`` keeps the same scale everywhere. Every rank
        calls it with the same arguments; ``save``/``load`` keep its state. See docs/training_loop.md.
        """
        from fxpipe.runtime.grad_scaler import make_grad_scaler

        return make_grad_scaler(self.driver, init_scale=init_scale, growth_factor=growth_factor,
                                backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The scaler ``grad_scaler()`` made (``step`` scales the loss by it), or None."""
        return self.driver.runner.scaler

    def export(self, directory: str | Path) -> None:
        """Write every stage (every chunk under virtual stages) as a torch.export program with its trained weights,
        plus a manifest.

        ``directory`` gets ``stage_<i>.pt2`` per stage and ``program.json`` (codegen_io ``export_program``);
        each stage loads with torch alone (``torch.export.load``), see docs/export.md. Collective: every
        rank calls it; each stage's first replica sends its tensors and train/eval flag to rank 0, which
        writes the files.
        """
        from fxpipe.passes.codegen_io import export_program
        from fxpipe.runtime.export import gathered_program

        program = gathered_program(self.driver)
        if program is not None:  # rank 0
            export_program(program, directory)

    @property
    def measure(self) -> MeasureSetting:
        """True: each step records a timeline and the exact saved-activation peak (``step_stats``; under virtual
        stages every chunk's actions, each event under its chunk, and the peak of all the rank's chunks together).

        ``"timeline"`` records the timeline only: counting saved tensors hooks every one of them,
        which slows a CPU step by up to ~20%, so time-sensitive measurements leave it out.
        """
        return self.driver.measure.value

    @measure.setter
    def measure(self, setting: MeasureSetting) -> None:
        from fxpipe.runtime.autograd.measure import MeasureMode

        mode = MeasureMode.of(setting)
        sharded = [stage.stage_index for stage in self.driver.plan.stages if stage.sharding != "none"]
        if mode is MeasureMode.FULL and sharded:  # decided from the plan: every rank raises alike
            raise PipelineSetupError(
                f"pipe.measure=True counts saved activations apart from the weights, but stages {sharded} are sharded "
                "and FSDP2's gathered weights cannot be told apart from activations; use pipe.measure='timeline' "
                "(timeline only) or compile with sharding='none'")
        self.driver.measure = mode

    def compile_stats(self) -> list[CompileStats]:
        """Every rank's torch.compile frames, backward graphs and seconds so far (a collective; docs/compile.md)."""
        from fxpipe.runtime.compiled_stages import gather_compile_stats

        return gather_compile_stats(self.driver)  # one per stage, or per chunk of each rank

    def step_stats(self) -> list[StepStats]:
        """All ranks' StepStats of the last measured step (a collective: call on every rank)."""
        from fxpipe.runtime.execution.measured_step import gather_step_stats

        return gather_step_stats(self.driver)

    def save(self, directory: str | Path, *, optimizer: torch.optim.Optimizer | None = None, step: int = 0,
             extra: Mapping[str, Any] | None = None) -> Path:
        """Atomic sharded checkpoint under original names (every rank calls it); see fxpipe.core.checkpoint."""
        from fxpipe.runtime.checkpoint_io import save_checkpoint

        return save_checkpoint(cast(CheckpointablePipe, self), directory, optimizer=optimizer, step=step, extra=extra)

    def load(self, directory: str | Path, *, optimizer: torch.optim.Optimizer | None = None,
             verify: bool = True) -> dict[str, Any]:
        """Load a checkpoint saved under any plan, with or without virtual stages (checksums checked unless
        ``verify=False``); returns ``{"step", "extra"}``."""
        from fxpipe.runtime.checkpoint_io import load_checkpoint

        return load_checkpoint(cast(CheckpointablePipe, self), directory, optimizer=optimizer, verify=verify)

    def handle_preemption(self) -> None:
        """On SIGTERM, only note it; after the step it lands in, ``preempted`` is True on every rank.

        Loop: ``pipe.step(...); opt.step(); if pipe.preempted: pipe.save(...); break``. Call from the
        main thread; see docs/faults.md (Ranks and signals).
        """
        from fxpipe.runtime.faults.preemption import install

        install()

    @property
    def preempted(self) -> bool:
        """A preemption signal reached some rank before the last step ended (the same on every rank)."""
        return bool(self.driver.preempted)

    def close(self) -> None:
        """Wait for all ranks, then release the process group if ``compile`` created it."""
        from fxpipe.runtime.transport.comm import close_distributed

        close_distributed(self.driver.context)
