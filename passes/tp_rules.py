"""Op semantics for the tensor-parallel pass: how a value split along one dim over a group flows through each op."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

__all__ = ["Conflict", "LinearInfo", "Shard", "linear_info", "op_name", "propagate"]


@dataclass(frozen=True)
class Shard:
    """A value split over the group along ``dim`` (its full size there: ``extent``), grown from the
    column-parallel linears ``origins`` (node names)."""

    dim: int
    extent: int
    origins: frozenset[str]


class Conflict(Exception):  # noqa: N818 - control flow inside the pass, never raised to users
    """An op cannot take a split value: the column linears ``origins`` must stay replicated."""

    def __init__(self, origins: frozenset[str], why: str) -> None:
        super().__init__(why)
        self.origins = origins
        self.why = why


@dataclass(frozen=True)
class LinearInfo:
    """A matmul with a parameter weight: ``x @ W.T`` (``nn.Linear``, ``linear``; ``out_dim`` 0) or
    ``x @ W`` (GPT-2's ``Conv1D`` as ``addmm``, ``mm``; ``out_dim`` 1), with its bias (a parameter path) if any."""

    node: fx.Node
    weight: str  # attribute path of the weight on the GraphModule
    input_index: int  # which argument is the activation
    out_dim: int
    bias: str | None
    in_features: int
    out_features: int


_MODULE_KINDS: dict[type[nn.Module], str] = {nn.Linear: "linear", nn.Embedding: "embedding", nn.Dropout: "dropout",
                                             nn.LayerNorm: "norm", nn.GroupNorm: "norm", nn.RMSNorm: "norm"}
_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Identity, nn.Mish, nn.LeakyReLU, nn.ELU)
_OPERATOR_NAMES = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
                   operator.getitem: "getitem", operator.neg: "neg", operator.and_: "and", operator.pow: "pow"}

# Ops that act on every element alone (with broadcasting between tensor operands).
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "true_divide", "rsub", "neg", "pow", "exp", "log", "sqrt", "rsqrt", "abs", "tanh",
    "sigmoid", "relu", "gelu", "silu", "mish", "erf", "softplus", "leaky_relu", "elu", "dropout",
    "masked_fill", "where", "and", "__and__", "eq", "ne", "lt", "gt", "le", "ge", "logical_not", "maximum", "minimum",
    "to", "type", "float", "half", "bfloat16", "_to_copy", "contiguous", "clone", "alias", "detach", "type_as",
    "add_", "mul_", "relu_", "gelu_", "silu_", "dropout_", "clamp", "masked_fill_", "scalar_tensor", "unary",
})
RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "unflatten", "flatten", "unsqueeze", "squeeze", "view_as",
                      "reshape_as"})
SPLITS = frozenset({"split", "chunk", "split_with_sizes", "tensor_split"})
NON_TENSOR_READS = frozenset({"size", "sym_size", "dim", "_assert_tensor_metadata", "_assert_scalar"})
SIZE_READS = frozenset({"size", "sym_size"})
SHAPE_FREE_READS = NON_TENSOR_READS - SIZE_READS  # read neither values nor extents: the same on a token share


