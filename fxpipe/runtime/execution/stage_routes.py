"""Where one rank's stage replica sends and receives: routes per crossing value and the pieces the inbox expects."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.core.plan import Plan
from fxpipe.core.schedule import FORWARD_ONLY
from fxpipe.runtime.execution.actions import StageActions, stage_actions
from fxpipe.runtime.execution.receives import Message, Piece, plan_messages
from fxpipe.runtime.faults.errors import BatchShapeError, MessageLayoutError
from fxpipe.runtime.transport.batch_layout import BatchLayout, batch_rows, check_targets, make_layout
from fxpipe.runtime.transport.comm import MessageKind, Route, buffer_shape
from fxpipe.runtime.transport.group_routes import group_routes
from fxpipe.runtime.transport.rows import RowMap
from fxpipe.runtime.transport.shape_templates import ShapeTemplates

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram, ValueSpec

Routes = dict[str, list[Route]]


@dataclass(frozen=True)
class StageRoutes:
    """This rank's routes: ``inputs`` (value -> routes it receives on), ``outputs`` (value -> routes it sends
    on), the activation and gradient pieces received per micro-batch, the output rows each gradient
    piece covers (None: all of it), and ``gradient_sends`` (value -> routes it sends input gradients back on:
    ``inputs`` unless a tensor-parallel group sits on either side, :mod:`fxpipe.runtime.transport.group_routes`)."""

    inputs: Routes
    outputs: Routes
    activation_pieces: list[Piece]
    gradient_pieces: list[Piece]
    gradient_rows: dict[tuple[str, int], tuple[int, int] | None]
    gradient_sends: Routes

    @classmethod
    def of(cls, program: SplitProgram, plan: Plan, stage_index: int, rank: int,
           dtypes: Mapping[str, torch.dtype | None], microbatch_rows: int | None = None,
           shapes: Mapping[str, tuple[int, ...]] | None = None) -> StageRoutes:
        """Routes for micro-batches of ``microbatch_rows`` rows (default: the plan's) whose values have
        ``shapes`` in their other dims (default: the plan's)."""
        rows = plan.microbatch_size if microbatch_rows is None else microbatch_rows
        inputs = _input_routes(program, plan, stage_index, rank, rows, 0)
        outputs = _output_routes(program, plan, stage_index, rank, rows, 0)
        gradient_sends = _input_routes(program, plan, stage_index, rank, rows, 1)
        gradient_receives = _output_routes(program, plan, stage_index, rank, rows, 1)
        shape_of = shapes or {name: spec.shape for name, spec in program.values.items()}
        activation = [_piece(route.sender_rank, name, index, route.receiver_rows, program.values[name], dtypes,
                             shape_of[name])
                      for name, routes in inputs.items() if program.values[name].is_tensor
                      for index, route in enumerate(routes)]
        gradient = [_piece(route.receiver_rank, name, index, route.sender_rows, program.values[name], dtypes,
                           shape_of[name])
                    for name, routes in gradient_routes(program, gradient_receives) for index, route in enumerate(routes)]
        gradient_rows = {(name, index): route.sender_rows for name, routes in gradient_routes(program, gradient_receives)
                         for index, route in enumerate(routes)}
        return cls(inputs, outputs, activation, gradient, gradient_rows, gradient_sends)


def gradient_routes(program: SplitProgram, routes: Routes) -> list[tuple[str, list[Route]]]:
    """The routes of values that carry a gradient back (tensors that require grad)."""
    return [(name, rs) for name, rs in routes.items()
            if program.values[name].is_tensor and program.values[name].requires_grad]


def _piece(peer: int, name: str, index: int, rows: tuple[int, int] | None, spec: ValueSpec,
           dtypes: Mapping[str, torch.dtype | None], value_shape: tuple[int, ...]) -> Piece:
    """``(peer rank, (value, route index), shape, dtype)`` of one piece: ``rows`` of the value (None: all)."""
    return (peer, (name, index), *piece_layout(spec, dtypes, value_shape, rows))


def piece_layout(spec: ValueSpec, dtypes: Mapping[str, torch.dtype | None], value_shape: tuple[int, ...],
                 rows: tuple[int, int] | None) -> tuple[tuple[int, ...], torch.dtype]:
    """``(shape, dtype)`` of ``rows`` (None: all) of a value whose whole shape is ``value_shape``."""
    shape = buffer_shape(value_shape, spec.batched and rows is not None, rows[1] - rows[0] if rows else 0,
                         spec.batch_dim)
    return shape, dtypes[spec.name] or torch.get_default_dtype()


def check_outgoing(program: SplitProgram, layout: BatchLayout, name: str, rows: tuple[int, int] | None,
                   piece: torch.Tensor, source: str) -> None:
    """Refuse to send a piece in another dtype or shape than the layout every rank works out for the step (its
    receiver's buffer): MessageLayoutError naming both, on the sender, before anything goes out."""
    shape, dtype = piece_layout(program.values[name], layout.dtypes, layout.shapes[name], rows)
    if piece.dtype == dtype and tuple(piece.shape) == shape:
        return
    raise MessageLayoutError(
        f"{source}: {name!r} is {piece.dtype} of shape {tuple(piece.shape)} but its receiver expects {dtype} of "
        f"shape {shape} (the layout every rank works out for this batch). A stage computed another dtype or shape "
        "than the fake-tensor run of the same stages: does the model choose dtypes or shapes from the data, or do "
        "the ranks run step under different torch.autocast settings?")


def _routes(program: SplitProgram, plan: Plan, value: str, producer: int, consumer: int,
            rows: int, kind: int) -> tuple[Route, ...]:
    """The activation (``kind`` 0) or gradient (1) routes of ``value`` from stage ``producer`` to ``consumer``."""
    spec = program.values[value]
    return group_routes(value, spec.batched and spec.is_tensor, rows, plan.stages[producer],
                        plan.stages[consumer])[kind]


def _input_routes(program: SplitProgram, plan: Plan, stage_index: int, rank: int, rows: int, kind: int) -> Routes:
    routes = {}
    for name in sorted(set(program.stages[stage_index].input_values)):
        producer = program.producers[name]
        if producer >= 0:
            routes[name] = [r for r in _routes(program, plan, name, producer, stage_index, rows, kind)
                            if r.receiver_rank == rank]
    return routes


def _output_routes(program: SplitProgram, plan: Plan, stage_index: int, rank: int, rows: int, kind: int) -> Routes:
    routes: Routes = {}
    for name in sorted(set(program.stages[stage_index].output_values)):
        for consumer in sorted(program.consumers.get(name, ())):
            if consumer != stage_index and program.producers.get(name) == stage_index:
                routes.setdefault(name, []).extend(
                    r for r in _routes(program, plan, name, stage_index, consumer, rows, kind) if r.sender_rank == rank)
    return routes


@dataclass(frozen=True)
class ShapedStep:
    """What a step of one batch layout needs on this rank: the layout, this replica's rows, the routes of each
    micro-batch, and the messages it receives per micro-batch (made once per shape signature)."""

    layout: BatchLayout
    rows: RowMap
    routes: tuple[StageRoutes, ...]  # per micro-batch (micro-batches of equal rows share one)
    messages: dict[MessageKind, list[list[Message]]]
    actions: StageActions  # the plan's schedule at the layout's micro-batch count
    forward_actions: StageActions  # the forward-only schedule (evaluate, predict)

    @classmethod
    def of(cls, program: SplitProgram, plan: Plan, stage_index: int, rank: int, layout: BatchLayout) -> ShapedStep:
        replica_index, num_replicas = plan.stage_of_device(rank)[1], plan.stages[stage_index].replicas
        by_rows: dict[int, StageRoutes] = {}
        num_microbatches = len(layout.microbatch_ranges)
        for m in range(num_microbatches):
            rows = layout.microbatch_rows(m)
            if rows not in by_rows:
                by_rows[rows] = StageRoutes.of(program, plan, stage_index, rank, layout.dtypes, rows, layout.shapes)
        routes = tuple(by_rows[layout.microbatch_rows(m)] for m in range(num_microbatches))
        messages = plan_messages({MessageKind.ACTIVATION: [r.activation_pieces for r in routes],
                                  MessageKind.GRADIENT: [r.gradient_pieces for r in routes]})
        actions = stage_actions(plan.schedule, plan.num_stages, num_microbatches, plan.warmup_policy, stage_index)
        forward = stage_actions(FORWARD_ONLY, plan.num_stages, num_microbatches, plan.warmup_policy, stage_index)
        return cls(layout, RowMap.split(layout.microbatch_ranges, replica_index, num_replicas), routes, messages,
                   actions, forward)

    def forward_messages(self) -> dict[MessageKind, list[list[Message]]]:
        """The messages of a forward-only pass: activations only."""
        return {MessageKind.ACTIVATION: self.messages[MessageKind.ACTIVATION]}


class ShapedSteps:
    """The ShapedStep of every batch shape this rank has run (the plan's made at once), keyed by the inputs'
    shapes and dtypes: targets do not change the layout, and a rank whose targets alone differ must not take a
    shape as new when the others do not (its batch check would wait in a gather they never join).

    At most MAX_CACHED_SHAPES are kept, least recently used out first, so a run over thousands of lengths
    keeps its memory flat; a new shape's value shapes come from ``templates`` (a symbolic run's formulas,
    shape_templates.py) where they cover it, else from a fake run."""

    def __init__(self, program: SplitProgram, plan: Plan, stage_index: int, rank: int, device: torch.device,
                 autocast_dtype: torch.dtype | None, dtypes: Mapping[str, torch.dtype | None],
                 target_batch_dim: int, token_split: Mapping[str, int] | None = None) -> None:
        self.program, self.plan, self.stage_index, self.rank = program, plan, stage_index, rank
        self.token_split = dict(token_split or {})  # value -> T: sent and received as token shares
        self.device, self.autocast_dtype, self.dtypes = device, autocast_dtype, dtypes
        self.target_batch_dim = target_batch_dim
        self.templates = ShapeTemplates(program, device, autocast_dtype)
        example = [torch.empty(spec.shape, dtype=spec.dtype, device="meta") if spec.is_tensor else None
                   for spec in (program.values[name] for name in program.model_inputs)]
        self.plan_step = self._made(example, plan.global_batch_size)
        self.by_signature: OrderedDict[tuple[Any, ...], ShapedStep] = OrderedDict()

    def known(self, inputs: Sequence[Any], targets: Any) -> ShapedStep | None:
        """The ShapedStep of a shape run before (its targets checked), or None for a new shape."""
        signature = _signature(inputs)
        shaped = self.by_signature.get(signature)
        if shaped is not None:
            self.by_signature.move_to_end(signature)
            check_targets(targets, shaped.layout.num_rows, self.target_batch_dim)
        return shaped

    def add(self, inputs: Sequence[Any], targets: Any) -> ShapedStep:
        """Check a new shape's batch (BatchShapeError) and make its ShapedStep."""
        num_rows = batch_rows(self.program, self.plan, inputs, targets, target_batch_dim=self.target_batch_dim)
        shaped = self._made(inputs, num_rows)
        self.by_signature[_signature(inputs)] = shaped
        if len(self.by_signature) > MAX_CACHED_SHAPES:  # a loop over ever-new lengths: forget the least recent
            self.by_signature.popitem(last=False)
        return shaped

    def _made(self, inputs: Sequence[Any], num_rows: int) -> ShapedStep:
        layout = make_layout(self.program, self.plan, inputs, num_rows, self.device, self.autocast_dtype, self.dtypes,
                             self.templates)
        if self.token_split:  # member j's share of the tokens travels member j to member j
            shapes = {name: token_share(shape, self.token_split.get(name, 1)) for name, shape in layout.shapes.items()}
            layout = dataclasses.replace(layout, shapes=shapes)
        return ShapedStep.of(self.program, self.plan, self.stage_index, self.rank, layout)


def token_share(shape: tuple[int, ...], degree: int) -> tuple[int, ...]:
    """A (batch, tokens, width) value's shape as one of ``degree`` token shares holds it."""
    if degree == 1:
        return shape
    if shape[1] % degree:
        raise BatchShapeError(f"a sequence length of {shape[1]} does not split {degree} ways over the tensor-parallel "
                              f"group; use lengths that are multiples of {degree}")
    return (shape[0], shape[1] // degree, *shape[2:])


MAX_CACHED_SHAPES = 128  # ShapedSteps kept per rank, least recently used out first (each holds small route tables)


def _signature(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """Every input tensor's shape and dtype (other inputs: their type)."""
    return tuple((tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value)
                 for value in inputs)
