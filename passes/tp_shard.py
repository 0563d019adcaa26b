"""shard_stage: one stage's GraphModule rewritten for one member of a T-way tensor-parallel group."""

from __future__ import annotations

import copy
import functools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from fxpipe.core import meta
from fxpipe.passes import tensor_parallel_ops as ops
from fxpipe.passes.tensor_parallel import VocabParallel, embedding_ids, vocab_parallel_ends
from fxpipe.passes.tp_plan import StagePlanTP, plan_stage_split
from fxpipe.passes.tp_rules import SHAPE_FREE_READS, SIZE_READS, LinearInfo, input_of, linear_info, op_name
from fxpipe.passes.tp_sequence import SEQUENCE_DIM, SequenceSplit, boundary_inputs, sequence_split
from fxpipe.passes.tp_sequence_columns import keep_token_shares
from fxpipe.passes.tp_shapes import NodeShapes, node_shapes
from fxpipe.passes.tp_sizes import local_args, needs_grad, parameters_read, whole_grad_region

__all__ = ["TensorParallelParameter", "TensorParallelStage", "shard_stage"]


@dataclass(frozen=True)
class TensorParallelParameter:
    """One parameter of a member's stage: its original ``name``, attribute ``path`` in the member's module, the
    ``dim`` split over the group (None: whole on every member), the full tensor's shape, and whether the member's
    gradient is only its part (``partial_grad``: sum it over the group before the optimizer steps)."""

    name: str
    path: str
    dim: int | None
    full_shape: tuple[int, ...]
    partial_grad: bool = False
    parts: tuple[int, ...] | None = None  # fused q/k/v: the full part sizes along dim; a member holds 1/T of each


@dataclass(frozen=True)
class TensorParallelStage:
    """What :func:`shard_stage` returns. ``vocab_parallel_logits``: with ``parallel_loss``, ``(output value name,
    vocab start, vocab size)`` of logits left split over the vocabulary (the loss is then
    :func:`fxpipe.passes.tensor_parallel_ops.vocab_parallel_cross_entropy`)."""

    module: fx.GraphModule
    degree: int
    rank: int
    group_key: str
    parameters: tuple[TensorParallelParameter, ...]
    notes: tuple[str, ...]
    vocab_parallel_logits: tuple[str, int, int] | None = None
    sequence_boundary: frozenset[str] = frozenset()  # inputs taken and outputs left split over the tokens


class TensorParallelError(ValueError):
    """shard_stage was given a degree or rank it cannot use."""


