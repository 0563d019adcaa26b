"""A virtual-stage rank's batch layouts per autocast dtype (compile's ``autocast_dtype``, or a caller's torch.autocast)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.runtime.execution.stage_routes import MAX_CACHED_SHAPES
from fxpipe.runtime.execution.virtual_routes import VirtualStep
from fxpipe.runtime.transport.batch_layout import batch_rows, infer_value_dtypes, make_layout
from fxpipe.runtime.transport.batchcheck import check_shapes
from fxpipe.runtime.transport.shape_templates import ShapeTemplates

if TYPE_CHECKING:
    from fxpipe.core.plan import Plan
    from fxpipe.core.program import SplitProgram


class _Precision:
    """One autocast dtype's value dtypes, shape formulas and VirtualSteps (one per batch signature seen)."""

    def __init__(self, program: SplitProgram, device: torch.device, dtype: torch.dtype | None) -> None:
        self.dtypes = infer_value_dtypes(program, device, dtype)
        self.templates = ShapeTemplates(program, device, dtype)
        self.steps: dict[tuple[Any, ...], VirtualStep] = {}
        self.plan_step: VirtualStep | None = None  # the plan's batch (partial data), made on first use


class VirtualLayouts:
    """The VirtualStep of each batch this rank's group runs, under the autocast dtype of the current call.

    Autocast changes the dtypes of the values crossing between chunks (a bf16 residual stream), so every receive
    buffer is made from the dtypes of the precision the call runs under, as the one-stage driver's
    ``use_autocast`` does (fxpipe.runtime.numerics.caller_autocast)."""

    def __init__(self, program: SplitProgram, plan: Plan, group_index: int, rank: int, device: torch.device,
                 target_batch_dim: int, autocast_dtype: torch.dtype | None) -> None:
        self.program, self.plan, self.group_index, self.rank, self.device = program, plan, group_index, rank, device
        self.target_batch_dim = target_batch_dim
        self._precisions: dict[torch.dtype | None, _Precision] = {}
        self.autocast_dtype = autocast_dtype
        self.use(autocast_dtype)

    def use(self, dtype: torch.dtype | None) -> None:
        """Lay out the next calls' batches for forwards under autocast of ``dtype`` (made on first use)."""
        if dtype not in self._precisions:
            self._precisions[dtype] = _Precision(self.program, self.device, dtype)
        self.autocast_dtype = dtype

    def shaped(self, inputs: Sequence[Any], targets: Any) -> VirtualStep:
        """The VirtualStep of this batch's shapes (made on first sight; the batch checked against the program
        every time, locally: every rank sees the same batch and raises alike)."""
        program, plan, precision = self.program, self.plan, self._precisions[self.autocast_dtype]
        num_rows = batch_rows(program, plan, inputs, targets, target_batch_dim=self.target_batch_dim)
        signature = (num_rows, *((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v) for v in inputs))
        steps = precision.steps
        if signature not in steps:
            layout = make_layout(program, plan, inputs, num_rows, self.device, self.autocast_dtype, precision.dtypes,
                                 precision.templates)
            steps[signature] = VirtualStep.of(program, plan, self.group_index, self.rank, layout)
            if len(steps) > MAX_CACHED_SHAPES:  # a loop over ever-new lengths: forget the oldest
                del steps[next(iter(steps))]
        return steps[signature]

    def plan_step(self, inputs: Sequence[Any], targets: Any) -> VirtualStep:
        """Partial data (``step(partial=True)``): the plan's batch, of which this rank passes only its rows (every
        chunk of a group reads the same rows), checked where a chunk of this rank reads them."""
        precision = self._precisions[self.autocast_dtype]
        if precision.plan_step is None:
            example = [torch.empty(spec.shape, dtype=spec.dtype, device="meta") if spec.is_tensor else None
                       for spec in (self.program.values[name] for name in self.program.model_inputs)]
            layout = make_layout(self.program, self.plan, example, self.plan.global_batch_size, self.device,
                                 self.autocast_dtype, precision.dtypes, precision.templates)
            precision.plan_step = VirtualStep.of(self.program, self.plan, self.group_index, self.rank, layout)
        chunks = self.plan.chunks_of_group(self.group_index)
        check_shapes(self.program, tuple(inputs), targets, num_rows=precision.plan_step.rows.num_rows,
                     reads={name for c in chunks for name in self.program.stages[c].input_values},
                     reads_targets=self.plan.num_stages - 1 in chunks, target_batch_dim=self.target_batch_dim)
        return precision.plan_step
