"""Zero-bubble's split backward for a compiled stage: its joint forward+backward graph cut into F, B and W graphs.

A compiled stage is one autograd node, so the eager split (:mod:`fxpipe.runtime.autograd.split_backward`) has no
join to capture gradients at. Instead the stage's joint graph is traced once per input shape
(``make_fx`` over ``torch.autograd.grad``, on fake tensors, so tracing touches no buffer) and its nodes
are partitioned: F holds every node that does not depend on the output gradients (the stage's outputs,
its buffer writes, and the values B and W read later), B the nodes the input gradients need, W the rest
of what the parameter gradients need. Each part is compiled with the stage's torch.compile settings and
runs under ``no_grad`` as a plain function. docs/compile.md says what is and is not split.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

from fxpipe.runtime.autograd.split_backward import accumulate


class SplitUnsupported(Exception):
    """The stage's joint graph cannot be cut into B and W (the message says why); the stage runs W inside B."""


@dataclass
class SplitGraphs:
    """One input shape's compiled F, B and W, and where their values go.

    F: ``(params, buffers, inputs) -> (tensor outputs, saved)``; B: ``(saved_b, output grads) -> (input grads,
    kept)``; W: ``(saved_w, kept) -> parameter grads``. ``*_index`` lists pick from F's saved values.
    """

    forward: Callable[..., Any]
    input_grads: Callable[..., Any]
    weight_grads: Callable[..., Any]
    num_results: int  # the stage's outputs
    constants: dict[int, Any]  # its outputs that are not tensors, by index: fixed at a given input shape
    differentiable_outputs: tuple[int, ...]  # the outputs that take a gradient (B's gradient inputs, in order)
    saved_for_b: tuple[int, ...]
    saved_for_w: tuple[int, ...]
    input_grad_slots: tuple[int | None, ...]  # per differentiable input: its slot in B's outputs (None: unused)
    param_grad_slots: tuple[int | None, ...]  # per trained parameter: its slot in W's outputs (None: unused)


@dataclass
class SplitSaved:
    """One micro-batch between F and B: what B and W read, and the graphs of its shape."""

    graphs: SplitGraphs
    saved: list[Any]


@dataclass
class CompiledWeightWork:
    """One micro-batch between B and W: W's inputs and the parameters it gives gradients."""

    graphs: SplitGraphs
    inputs: list[Any]
    params: list[torch.nn.Parameter]


def _random_ops(graph: fx.Graph) -> list[str]:
    """The ops of ``graph`` that draw random numbers (F and a W computed later could not agree on them)."""
    found = []
    for node in graph.nodes:
        tags = getattr(node.target, "tags", ())
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags:
            found.append(str(node.target))
    return sorted(set(found))


def _dependents(graph: fx.Graph, sources: Sequence[fx.Node]) -> set[fx.Node]:
    """``sources`` and every node computed from them."""
    reached = set(sources)
    for node in graph.nodes:  # topological order
        if any(arg in reached for arg in node.all_input_nodes):
            reached.add(node)
    return reached