def shard_stage(gm: fx.GraphModule, degree: int, rank: int, *, group_key: str = "tp",
                example_inputs: Any = None, parallel_loss: bool = False,
                sequence_parallel: bool = False, sequence_boundary: frozenset[str] = frozenset(),
                ) -> TensorParallelStage:
    """Return member ``rank``'s copy of the stage ``gm`` for a ``degree``-way group registered under ``group_key``.

    Column linears keep their output rows (fused q/k/v: each part's), row linears their input columns and sum over
    the group; reshapes take the local head counts; whole operands meeting split heads (GQA kv heads kept whole)
    are sliced locally. Token embeddings and output heads split over the vocabulary when ``degree`` divides it;
    the logits are gathered unless ``parallel_loss`` (then they stay split when the head feeds the output
    directly). Stage inputs and outputs stay whole. ``gm`` is not changed; whole parameters are shared with it,
    split ones are new tensors.

    With ``sequence_parallel`` the whole token-row nodes between pairs (norms, dropout, residual adds on
    ``(batch, tokens, width)``) run on each member's share of the tokens: row sums are reduce-scattered over the
    tokens, column inputs all-gathered, whole inputs split after the boundary and outputs gathered before it; the
    parameters those nodes read get partial gradients. It applies when the example's token count splits
    ``degree`` ways (other lengths must split too, or the stage raises a ValueError naming the length).
    ``sequence_boundary`` names placeholders that arrive split over the tokens (member j holds the j-th share) and
    output nodes to leave split, where they are token rows; the result's ``sequence_boundary`` says which were.
    """
    if degree < 1 or not 0 <= rank < degree:
        raise TensorParallelError(f"shard_stage needs 1 <= degree and 0 <= rank < degree; got degree={degree}, "
                                  f"rank={rank}")
    if degree == 1:  # a group of one: the stage as it is, no collectives (nothing to register)
        module = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
        module.meta.update(copy.copy(gm.meta))
        names: dict[str, str] = gm.meta.get(meta.PARAM_NAMES, {})
        whole = tuple(TensorParallelParameter(names.get(path, path), path, None, tuple(parameter.shape))
                      for path, parameter in module.named_parameters())
        return TensorParallelStage(module, 1, 0, group_key, whole, ("tensor parallel 0/1: stage unchanged",))
    shapes = node_shapes(gm, example_inputs)
    plan = plan_stage_split(gm, shapes, degree)
    vocab = {end.node: end for end in vocab_parallel_ends(gm, plan.states, shapes) if end.vocab_size % degree == 0}
    rewriter = _Rewriter(gm, shapes, plan, vocab, degree, rank, group_key, parallel_loss, sequence_parallel,
                         sequence_boundary)
    module = rewriter.run()
    notes = [f"tensor parallel {rank}/{degree}: split {len(plan.states.columns)} column and "
             f"{len(plan.states.rows)} row linears, vocabulary-parallel {sorted(vocab) or 'none'}", *plan.notes]
    notes += [f"linear {name} whole: {why}" for name, why in sorted(plan.states.replicated.items())
              if name not in vocab]
    if rewriter.token_share_inputs:
        notes.append(f"sequence parallel: {rewriter.token_share_inputs} column inputs saved as token shares and "
                     "gathered again in backward")
    return TensorParallelStage(module, degree, rank, group_key, rewriter.parameters(module), tuple(notes),
                               rewriter.vocab_logits, frozenset(rewriter.boundary))


@dataclass
class _Split:
    dim: int
    full_shape: tuple[int, ...]
    parts: tuple[int, ...] | None = None


