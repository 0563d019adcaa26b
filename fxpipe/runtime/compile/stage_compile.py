"""torch.compile of one stage: its forward through dynamo, its backward through AOTAutograd, the batch dim dynamic.

What compiles and what does not, and why: docs/compile.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo.callback import CallbackTrigger, callback_handler

from fxpipe.core.plan import Plan
from fxpipe.runtime.faults.errors import PipelineSetupError

# torch.compile's keyword arguments (backend, mode, options, dynamic, fullgraph, ...), for the error below
COMPILE_KEYWORDS = frozenset(inspect.signature(torch.compile).parameters) - {"model"}

ZERO_BUBBLE_NOTE = ("torch_compile: under the split backward each compiled stage's joint forward+backward graph is "
                    "cut into F, B (input gradients) and W (weight gradients) graphs, traced and compiled once per "
                    "micro-batch row count; a stage that cannot be cut (random ops, autocast, recompute, "
                    "sharding) runs its whole backward in B, with a CompileFallbackWarning (docs/compile.md)")
MEASURED_COSTS_NOTE = ("torch_compile: the measured block costs come from eager blocks, not compiled ones, so "
                       "compiled stages may run faster or slower than predicted (docs/compile.md)")


def parse_torch_compile(setting: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``torch_compile`` as torch.compile's keyword arguments (None: stages run eager)."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return {}
    if isinstance(setting, Mapping):
        unknown = sorted(str(key) for key in setting if key not in COMPILE_KEYWORDS)
        if unknown:
            raise PipelineSetupError(f"torch_compile={dict(setting)!r} names {unknown}, which torch.compile does not "
                                     f"take; pass a dict of its keyword arguments ({sorted(COMPILE_KEYWORDS)})")
        return dict(setting)
    raise PipelineSetupError(f"torch_compile={setting!r}; pass False (eager stages), True (torch.compile with its "
                             "defaults) or a dict of torch.compile keyword arguments, e.g. {'backend': 'aot_eager'}")


WAIT_NOTE = ("torch_compile: every rank compiles its stage during fxpipe.compile, forward and backward at the plan's "
             "micro-batch row counts (a setup phase that waits up to 30 min for a peer); a batch of another size "
             "compiles its new row counts (zero-bubble: traces them) in its first step, where a rank waits at most "
             "timeout_s={timeout_s:g} s for a peer: raise timeout_s if such compiles take longer (cold inductor "
             "compiles of a large stage take minutes on a CPU)")


def with_compile_notes(plan: Plan, settings: Mapping[str, Any] | None, timeout_s: float) -> Plan:
    """``plan`` with notes on what compiling its stages changes: the first step's waits, zero-bubble's W,
    measured costs."""
    if settings is None:
        return plan
    notes = [WAIT_NOTE.format(timeout_s=timeout_s)]
    if plan.schedule.startswith("zero_bubble"):
        notes.append(ZERO_BUBBLE_NOTE)
    if plan.predicted is not None and plan.predicted.cost_source == "measured":
        notes.append(MEASURED_COSTS_NOTE)
    return plan.with_updates(notes=(*plan.notes, *notes))


@dataclass
class CompileStats:
    """What compiling one stage cost so far: dynamo frames compiled (the first compile, recompiles and graph
    breaks), backward graphs compiled lazily by AOTAutograd, and the seconds they took."""

    stage_index: int
    num_frames: int = 0
    num_backward_graphs: int = 0
    compile_s: float = 0.0
    eager_reason: str | None = None  # why the stage runs eager (None: compiled)
    # split backward (zero-bubble): row counts whose F, B and W were cut and compiled, W passes run after their B,
    # and why the stage runs its whole backward in B instead (None: split, or no split-backward schedule)
    num_split_shapes: int = 0
    num_weight_passes: int = 0
    w_in_b_reason: str | None = None


class _CompileClock:
    """Times dynamo's compiles through its compile callbacks and books them to the stage being run.

    Registered once per process; compiles outside a stage's calls (the user's own) are not booked.
    """

    def __init__(self) -> None:
        self.active: CompileStats | None = None
        self._started = 0.0
        self._backward = False
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, args: Any) -> None:
        self._started = time.perf_counter()
        self._backward = args.callback_trigger is CallbackTrigger.LAZY_BACKWARD

    def _end(self, args: Any) -> None:
        stats = self.active
        if stats is None:
            return
        stats.compile_s += time.perf_counter() - self._started
        if self._backward:
            stats.num_backward_graphs += 1
        else:
            stats.num_frames += 1


@functools.cache
def _clock() -> _CompileClock:
    return _CompileClock()


class CompiledStage:
    """Calls a stage module through ``torch.compile``, its batch dims marked dynamic on every call.

    ``batch_dims``: per positional input, the dim that holds the batch (None: not batched). A dim of
    size 1 is left unmarked: dynamo specialises sizes 0 and 1, so a one-row slice compiles once more.
    """

    def __init__(self, module: torch.nn.Module, batch_dims: Sequence[int | None], settings: Mapping[str, Any],
                 stage_index: int) -> None:
        self.module = module
        self.settings = dict(settings)
        self.stats = CompileStats(stage_index)
        self._batch_dims = tuple(batch_dims)
        self._mark = self.settings.get("dynamic") is not False
        self._compiled = torch.compile(module, **self.settings)
        _clock()

    def compile_part(self, graph: torch.fx.GraphModule) -> Callable[..., Any]:
        """One part of a split stage (compiled_split) through torch.compile with the stage's settings, its
        compiles booked to this stage; a part without ops runs as it is."""
        if not any(node.op == "call_function" for node in graph.graph.nodes):
            return graph
        compiled = torch.compile(graph, **self.settings)

        def call(*args: Any) -> Any:
            with self.booking():
                return compiled(*args)

        return call

    def __call__(self, *args: Any) -> Any:
        if self._mark:
            for value, dim in zip(args, self._batch_dims, strict=True):
                if dim is not None and isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] > 1:
                    torch._dynamo.maybe_mark_dynamic(value, dim)
        with self.booking():
            return self._compiled(*args)

    @contextlib.contextmanager
    def booking(self) -> Iterator[None]:
        """Book the compiles inside the block (this stage's forward, or its backward) to this stage."""
        clock = _clock()
        previous, clock.active = clock.active, self.stats
        try:
            yield
        finally:
            clock.active = previous


def format_compile_stats(stats: Sequence[CompileStats]) -> str:
    """One line per stage (its slowest replica): frames and backward graphs compiled, and the seconds."""
    by_stage: dict[int, CompileStats] = {}
    for item in stats:
        if item.stage_index not in by_stage or item.compile_s > by_stage[item.stage_index].compile_s:
            by_stage[item.stage_index] = item
    lines = []
    for index in sorted(by_stage):
        item = by_stage[index]
        if item.eager_reason is not None:
            lines.append(f"torch.compile stage {index}: eager ({item.eager_reason})")
        else:
            split = ""
            if item.num_split_shapes:
                split = f", split into F/B/W for {item.num_split_shapes} row counts"
            if item.w_in_b_reason is not None:
                split = f", W inside B ({item.w_in_b_reason})"
            lines.append(f"torch.compile stage {index}: {item.num_frames} forward frames and "
                         f"{item.num_backward_graphs} backward graphs compiled in {item.compile_s:.1f} s{split}")
    return "\n".join(lines)
