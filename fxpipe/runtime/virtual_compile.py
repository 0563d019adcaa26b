"""torch.compile for a rank's chunks: each compiled as one stage is (fxpipe.runtime.compiled_stages), in its first step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fxpipe.runtime.compiled_stages import compile_stage

if TYPE_CHECKING:
    from fxpipe.core.plan import Plan
    from fxpipe.core.program import SplitProgram, StageProgram
    from fxpipe.runtime.execution.stage import StageRunner
    from fxpipe.runtime.execution.virtual_driver import VirtualDriver


@dataclass(frozen=True)
class ChunkView:
    """What compile_stage reads of a driver, for one chunk: its runner, program, index and replica group."""

    runner: StageRunner
    stage: StageProgram
    stage_index: int
    program: SplitProgram
    plan: Plan
    split_backward: bool
    groups: Mapping[int, Any]


def compile_chunks(driver: VirtualDriver, settings: Mapping[str, Any], batch_norm: str = "microbatch") -> None:
    """Compile every chunk of this rank (a split-backward schedule cuts each chunk's joint graph into F, B and W).
    No warm-up collective: each chunk compiles in the first step, so the first step takes longer."""
    for chunk in driver.chunks:
        view = ChunkView(driver.runners[chunk], driver.program.stages[chunk], chunk, driver.program, driver.plan,
                         driver.split_backward, {chunk: driver.groups.replicas})
        compile_stage(view, settings, batch_norm)  # type: ignore[arg-type]  # reads only ChunkView's fields