@dataclass
class _Rewriter:
    gm: fx.GraphModule
    shapes: NodeShapes
    plan: StagePlanTP
    vocab: dict[str, VocabParallel]
    degree: int
    rank: int
    key: str
    parallel_loss: bool
    sequence_parallel: bool = False
    sequence_boundary: frozenset[str] = frozenset()
    boundary: set[str] = field(default_factory=set)  # the boundary values taken or left split
    graph: fx.Graph = field(default_factory=fx.Graph)
    env: dict[fx.Node, fx.Node] = field(default_factory=dict)
    entries: dict[tuple[Any, ...], fx.Node] = field(default_factory=dict)  # (value, collective, dim) -> its node
    sequence: SequenceSplit = field(default_factory=lambda: SequenceSplit(frozenset(), frozenset(), 0))
    seq_values: set[fx.Node] = field(default_factory=set)
    splits: dict[str, _Split] = field(default_factory=dict)  # attribute path -> how it splits
    partial: set[str] = field(default_factory=set)
    whole_grad: set[fx.Node] = field(default_factory=set)
    grads: set[fx.Node] = field(default_factory=set)
    shared: dict[tuple[int, int, tuple[int, ...] | None], nn.Parameter] = field(default_factory=dict)
    vocab_logits: tuple[str, int, int] | None = None
    token_share_inputs: int = 0  # column inputs saved as token shares (fxpipe.passes.tp_sequence_columns)

    def run(self) -> fx.GraphModule:
        self.whole_grad, self.partial = whole_grad_region(self.gm, self.plan, self.shapes)
        self.grads = needs_grad(self.gm, self.shapes)
        whole_grad = self.whole_grad
        if self.sequence_parallel:
            excluded = whole_grad | {node for node in self.gm.graph.nodes if node.name in self.vocab}
            self.sequence = sequence_split(self.gm, self.plan, self.shapes, excluded, self.degree)
            self.seq_values = set(self.sequence.nodes | self.sequence.rows)
            self.partial |= parameters_read(self.gm, self.sequence.nodes)
            taken = boundary_inputs(self.gm, self.shapes, self.sequence, self.sequence_boundary)
            self.seq_values |= taken
            self.boundary |= {node.name for node in taken}
        for node in self.gm.graph.nodes:
            made_before = len(self.graph.nodes)
            self._rewrite(node, whole_grad)
            _mark_origin(self.graph, len(self.graph.nodes) - made_before, node.name)
        self.token_share_inputs = keep_token_shares(self.graph) if self.sequence.tokens else 0
        module = fx.GraphModule(self.gm, self.graph, class_name=type(self.gm).__name__)
        module.meta.update(copy.copy(self.gm.meta))
        for path, split in self.splits.items():
            original = self.gm.get_parameter(path)
            key = (id(original), split.dim, split.parts)  # a tied weight split alike stays one parameter
            if key not in self.shared:
                self.shared[key] = self._shard(original, split)
            _set_parameter(module, path, self.shared[key])
        return module

    def _rewrite(self, node: fx.Node, whole_grad: set[fx.Node]) -> None:
        """``self.env[node]``: the member's node(s) for ``node``, appended to the member's graph."""
        states, name = self.plan.states, op_name(self.gm, node)
        if node.op == "output" and self.sequence_boundary:
            self.env[node] = self.graph.node_copy(node, self._leaving)
        elif node.name in states.columns and node in states.states:
            self.env[node] = self._column(node, states.columns[node.name])
        elif node in states.rows:
            self.env[node] = self._row(node, self._info(node, name))
        elif node.name in self.vocab:
            self.env[node] = self._vocab(node, name, self.vocab[node.name])
        elif node in states.states:
            self.env[node] = self._split_op(node, name)
        elif node in whole_grad:
            self.env[node] = self.graph.node_copy(node, lambda arg: self._entered(arg, whole_grad))
        elif node in self.seq_values:
            self.env[node] = self.graph.node_copy(node, functools.partial(self._token_share, node))
        elif name in SIZE_READS and _size_dim(node) is not None and node.args[0] in self.seq_values:
            self.env[node] = self._token_size(node)
        elif name in SHAPE_FREE_READS:  # ndim, export's metadata assertions (trace_export strips what they assert):
            # the value as the member holds it, not gathered (an all-gather per read, per layer, for nothing)
            self.env[node] = self.graph.node_copy(node, lambda arg: self.env[arg])
        else:
            self.env[node] = self.graph.node_copy(node, self._full)

    # -- values
    def _entered(self, arg: fx.Node, inside: set[fx.Node]) -> fx.Node:
        """``arg`` as read inside a split region: values from outside pass copy_to_group (backward sums the
        members' partial gradients)."""
        if arg in self.seq_values:  # tokens split: gather them; backward reduce-scatters the partial gradients
            return self._cached(arg, ops.gather_sequence, SEQUENCE_DIM)
        if arg in inside or arg.op == "get_attr" or arg not in self.grads:
            return self.env[arg]
        return self._cached(arg, ops.copy_to_group)

    def _full(self, arg: fx.Node) -> fx.Node:
        """``arg`` as a whole node reads it: tokens gathered (backward: each member keeps its tokens' gradient)."""
        if arg in self.seq_values:
            return self._cached(arg, ops.gather_from_group, SEQUENCE_DIM)
        return self.env[arg]

    def _leaving(self, arg: fx.Node) -> fx.Node:
        """``arg`` as the stage output holds it: split over the tokens when named in the boundary, else as read whole."""
        if arg in self.seq_values and arg.name in self.sequence_boundary:
            self.boundary.add(arg.name)
            return self.env[arg]
        return self._full(arg)

    def _token_share(self, node: fx.Node, arg: fx.Node) -> fx.Node:
        """``arg`` as a sequence-parallel node reads it: a whole value with the tokens along the token dim is split."""
        if arg in self.seq_values:
            return self.env[arg]
        shape, out_shape = self.shapes.find(arg) or (), self.shapes.get(node)
        dim = SEQUENCE_DIM - (len(out_shape) - len(shape)) if shape else -1
        if dim < 0 or not all(isinstance(size, int) for size in shape) or shape[dim] != self.sequence.tokens:
            return self.env[arg]
        return self._cached(arg, ops.split_sequence, dim)

    def _token_size(self, node: fx.Node) -> fx.Node:
        """A size read of a value split over the tokens, read on the member's share (times T along the tokens)."""
        size = self.graph.node_copy(node, lambda arg: self.env[arg])
        dim = _size_dim(node)
        ndim = len(self.shapes.get(node.args[0]))  # type: ignore[arg-type]
        if dim is not None and dim % ndim == SEQUENCE_DIM:
            return self.graph.call_function(operator.mul, (size, self.degree))
        return size

    def _cached(self, arg: fx.Node, function: Any, *extra: Any) -> fx.Node:
        key = (arg, function, *extra)
        if key not in self.entries:
            self.entries[key] = self.graph.call_function(function, (self.env[arg], self.key, *extra))
        return self.entries[key]

    def _get_attr(self, path: str) -> fx.Node:
        return self.graph.get_attr(path)

    def _info(self, node: fx.Node, name: str) -> LinearInfo:
        info = linear_info(self.gm, node, name)
        assert info is not None, node
        return info

    # -- ops
    def _column(self, node: fx.Node, info: LinearInfo) -> fx.Node:
        parts = self.plan.states.fused.get(node.name)
        self.splits[info.weight] = _Split(info.out_dim, self._shape(info.weight), parts)
        if info.bias is not None:
            self.splits[info.bias] = _Split(0, self._shape(info.bias), parts)
        return self._matmul(info, self._entered(input_of(info), self.whole_grad), with_bias=True)

    def _row(self, node: fx.Node, info: LinearInfo) -> fx.Node:
        self.splits[info.weight] = _Split(1 - info.out_dim, self._shape(info.weight))
        out = self._matmul(info, self.env[input_of(info)], with_bias=False)
        if node in self.seq_values:  # the sum lands split over the tokens; the bias is added per token share
            summed = self.graph.call_function(ops.reduce_scatter_sequence, (out, self.key, SEQUENCE_DIM))
            if info.bias is not None:
                self.partial.add(info.bias)
        else:
            summed = self.graph.call_function(ops.reduce_from_group, (out, self.key))
        if info.bias is None:
            return summed
        return self.graph.call_function(ops.add_bias, (summed, self._get_attr(info.bias)))

    def _matmul(self, info: LinearInfo, x: fx.Node, *, with_bias: bool) -> fx.Node:
        weight = self._get_attr(info.weight)
        bias = self._get_attr(info.bias) if with_bias and info.bias is not None else None
        if info.out_dim == 0:
            return self.graph.call_function(F.linear, (x, weight, bias))
        out = self.graph.call_function(torch.mm, (x, weight))
        return out if bias is None else self.graph.call_function(ops.add_bias, (out, bias))

    def _vocab(self, node: fx.Node, name: str, end: VocabParallel) -> fx.Node:
        local = end.vocab_size // self.degree
        start = self.rank * local
        if end.kind == "embedding":
            path = end.path
            self.splits[path] = _Split(0, self._shape(path))
            ids = embedding_ids(node)
            return self.graph.call_function(ops.vocab_embedding, (self._full(ids), self._get_attr(path), self.key, start))
        info = self._info(node, name)
        self.splits[info.weight] = _Split(info.out_dim, self._shape(info.weight))
        if info.bias is not None:
            self.splits[info.bias] = _Split(0, self._shape(info.bias))
        logits = self._matmul(info, self._entered(input_of(info), self.whole_grad), with_bias=True)
        if self.parallel_loss and all(user.op == "output" for user in node.users):
            self.vocab_logits = (node.name, start, end.vocab_size)  # the loss takes them split; predict gathers them
            return self.graph.call_function(ops.gather_for_inference, (logits, self.key, -1))
        return self.graph.call_function(ops.gather_from_group, (logits, self.key, -1))

    def _split_op(self, node: fx.Node, name: str) -> fx.Node:
        sliced = {arg: self._local_slice(node, arg) for arg in self.plan.local_slices.get(node, [])}
        state = self.plan.states.states[node]
        mapped_args = fx.node.map_arg(node.args, lambda arg: sliced.get(arg) or self._full(arg))
        mapped_kwargs = fx.node.map_arg(node.kwargs, lambda arg: sliced.get(arg) or self._full(arg))

        def divide(size: Any, always: bool = False) -> Any:
            if isinstance(size, fx.Node):  # a size read from a whole value (x.shape): the full extent at run time
                return self.graph.call_function(operator.floordiv, (size, self.degree))
            return size // self.degree if isinstance(size, int) and (always or size == state.extent) else size

        args, kwargs = local_args(node, list(mapped_args), dict(mapped_kwargs), name, state, self.shapes, divide)
        new = self.graph.create_node(node.op, node.target, args, kwargs, name=node.name)
        new.meta = copy.copy(node.meta)
        return new

    def _local_slice(self, node: fx.Node, arg: fx.Node) -> fx.Node:
        state = self.plan.states.states[node]
        reference = node.all_input_nodes[0] if op_name(self.gm, node) == "scaled_dot_product_attention" else node
        dim = state.dim - (len(self.shapes.get(reference)) - len(self.shapes.get(arg)))
        local = state.extent // self.degree
        whole = self._entered(arg, self.whole_grad)  # a value also used outside: its sliced gradient is summed
        return self.graph.call_function(torch.narrow, (whole, dim, self.rank * local, local))

    # -- parameters
    def _shape(self, path: str) -> tuple[int, ...]:
        return tuple(self.gm.get_parameter(path).shape)

    def _shard(self, tensor: torch.Tensor, split: _Split) -> nn.Parameter:
        pieces, start = [], 0
        for size in split.parts or (tensor.shape[split.dim],):
            local = size // self.degree
            pieces.append(tensor.detach().narrow(split.dim, start + self.rank * local, local))
            start += size
        return nn.Parameter(torch.cat(pieces, split.dim).clone(), requires_grad=tensor.requires_grad)

    def parameters(self, module: fx.GraphModule) -> tuple[TensorParallelParameter, ...]:
        names: dict[str, str] = self.gm.meta.get(meta.PARAM_NAMES, {})
        found = []
        for path, parameter in module.named_parameters():
            split = self.splits.get(path)
            full = split.full_shape if split is not None else tuple(parameter.shape)
            found.append(TensorParallelParameter(names.get(path, path), path, split.dim if split else None, full,
                                                 path in self.partial, split.parts if split else None))
        return tuple(found)


def _size_dim(node: fx.Node) -> int | None:
    """The dim a ``size(dim)`` / ``sym_size(x, dim)`` reads (None: the whole shape)."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return dim if isinstance(dim, int) else None


def _set_parameter(module: nn.Module, path: str, value: nn.Parameter) -> None:
    owner_path, _, attribute = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    setattr(owner, attribute, value)


def _mark_origin(graph: fx.Graph, count: int, name: str) -> None:
    """Tag the last ``count`` nodes of ``graph`` (what the rewrite of stage node ``name`` appended) with it, so that
    per-block recompute finds each block's nodes on the member's graph (fxpipe.passes.recompute_regions)."""
    for node, _ in zip(reversed(graph.nodes), range(count), strict=False):
        node.meta[meta.TP_ORIGIN] = name