def _ancestors(roots: Sequence[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    """The nodes of ``within`` that ``roots`` are computed from (``roots`` included when inside)."""
    found: set[fx.Node] = set()
    stack = [node for node in roots if node in within]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(arg for arg in node.all_input_nodes if arg in within)
    return found


def _extract(root: fx.GraphModule, part: set[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]
             ) -> fx.GraphModule:
    """A GraphModule of the ``part`` nodes of ``root`` (in graph order, its constants copied), reading
    ``inputs`` and returning ``outputs``."""
    graph = root.graph
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for index, node in enumerate(inputs):
        env[node] = new.placeholder(f"in_{index}")
        env[node].meta = dict(node.meta)
    for node in graph.nodes:
        if node in part and node not in env:
            env[node] = new.node_copy(node, lambda arg: env[arg])
    new.output(tuple(env[node] for node in outputs))
    module = fx.GraphModule(root, new)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


def _flat_outputs(graph: fx.Graph) -> list[Any]:
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    return list(torch.utils._pytree.tree_leaves(output.args[0]))


@dataclass
class _Joint:
    """The stage's joint graph over ``(params, buffers, inputs, output grads)``; it returns the tensor outputs, then
    the gradients of the inputs and parameters that have one."""

    module: fx.GraphModule
    num_results: int
    constants: dict[int, Any]  # the outputs that are not tensors, by index (the graph does not return them)
    differentiable_outputs: tuple[int, ...]  # the outputs that take a gradient, by index
    input_has_grad: tuple[bool, ...]  # per differentiable input
    param_has_grad: tuple[bool, ...]  # per trained parameter


def trace_joint(module: torch.nn.Module, params: Mapping[str, torch.nn.Parameter], buffers: Mapping[str, Any],
                args: Sequence[Any], differentiable: Sequence[bool], copied: Sequence[bool]) -> _Joint:
    """The stage's joint graph on fake tensors (tracing writes no buffer): ``functional_call`` then
    ``torch.autograd.grad`` to the differentiable inputs and the parameters. ``copied``: inputs the stage
    writes in place, cloned first as the eager runner does."""
    names = list(params)
    found: dict[str, Any] = {}

    def outputs_of(param_values: list[Any], buffer_values: list[Any], inputs: list[Any]) -> tuple[list[Any], list[Any]]:
        leaves = [value.detach().requires_grad_(True) if grad else value
                  for value, grad in zip(inputs, differentiable, strict=True)]
        call_args = [leaf.clone() if copy else leaf for leaf, copy in zip(leaves, copied, strict=True)]
        weights = [value.detach().requires_grad_(True) for value in param_values]
        state = {**dict(zip(names, weights, strict=True)), **dict(zip(buffers, buffer_values, strict=True))}
        with torch.enable_grad():
            results = list(functional_call(module, state, tuple(call_args)))
        return results, [*[leaf for leaf, grad in zip(leaves, differentiable, strict=True) if grad], *weights]

    def probe(param_values: list[Any], buffer_values: list[Any], inputs: list[Any]) -> Any:
        results = outputs_of(param_values, buffer_values, inputs)[0]
        found["taking"] = [(i, tuple(r.shape), r.dtype, r.device) for i, r in enumerate(results)
                           if isinstance(r, torch.Tensor) and r.requires_grad]
        return [r for r in results if isinstance(r, torch.Tensor)]

    def joint(param_values: list[Any], buffer_values: list[Any], inputs: list[Any], grads: list[Any]) -> Any:
        results, wrt = outputs_of(param_values, buffer_values, inputs)
        gradients = torch.autograd.grad([results[i] for i, *_ in found["taking"]], wrt, grads, allow_unused=True)
        found["has_grad"] = tuple(grad is not None for grad in gradients)
        found["num_results"] = len(results)
        found["constants"] = {i: r for i, r in enumerate(results) if not isinstance(r, torch.Tensor)}
        return (*[r for r in results if isinstance(r, torch.Tensor)], *[g for g in gradients if g is not None])

    make_fx(probe, tracing_mode="fake")(list(params.values()), list(buffers.values()), list(args))
    if not found["taking"]:
        raise SplitUnsupported("none of its outputs takes a gradient")
    grads = [torch.empty(size, dtype=dtype, device=device) for _, size, dtype, device in found["taking"]]
    traced = make_fx(joint, tracing_mode="fake")(list(params.values()), list(buffers.values()), list(args), grads)
    num_inputs = sum(differentiable)
    return _Joint(traced, found["num_results"], found["constants"], tuple(i for i, *_ in found["taking"]),
                  found["has_grad"][:num_inputs], found["has_grad"][num_inputs:])


@dataclass
class _Cut:
    """The joint graph's parts: F's saved values and the nodes of F, B and W."""

    forward_part: set[fx.Node]
    input_part: set[fx.Node]
    weight_part: set[fx.Node]
    saved: list[fx.Node]
    saved_for_b: list[fx.Node]
    saved_for_w: list[fx.Node]
    kept: list[fx.Node]  # B's values that W reads


def _external(part: set[fx.Node], outputs: Sequence[fx.Node]) -> list[fx.Node]:
    """The nodes outside ``part`` that its nodes or ``outputs`` read, in first-use order."""
    found: dict[fx.Node, None] = {}
    for node in sorted(part, key=_position):
        for arg in node.all_input_nodes:
            if arg not in part:
                found.setdefault(arg)
    for node in outputs:
        if node not in part:
            found.setdefault(node)
    return list(found)


def _position(node: fx.Node) -> int:
    return node.meta["fxpipe.position"]  # type: ignore[no-any-return]


def cut_joint(graph: fx.Graph, num_outputs: int, num_input_grads: int) -> _Cut:
    """Partition ``graph`` (placeholders: params, buffers, inputs, then ``grads_*`` output gradients)."""
    for index, node in enumerate(graph.nodes):
        node.meta["fxpipe.position"] = index
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    grads = [node for node in placeholders if node.name.startswith("grads")]
    results = _flat_outputs(graph)
    input_grads = results[num_outputs:num_outputs + num_input_grads]
    param_grads = results[num_outputs + num_input_grads:]
    computed = {node for node in graph.nodes if node.op not in ("placeholder", "output")}
    backward = _dependents(graph, grads)
    forward_part = computed - backward
    input_part = _ancestors(input_grads, backward - set(grads))
    weight_part = _ancestors(param_grads, backward - set(grads)) - input_part
    from_forward = set(forward_part) | set(placeholders) - set(grads)
    saved_for_b = [n for n in _external(input_part, [*input_grads]) if n in from_forward]
    w_external = _external(weight_part, param_grads)
    saved_for_w = [n for n in w_external if n in from_forward]
    kept = [n for n in w_external if n not in from_forward]
    assert all(n in input_part or n in grads for n in kept), "W reads a value neither F nor B computes"
    saved = list(dict.fromkeys([*saved_for_b, *saved_for_w]))
    return _Cut(forward_part, input_part, weight_part, saved, saved_for_b, saved_for_w, kept)


def build_split(module: torch.nn.Module, params: Mapping[str, torch.nn.Parameter], buffers: Mapping[str, Any],
                args: Sequence[Any], differentiable: Sequence[bool], copied: Sequence[bool],
                compile_graph: Callable[[fx.GraphModule], Callable[..., Any]]) -> SplitGraphs:
    """Trace, cut and compile one input shape's F, B and W (``compile_graph``: torch.compile with the stage's
    settings). Raises :class:`SplitUnsupported` when the joint graph cannot be cut (the message says why)."""
    joint = trace_joint(module, params, buffers, args, differentiable, copied)
    graph = joint.module.graph
    random = _random_ops(graph)
    if random:
        raise SplitUnsupported(f"its graph draws random numbers ({', '.join(random)}), which F and a later W "
                               "would draw apart")
    num_outputs = joint.num_results - len(joint.constants)
    num_input_grads = sum(joint.input_has_grad)
    results = _flat_outputs(graph)
    if len(results) != num_outputs + num_input_grads + sum(joint.param_has_grad) or \
            not all(isinstance(node, fx.Node) for node in results):
        raise SplitUnsupported(f"its joint graph returns {results!r}, not one value per tensor output and gradient")
    cut = cut_joint(graph, num_outputs, num_input_grads)
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    grads = [node for node in placeholders if node.name.startswith("grads")]
    primals = [node for node in placeholders if node not in grads]
    input_grads = results[num_outputs:num_outputs + num_input_grads]
    param_grads = results[num_outputs + num_input_grads:]
    forward = _extract(joint.module, cut.forward_part, primals, [*results[:num_outputs], *cut.saved])
    backward_input = _extract(joint.module, cut.input_part, [*cut.saved_for_b, *grads], [*input_grads, *cut.kept])
    backward_weight = _extract(joint.module, cut.weight_part, [*cut.saved_for_w, *cut.kept], param_grads)
    slot = {node: index for index, node in enumerate(cut.saved)}
    return SplitGraphs(forward=compile_graph(forward), input_grads=compile_graph(backward_input),
                       weight_grads=compile_graph(backward_weight), num_results=joint.num_results,
                       constants=joint.constants, differentiable_outputs=joint.differentiable_outputs,
                       saved_for_b=tuple(slot[n] for n in cut.saved_for_b),
                       saved_for_w=tuple(slot[n] for n in cut.saved_for_w),
                       input_grad_slots=_slots(joint.input_has_grad), param_grad_slots=_slots(joint.param_has_grad))


def _slots(present: Sequence[bool]) -> tuple[int | None, ...]:
    """Each item's index among the present ones (None where absent)."""
    slots: list[int | None] = []
    count = 0
    for here in present:
        slots.append(count if here else None)
        count += here
    return tuple(slots)


def _shape_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype, value.device, value.requires_grad)
    return (type(value).__name__, repr(value))


class SplitCompiledStage:
    """F, B and W of one compiled stage under a split-backward schedule, built per input shape.

    ``compile_graph`` compiles one part (torch.compile with the stage's settings, booked to its stats);
    ``fall_back(reason)`` is called once when the joint graph cannot be cut, after which :meth:`forward`
    returns None and the stage runs its whole backward in B.
    """

    def __init__(self, module: torch.nn.Module, compile_graph: Callable[[fx.GraphModule], Callable[..., Any]],
                 fall_back: Callable[[str], None]) -> None:
        self.module = module
        self._compile_graph = compile_graph
        self._fall_back = fall_back
        self._graphs: dict[Any, SplitGraphs] = {}
        self.failed = False
        self.num_weight_passes = 0  # W passes run after their B (a stage without differentiable inputs runs W in B)

    @property
    def num_shapes(self) -> int:
        return len(self._graphs)

    def forward(self, args: Sequence[Any], differentiable: Sequence[bool], copied: Sequence[bool]
                ) -> tuple[list[Any], SplitSaved] | None:
        """F: the stage's outputs and what B and W read (None: the stage cannot be cut, run it whole)."""
        if self.failed:
            return None
        params = {name: p for name, p in self.module.named_parameters() if p.requires_grad}
        frozen = {name: p for name, p in self.module.named_parameters() if not p.requires_grad}
        buffers = {**frozen, **dict(self.module.named_buffers())}
        key = (tuple(_shape_key(a) for a in args), tuple(differentiable), tuple(params), tuple(frozen),
               tuple(m.training for m in self.module.modules()))
        graphs = self._graphs.get(key)
        if graphs is None:
            try:
                graphs = build_split(self.module, params, buffers, args, differentiable, copied, self._compile_graph)
            except SplitUnsupported as error:
                self._failed(str(error))
                return None
            except Exception as error:  # noqa: BLE001 - any tracing failure: the whole backward in B, said so
                self._failed(f"tracing its joint graph failed ({type(error).__name__}: {error})")
                return None
            self._graphs[key] = graphs
        with torch.no_grad():
            results = list(graphs.forward(*params.values(), *buffers.values(), *args))
        num_tensors = graphs.num_results - len(graphs.constants)
        tensors = iter(results[:num_tensors])
        outputs = [graphs.constants[i] if i in graphs.constants else next(tensors) for i in range(graphs.num_results)]
        return outputs, SplitSaved(graphs, results[num_tensors:])

    def _failed(self, reason: str) -> None:
        self.failed = True
        self._graphs.clear()
        self._fall_back(reason)

    def backward_input(self, saved: SplitSaved, output_grads: Sequence[torch.Tensor]
                       ) -> tuple[list[torch.Tensor | None], CompiledWeightWork]:
        """B: the gradient of every differentiable input (None when unused) and W's work.

        ``output_grads``: one per differentiable output (``saved.graphs.differentiable_outputs``).
        """
        graphs = saved.graphs
        with torch.no_grad():
            results = list(graphs.input_grads(*[saved.saved[i] for i in graphs.saved_for_b], *output_grads))
        num_input_grads = sum(slot is not None for slot in graphs.input_grad_slots)
        grads = [None if slot is None else results[slot] for slot in graphs.input_grad_slots]
        weight_inputs = [*[saved.saved[i] for i in graphs.saved_for_w], *results[num_input_grads:]]
        saved.saved = []  # F's values are B's and W's inputs now; free the rest
        params = [p for p in self.module.parameters() if p.requires_grad]
        with_grad = [p for p, slot in zip(params, graphs.param_grad_slots, strict=True) if slot is not None]
        return grads, CompiledWeightWork(graphs, weight_inputs, with_grad)

    def backward_weight(self, work: CompiledWeightWork, on_gradient: Callable[[torch.nn.Parameter], None] | None,
                        deferred: bool = True) -> None:
        """W: accumulate the parameter gradients into ``.grad``; ``on_gradient(param)`` after each."""
        with torch.no_grad():
            grads = list(work.graphs.weight_grads(*work.inputs))
        work.inputs = []
        accumulate(work.params, grads)
        self.num_weight_passes += deferred
        if on_gradient is not None:
            for param in work.params:
                on_gradient(param)
