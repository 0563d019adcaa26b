"""What every pipelined module does alike, one stage per rank or virtual stages: checkpoints, preemption, close."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from fxpipe.core.checkpoint import CheckpointablePipe


class PipeLifecycle:
    """Checkpoint, preemption and shutdown methods over ``self.driver`` (a PipelineDriver or a VirtualDriver); the
    subclass is a :class:`fxpipe.core.checkpoint.CheckpointablePipe`."""

    driver: Any

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
