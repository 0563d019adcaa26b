"""Value shapes at a new input shape without a fake-tensor run: one symbolic run, then its formulas.

A batch at a new sequence length (or image size, or row count) needs the shape and dtype of every value
that crosses a stage boundary. A fake-tensor run of every stage gives them (``fake_run.fake_layouts``)
but costs about a training step on a deep model, and a data pipeline that pads each batch to its own
longest row shows a new length at almost every early step. So the run is done once *symbolically*:

- the model inputs' free dims (every dim but those the traced program fixed) enter as sympy symbols of a
  ``torch.fx.experimental.symbolic_shapes.ShapeEnv`` (no duck sizing: equal sizes stay distinct symbols);
- the stages run on those fake tensors; every value's shape comes out as a formula of the symbols
  (``T``, ``T // 2``, ``B * T``...), and every decision an operator took on a size is recorded by the
  ShapeEnv as a *guard* (``T >= 2``, ``Eq(B * T, 64)``, ``T <= 40``...), with each symbol's value range;
- a :class:`ShapeTemplate` keeps the formulas, the guards and the value dtypes. For a later input shape it
  substitutes the sizes, and answers only when every guard and range holds there: then every operator
  takes the same path as in the symbolic run, so the shapes are the formulas' values and the dtypes are the
  run's (dtypes do not depend on sizes along one path; under autocast too, since the run is under it).
  Where a guard fails, a size was specialised to a constant (0/1 sizes are), or a formula is not an integer
  at those sizes, it answers None and the caller runs again (a new symbolic run, or the plain fake run).

Why not an affine map from two runs, or shapes sent with the messages: an affine fit is right only where
the model happens to be affine (``T // 2`` is not), and checking it needs the run it saves; sending shapes
costs a message per transfer and leaves a receiver unable to post its receive before the shape arrives.
The guards are what torch's own compilers trust to reuse a trace at another shape, and they are checked
here on every use, so a template never answers outside where its run is valid.

Every rank computes the same shapes: the template's answer equals the fake run's, which every rank does
from the same global batch; no message is needed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from fxpipe.core.fake_log import quiet_fake_tensor_log
from fxpipe.runtime.transport.fake_run import fake_layouts, run_stages

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram

Shape = tuple[int, ...]
Sizes = dict[sympy.Symbol, sympy.Integer]

MAX_TEMPLATES = 4  # symbolic runs kept per rank (LRU): a model specialised at some sizes needs a few


@dataclass(frozen=True)
class ShapeTemplate:
    """One symbolic run: each model input dim as a symbol or a constant, the guards, every value's shape formula
    and dtype. ``inputs``: per model input, its dims (a sympy Symbol, or an int the run fixed), None for a
    non-tensor input; ``objects``: the non-tensor inputs' values, which the run took as constants."""

    inputs: tuple[tuple[Any, ...] | None, ...]
    objects: tuple[Any, ...]
    guards: tuple[sympy.Basic, ...]
    shapes: Mapping[str, tuple[Any, ...]]
    dtypes: Mapping[str, torch.dtype]

    def sizes_of(self, inputs: Mapping[str, Any]) -> Sizes | None:
        """The symbols' values at model inputs given as ``(shape, dtype)`` (non-tensors as values), or None where
        a fixed dim or a non-tensor input differs, or a symbol would take two values."""
        sizes: Sizes = {}
        objects = []
        for dims, value in zip(self.inputs, inputs.values(), strict=True):
            if dims is None:
                objects.append(value)
                continue
            shape = value[0]
            if len(shape) != len(dims):
                return None
            for dim, size in zip(dims, shape, strict=True):
                if isinstance(dim, int):
                    if dim != size:
                        return None
                elif sizes.setdefault(dim, sympy.Integer(size)) != size:
                    return None
        return sizes if _same_objects(tuple(objects), self.objects) else None

    def layouts(self, inputs: Mapping[str, Any]) -> tuple[dict[str, Shape], dict[str, torch.dtype]] | None:
        """Every tensor value's shape and dtype at these inputs (as ``fake_layouts`` gives them), or None where
        the symbolic run does not cover them."""
        sizes = self.sizes_of(inputs)
        if sizes is None or not all(_holds(guard, sizes) for guard in self.guards):
            return None
        shapes: dict[str, Shape] = {}
        for name, dims in self.shapes.items():
            shape = tuple(_size(dim, sizes) for dim in dims)
            if any(size is None or size < 0 for size in shape):
                return None
            shapes[name] = shape  # type: ignore[assignment]
        return shapes, dict(self.dtypes)


def _same_objects(given: tuple[Any, ...], traced: tuple[Any, ...]) -> bool:
    try:
        return all(type(a) is type(b) and bool(a == b) for a, b in zip(given, traced, strict=True))
    except Exception:  # an object without a plain equality: never assume the run covers it
        return False


def _holds(guard: sympy.Basic, sizes: Sizes) -> bool:
    try:
        return guard.xreplace(sizes) is sympy.true
    except Exception:  # noqa: BLE001 - a guard that does not evaluate to True does not hold
        return False


def _size(dim: Any, sizes: Sizes) -> int | None:
    if isinstance(dim, int):
        return dim
    try:
        value = dim.xreplace(sizes)
    except Exception:  # noqa: BLE001 - no integer: the template does not cover these sizes
        return None
    return int(value) if isinstance(value, int | sympy.Integer) else None