def op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    """A short name for what ``node`` does: ``linear``, ``view``, ``scaled_dot_product_attention``, ..."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        for module_type, kind in _MODULE_KINDS.items():
            if isinstance(module, module_type):
                return kind
        return "unary" if isinstance(module, _ACTIVATIONS) else f"module:{type(module).__name__}"
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return node.op
    target: Any = node.target
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(target._schema.name).split("::")[-1] if isinstance(target, torch._ops.OpOverload) \
            else str(target.__name__)
    return str(getattr(target, "__name__", target))


def _parameter_path(node: object) -> str | None:
    return str(node.target) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def linear_info(gm: fx.GraphModule, node: fx.Node, name: str) -> LinearInfo | None:
    """The node as a matmul with a 2-D parameter weight, or None."""
    input_index = 1 if name == "addmm" else 0
    weight: Any
    if name == "linear" and node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        bias = f"{node.target}.bias" if getattr(module, "bias", None) is not None else None
        weight, path, out_dim = module.weight, f"{node.target}.weight", 0
    elif name == "linear" and len(node.args) >= 2 and _parameter_path(node.args[1]):
        path, out_dim = str(_parameter_path(node.args[1])), 0
        bias_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        bias = _parameter_path(bias_arg)
        if bias_arg is not None and bias is None:
            return None
        weight = gm.get_parameter(path) if _is_parameter(gm, path) else None
    elif name == "addmm" and len(node.args) == 3 and _parameter_path(node.args[2]) and _parameter_path(node.args[0]):
        path, out_dim, bias = str(_parameter_path(node.args[2])), 1, _parameter_path(node.args[0])
        weight = gm.get_parameter(path) if _is_parameter(gm, path) and not node.kwargs else None
    elif name in ("mm", "matmul") and len(node.args) == 2 and _parameter_path(node.args[1]):
        path, out_dim, bias = str(_parameter_path(node.args[1])), 1, None
        weight = gm.get_parameter(path) if _is_parameter(gm, path) else None
    else:
        return None
    if weight is None or weight.dim() != 2:
        return None
    return LinearInfo(node, path, input_index, out_dim, bias, int(weight.shape[1 - out_dim]), int(weight.shape[out_dim]))


def _is_parameter(gm: fx.GraphModule, path: str) -> bool:
    try:
        gm.get_parameter(path)
    except AttributeError:
        return False
    return True


def input_of(info: LinearInfo) -> fx.Node:
    """The activation a linear multiplies."""
    value = info.node.args[info.input_index]
    assert isinstance(value, fx.Node), info.node
    return value


def _dim_arg(node: fx.Node, position: int, keyword: str, default: Any) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(keyword, default)


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def reshaped_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int) -> int | None:
    """Where input ``dim`` lands after a reshape to ``out_shape``, if splitting it in T contiguous parts
    splits the output along one dim too (it is the outermost non-1 dim of its group); None otherwise."""
    in_prefix = [math.prod(in_shape[:k]) for k in range(len(in_shape) + 1)]
    out_prefix = [math.prod(out_shape[:k]) for k in range(len(out_shape) + 1)]
    start = in_prefix[dim]
    if math.prod(in_shape) != math.prod(out_shape) or start not in out_prefix:
        return None  # the dim's group starts inside an output dim: the split would cut across it
    first = out_prefix.index(start)
    for index in range(first, len(out_shape)):
        if out_shape[index] != 1:
            if out_shape[index] % in_shape[dim] != 0 and in_shape[dim] % out_shape[index] != 0:
                return None
            return index
    return None


Rule = Callable[[fx.Node, str, dict[fx.Node, Any], Callable[[fx.Node], tuple[int, ...]]], Shard | None]


def propagate(node: fx.Node, name: str, states: dict[fx.Node, Any],
              shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    """The split state of ``node``'s output given its inputs' (``states``: Shard for split values, absent
    for replicated ones); raises Conflict when the op cannot run on the members' parts."""
    sharded = [arg for arg in node.all_input_nodes if isinstance(states.get(arg), Shard)]
    if not sharded:
        return None
    origins = frozenset().union(*(states[arg].origins for arg in sharded))
    rule = _RULES.get(name) or (_elementwise if name in ELEMENTWISE else None)
    if rule is None:
        raise Conflict(origins, f"{node.name} ({name}) cannot run on split values")
    return rule(node, name, states, shape)


def _first_shard(node: fx.Node, states: dict[fx.Node, Any]) -> tuple[fx.Node, Shard]:
    source = node.args[0] if isinstance(node.args[0], fx.Node) else next(
        arg for arg in node.all_input_nodes if isinstance(states.get(arg), Shard))
    assert isinstance(source, fx.Node)
    state = states.get(source)
    if not isinstance(state, Shard):
        raise Conflict(_origins(node, states), f"{node.name} reads a split value in a position that must be whole")
    return source, state


def _origins(node: fx.Node, states: dict[fx.Node, Any]) -> frozenset[str]:
    return frozenset().union(*(s.origins for arg in node.all_input_nodes if isinstance(s := states.get(arg), Shard)))


def aligned_operand_ok(operand_shape: Sequence[int], out_ndim: int, shard: Shard) -> str:
    """How a whole (replicated) operand meets a split one at ``shard.dim`` of an ``out_ndim``-D result:
    ``"broadcast"`` (size 1 or absent there), ``"slice"`` (full size there: each member takes its part)."""
    position = shard.dim - (out_ndim - len(operand_shape))
    if position < 0 or operand_shape[position] == 1:
        return "broadcast"
    if operand_shape[position] == shard.extent:
        return "slice"
    return "mismatch"