def trace_template(program: SplitProgram, device: torch.device, autocast_dtype: torch.dtype | None,
                   inputs: Mapping[str, Any]) -> ShapeTemplate | None:
    """Run every stage once on fake tensors whose free dims are symbols (hints: ``inputs``, given as in
    ``fake_layouts``) and return the template, or None where the run leaves a shape it cannot express in the
    inputs' symbols (a data-dependent size). Raises what the stages raise at these shapes."""
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=env)
    known: dict[str, Any] = {}
    for name, value in inputs.items():
        spec = program.values[name]
        if not spec.is_tensor:
            known[name] = value
            continue
        free = set(range(len(value[0]))) - set(spec.fixed_dims) | ({spec.batch_dim} if spec.batched else set())
        context: Any = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC if dim in free else DimDynamic.STATIC
                                                          for dim in range(len(value[0]))])
        known[name] = mode.from_tensor(torch.empty(value[0], dtype=value[1], device="meta"),
                                       symbolic_context=context)
    with mode:
        known = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in known.items()}
        run_stages(program, device, autocast_dtype, mode, known, static_weights=True)
    return _template(program, env, inputs, known)


def _template(program: SplitProgram, env: ShapeEnv, inputs: Mapping[str, Any],
              known: Mapping[str, Any]) -> ShapeTemplate | None:
    input_dims = tuple(tuple(_expr(size) for size in known[name].shape) if program.values[name].is_tensor else None
                       for name in inputs)
    symbols = {dim for dims in input_dims if dims for dim in dims if isinstance(dim, sympy.Symbol)}
    if any(dims and not all(isinstance(dim, int | sympy.Symbol) for dim in dims) for dims in input_dims):
        return None  # an input dim the run tied to another: keep it simple, run again at such sizes
    guards: list[sympy.Basic] = [guard.expr for guard in env.guards]
    guards += [sympy.Eq(symbol, value) for symbol, value in env.replacements.items()]
    for symbol in symbols:
        bounds = env.var_to_range.get(symbol)
        if bounds is not None:
            guards += [symbol >= bounds.lower] if isinstance(bounds.lower, sympy.Integer) else []
            guards += [symbol <= bounds.upper] if isinstance(bounds.upper, sympy.Integer) else []
    tensors = {name: value for name, value in known.items() if isinstance(value, torch.Tensor)}
    shapes = {name: tuple(_expr(size) for size in value.shape) for name, value in tensors.items()}
    free = set().union(*(guard.free_symbols for guard in guards),
                       *(dim.free_symbols for dims in shapes.values() for dim in dims if not isinstance(dim, int)))
    if not free <= symbols:
        return None  # a size that depends on data (an unbacked symbol): only a fake run at the sizes knows
    objects = tuple(value for name, value in inputs.items() if not program.values[name].is_tensor)
    template = ShapeTemplate(input_dims, objects, tuple(dict.fromkeys(guards)), shapes,
                             {name: value.dtype for name, value in tensors.items()})
    hints = {name: tuple(int(size) for size in value.shape) for name, value in tensors.items()}
    answer = template.layouts(inputs)
    if answer is None or answer[0] != hints:  # the formulas must give the run's own sizes back
        return None
    return template


def _expr(size: Any) -> Any:
    """A dim of a fake tensor: an int, or the sympy expression of a SymInt (an int when it is a constant)."""
    if isinstance(size, int):
        return size
    expr = size.node.expr
    return int(expr) if isinstance(expr, sympy.Integer) else expr


class ShapeTemplates:
    """The templates of one pipeline's rank, least recently used first (at most MAX_TEMPLATES): ``layouts``
    answers from one that covers the inputs, else makes a new one, else runs the plain fake run. ``counts``
    says how often each path ran (tests and benchmarks read it)."""

    def __init__(self, program: SplitProgram, device: torch.device, autocast_dtype: torch.dtype | None) -> None:
        self.program, self.device, self.autocast_dtype = program, device, autocast_dtype
        self.templates: OrderedDict[int, ShapeTemplate] = OrderedDict()
        self.symbolic = True  # False once a symbolic run failed where the plain run did not
        self.counts = {"template": 0, "symbolic": 0, "fake": 0}
        self._next_key = itertools.count()

    def layouts(self, inputs: Mapping[str, Any]) -> tuple[dict[str, Shape], dict[str, torch.dtype]]:
        """Shape and dtype of every tensor value at model inputs given as ``(shape, dtype)`` (non-tensors as
        their values): exactly what ``fake_layouts`` returns. Raises what the stages raise at these shapes."""
        for key, template in self.templates.items():
            answer = template.layouts(inputs)
            if answer is not None:
                self.templates.move_to_end(key)
                self.counts["template"] += 1
                return answer
        with quiet_fake_tensor_log():
            return self._run(inputs)

    def _run(self, inputs: Mapping[str, Any]) -> tuple[dict[str, Shape], dict[str, torch.dtype]]:
        if self.symbolic:
            try:
                traced = trace_template(self.program, self.device, self.autocast_dtype, inputs)
            except Exception:  # the plain run says whether the model runs at these sizes (raising its error)
                answer = fake_layouts(self.program, self.device, self.autocast_dtype, inputs)
                self.symbolic = False  # it does, but not symbolically: plain runs from now on
                self.counts["fake"] += 1
                return answer
            if traced is not None:
                self._keep(traced)
                covered = traced.layouts(inputs)
                if covered is not None:
                    self.counts["symbolic"] += 1
                    return covered
        self.counts["fake"] += 1
        return fake_layouts(self.program, self.device, self.autocast_dtype, inputs)

    def _keep(self, template: ShapeTemplate) -> None:
        self.templates[next(self._next_key)] = template
        if len(self.templates) > MAX_TEMPLATES:
            self.templates.popitem(last=False)