def _elementwise(node: fx.Node, name: str, states: dict[fx.Node, Any],
                 shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    out_ndim = len(shape(node))
    shards = []
    for arg in node.all_input_nodes:
        state = states.get(arg)
        if isinstance(state, Shard):
            shards.append(Shard(state.dim + out_ndim - len(shape(arg)), state.extent, state.origins))
    origins = frozenset().union(*(s.origins for s in shards))
    odd = [s for s in shards if (s.dim, s.extent) != (shards[0].dim, shards[0].extent)]
    if odd:  # keep the disagreeing side whole: it may still meet the other one as a whole value
        raise Conflict(frozenset().union(*(s.origins for s in odd)) - shards[0].origins or origins,
                       f"{node.name} ({name}) joins values split along different dims")
    result = Shard(shards[0].dim, shards[0].extent, origins)
    for arg in node.all_input_nodes:
        if not isinstance(states.get(arg), Shard) and _is_tensor(arg, shape):
            if aligned_operand_ok(shape(arg), out_ndim, result) == "mismatch":
                raise Conflict(origins, f"{node.name} ({name}) mixes a split value with a whole one of another size")
    if name in ("softmax", "log_softmax", "_softmax", "_log_softmax"):
        raise Conflict(origins, "unreachable")  # handled by _softmax
    return result


def _is_tensor(node: fx.Node, shape: Callable[[fx.Node], tuple[int, ...]]) -> bool:
    try:
        shape(node)
    except KeyError:
        return False
    return True


def _softmax(node: fx.Node, name: str, states: dict[fx.Node, Any],
             shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    source, state = _first_shard(node, states)
    dim = _norm(int(_dim_arg(node, 1, "dim", -1)), len(shape(source)))
    if dim == state.dim:
        raise Conflict(state.origins, f"{node.name} normalises along the split dim")
    return state


def _reshape(node: fx.Node, name: str, states: dict[fx.Node, Any],
             shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    source, state = _first_shard(node, states)
    out_shape = shape(node)
    dim = reshaped_dim(shape(source), out_shape, state.dim)
    if dim is None:
        raise Conflict(state.origins, f"{node.name} ({name}) reshapes across the split dim")
    return Shard(dim, out_shape[dim], state.origins)


def _expand(node: fx.Node, name: str, states: dict[fx.Node, Any],
            shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    source, state = _first_shard(node, states)
    dim = state.dim + len(shape(node)) - len(shape(source))
    return Shard(dim, state.extent, state.origins)


def _permute(node: fx.Node, name: str, states: dict[fx.Node, Any],
             shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    source, state = _first_shard(node, states)
    ndim = len(shape(source))
    if name in ("transpose", "swapaxes", "t"):
        args: Any = node.args
        first, second = (0, 1) if name == "t" else (_norm(int(args[1]), ndim), _norm(int(args[2]), ndim))
        dim = second if state.dim == first else first if state.dim == second else state.dim
    else:
        order: Any = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], list | tuple) else node.args[1:]
        dim = [_norm(int(d), ndim) for d in order].index(state.dim)
    return Shard(dim, state.extent, state.origins)


def _slice(node: fx.Node, name: str, states: dict[fx.Node, Any],
           shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    source, state = _first_shard(node, states)
    in_shape, out_shape = shape(source), shape(node)
    dim = _norm(int(_dim_arg(node, 1, "dim", 0)), len(in_shape))
    if dim == state.dim and name == "select":
        raise Conflict(state.origins, f"{node.name} selects along the split dim")
    if dim == state.dim:
        if out_shape[dim] != in_shape[dim]:
            raise Conflict(state.origins, f"{node.name} ({name}) slices the split dim")
        return state
    return Shard(state.dim - (len(in_shape) - len(out_shape)) * (dim < state.dim), state.extent, state.origins)


def split_dim(node: fx.Node, ndim: int) -> int:
    """The dim a split / chunk cuts."""
    return _norm(int(_dim_arg(node, 2, "dim", 0)), ndim)


def _split(node: fx.Node, name: str, states: dict[fx.Node, Any],
           shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    _, state = _first_shard(node, states)
    return state  # along the split dim these are fused parts (q, k, v): the weight's rows are regrouped per member


def _getitem(node: fx.Node, name: str, states: dict[fx.Node, Any],
             shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    source, state = _first_shard(node, states)
    parts = shape_parts(source, shape)
    if parts is None or not isinstance(node.args[1], int):
        raise Conflict(state.origins, f"{node.name} indexes a split tensor")
    return Shard(state.dim, parts[node.args[1]][state.dim], state.origins)  # a part of a multi-output op


def shape_parts(node: fx.Node, shape: Callable[[fx.Node], tuple[int, ...]]) -> list[tuple[int, ...]] | None:
    """The shapes of a multi-output node's parts (split), or None."""
    try:
        value = shape(node)
    except KeyError:
        return None
    if value and isinstance(value[0], tuple):
        return list(value)  # type: ignore[arg-type]
    return None


def _matmul(node: fx.Node, name: str, states: dict[fx.Node, Any],
            shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    out_ndim = len(shape(node))
    origins = _origins(node, states)
    result: Shard | None = None
    for arg in node.all_input_nodes[:2]:
        state = states.get(arg)
        if isinstance(state, Shard):
            dim = state.dim + out_ndim - len(shape(arg))
            if state.dim >= len(shape(arg)) - 2 or (result is not None and result.dim != dim):
                raise Conflict(origins, f"{node.name} ({name}) contracts or mixes split dims")
            result = Shard(dim, state.extent, origins)
    assert result is not None
    for arg in node.all_input_nodes[:2]:
        if not isinstance(states.get(arg), Shard) and aligned_operand_ok(shape(arg), out_ndim, result) == "mismatch":
            raise Conflict(origins, f"{node.name} ({name}) mixes a split value with a whole one of another size")
    return result


def _attention(node: fx.Node, name: str, states: dict[fx.Node, Any],
               shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    query = node.args[0]
    assert isinstance(query, fx.Node)
    state = states.get(query)
    origins = _origins(node, states)
    if not isinstance(state, Shard) or state.dim >= len(shape(query)) - 2:
        raise Conflict(origins, f"{node.name} attention needs the query split along heads")
    result = Shard(state.dim, state.extent, origins)
    for arg in node.all_input_nodes[1:]:
        other = states.get(arg)
        if isinstance(other, Shard):
            if other.dim != state.dim:  # keep the key / value side whole (it may still meet the heads whole)
                raise Conflict(other.origins - state.origins or origins,
                               f"{node.name} attention inputs split along different dims")
        elif aligned_operand_ok(shape(arg), len(shape(query)), result) == "mismatch":
            raise Conflict(origins, f"{node.name} attention mixes split heads with a whole value of another size")
    return result


def _cat(node: fx.Node, name: str, states: dict[fx.Node, Any],
         shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    parts = node.args[0]
    origins = _origins(node, states)
    assert isinstance(parts, list | tuple)
    found = {(s.dim, s.extent) if isinstance(s := states.get(part), Shard) else None for part in parts}  # type: ignore[arg-type]
    if len(found) != 1 or None in found:
        raise Conflict(origins, f"{node.name} concatenates split and whole values")
    ((dim, extent),) = found  # type: ignore[misc]
    if _norm(int(_dim_arg(node, 1, "dim", 0)), len(shape(node))) == dim:
        raise Conflict(origins, f"{node.name} concatenates along the split dim")
    return Shard(dim, extent, origins)


def _non_tensor(node: fx.Node, name: str, states: dict[fx.Node, Any],
                shape: Callable[[fx.Node], tuple[int, ...]]) -> Shard | None:
    source, state = _first_shard(node, states)
    if name in SIZE_READS:
        dim = _dim_arg(node, 1, "dim", None)
        if dim is None or _norm(int(dim), len(shape(source))) == state.dim:
            raise Conflict(state.origins, f"{node.name} reads the size of the split dim")
    return None


_RULES: dict[str, Rule] = {
    **dict.fromkeys(RESHAPES, _reshape), **dict.fromkeys(SPLITS, _split),
    **dict.fromkeys(("softmax", "log_softmax", "_softmax", "_log_softmax"), _softmax),
    **dict.fromkeys(("expand", "expand_as", "repeat_interleave_no"), _expand),
    **dict.fromkeys(("transpose", "swapaxes", "permute", "t"), _permute),
    **dict.fromkeys(("slice", "narrow", "select"), _slice),
    "getitem": _getitem, **dict.fromkeys(("cat", "concat", "concatenate"), _cat), **dict.fromkeys(("matmul", "bmm"), _matmul),
    **dict.fromkeys(("scaled_dot_product_attention",), _attention),
    **dict.fromkeys(NON_TENSOR_READS, _non_tensor),
}
