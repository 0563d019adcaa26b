"""Fake-tensor execution of a graph node by node, counting FLOPs, bytes moved, kernels and saved tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from fxpipe.passes.fakerun import RunState, SymbolicCost
from fxpipe.passes.nodecache import (
    input_key,
    materialize,
    module_tensors,
    node_signature,
    record_recipe,
    replay,
)

aten = torch.ops.aten
_FAKE_DEVICE = torch.device("cpu")  # what fakes claim to live on, so meta models mix with CPU inputs

# Symbolic sizes are SymInts; plain ints when nothing depends on the batch.
Count = Any


def _cpu_sdpa_flop(query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> Count:
    """FlopCounterMode has no formula for the CPU flash-attention kernel; it costs what the CUDA one does."""
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flop(
    grad_out: Any, query: Any, key: Any, value: Any, *args: Any, out_val: Any = None, **kwargs: Any
) -> Count:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# FlopCounterMode's formulas (matmul, conv, attention: what torch.utils.flop_counter counts) plus the
# CPU attention kernels it lacks. The formulas are called directly from one dispatch mode rather than
# by nesting FlopCounterMode, which halves the dispatch overhead on large graphs.
FLOP_FORMULAS: dict[Any, Any] = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_cpu_sdpa_flop),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_cpu_sdpa_backward_flop),
}

# FLOPs per output element for ops FlopCounterMode does not count (one FLOP per arithmetic step:
# softmax = max, subtract, exp, sum, divide; layer norm = mean, centre, square, mean, rsqrt-scale,
# affine; their backward passes roughly double that). Any other op tagged pointwise costs 1 FLOP
# per output element (transcendentals included, as fvcore/DeepSpeed count them), a reduction costs
# 1 FLOP per input element, and everything else (copies, gathers, embedding lookups) costs 0 FLOPs
# but still moves bytes and launches a kernel.
PER_ELEMENT_FLOPS: dict[Any, int] = {
    aten._softmax: 5,
    aten._log_softmax: 5,
    aten._softmax_backward_data: 4,
    aten._log_softmax_backward_data: 4,
    aten.native_layer_norm: 8,
    aten.native_layer_norm_backward: 16,
    aten.native_batch_norm: 8,
    aten.native_batch_norm_backward: 16,
    aten._native_batch_norm_legit: 8,
    aten._native_batch_norm_legit_functional: 8,
    aten.native_group_norm: 8,
    aten.native_group_norm_backward: 16,
    aten.gelu: 8,
    aten.gelu_backward: 12,
}

# Ops that only touch metadata or allocate: no kernel, no bytes, no FLOPs (prim:: ops such as
# prim.device are skipped as well).
METADATA_OPS: frozenset[Any] = frozenset(
    {
        aten.detach,
        aten.alias,
        aten.lift_fresh,
        aten._unsafe_view,
        aten.empty,
        aten.empty_strided,
        aten.empty_like,
        aten.new_empty,
        aten.new_empty_strided,
        aten.sym_size,
        aten.sym_stride,
        aten.sym_numel,
        aten.sym_storage_offset,
        aten.is_same_size,
        aten._local_scalar_dense,
    }
)


def _tensor_bytes(tensor: torch.Tensor) -> Count:
    return tensor.numel() * tensor.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def elementwise_flops(func: Any, args: Any, kwargs: Any, out: Any) -> Count:
    """FLOPs of an op FlopCounterMode does not know, by the rules documented above."""
    packet = func.overloadpacket
    outputs = _tensors(out)
    if not outputs:
        return 0
    if packet in PER_ELEMENT_FLOPS:
        return PER_ELEMENT_FLOPS[packet] * outputs[0].numel()
    if torch.Tag.pointwise in func.tags:
        return outputs[0].numel()
    if torch.Tag.reduction in func.tags:
        inputs = _tensors((args, kwargs))
        return inputs[0].numel() if inputs else 0
    return 0


@dataclass
class OpTally:
    """What one region of execution cost: FLOPs, bytes read plus written, and kernels launched."""

    elementwise_flops: Count = 0
    bytes_moved: Count = 0
    num_kernels: int = 0
    matmul_flops: Count = 0  # ops with a torch.utils.flop_counter formula
    # those ops' FLOPs by the dtype of their first floating input (what autocast gave them)
    matmul_flops_by_dtype: dict[str, Count] = field(default_factory=dict)

    @property
    def flops(self) -> Count:
        return self.matmul_flops + self.elementwise_flops

    def add_matmul(self, flops: Count, args: Any, kwargs: Any) -> None:
        dtype = next((str(t.dtype).removeprefix("torch.") for t in _tensors((args, kwargs)) if t.is_floating_point()),
                     "float32")
        self.matmul_flops = self.matmul_flops + flops
        self.matmul_flops_by_dtype[dtype] = self.matmul_flops_by_dtype.get(dtype, 0) + flops


class _TallyMode(TorchDispatchMode):
    """Adds FLOPs, memory traffic and a kernel count for every non-metadata aten op."""

    def __init__(self, tally: OpTally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.namespace != "aten" or packet in METADATA_OPS or func.is_view:
            return out
        tally = self.tally
        tally.num_kernels += 1
        for tensor in _tensors((args, kwargs)) + _tensors(out):
            tally.bytes_moved = tally.bytes_moved + _tensor_bytes(tensor)
        if packet in FLOP_FORMULAS:
            tally.add_matmul(FLOP_FORMULAS[packet](*args, **kwargs, out_val=out), args, kwargs)
        else:
            tally.elementwise_flops = tally.elementwise_flops + elementwise_flops(func, args, kwargs, out)
        return out


@contextmanager
def count_ops() -> Iterator[OpTally]:
    """Count FLOPs (torch.utils.flop_counter formulas plus the elementwise rules), bytes and kernels."""
    tally = OpTally()
    with _TallyMode(tally):
        yield tally


def run_fake(
    gm: fx.GraphModule,
    inputs: Sequence[Any],
    fake_mode: FakeTensorMode,
    batch_size: Any,
    to_expr: Callable[[Any], sympy.Expr],
    *,
    cache: bool = True,
    after_node: Callable[[fx.Node], None] | None = None,
    batch_dims: Sequence[int | None] | None = None,
    finish: Callable[[fx.Node, dict[str, Any], RunState], None] | None = None,
) -> dict[str, SymbolicCost]:
    """Run every node on fakes (batch dim = ``batch_size``) and cost it; ``after_node`` sees each node run.

    ``batch_dims``: each input's batch dim (None: none); default dim 0 of every tensor input.
    ``finish(output_node, values, state)`` runs last, inside the fake mode, with every node's fake value
    (the loss pass, :mod:`fxpipe.passes.losscost`, costs the loss on the model's output there).

    A node that fails raises :class:`NodeRunError` naming it.

    With ``cache``, a node whose ``node_signature`` was seen before (the next transformer layer) is
    not run: its outputs are the earlier node's, and its saved and parameter bytes are replayed
    against its own inputs' storages, so the costs equal those of ``cache=False``.
    """
    state = RunState(to_expr=to_expr, fakes={}, fake_ids=set(), weight_keys=set(), recipes={} if cache else None)
    with fake_mode:
        _fake_weights(gm, fake_mode, state)
        env: dict[str, Any] = {}
        placeholders = iter(inputs)
        dims = iter(batch_dims if batch_dims is not None else [0] * len(inputs))
        costs: dict[str, SymbolicCost] = {}
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            try:
                if node.op == "placeholder":
                    env[node.name] = fake_input(next(placeholders), batch_size, next(dims))
                    costs[node.name] = _value_cost(env[node.name], state)
                elif node.op == "get_attr":
                    env[node.name], costs[node.name] = _run_get_attr(gm, node, state)
                else:
                    env[node.name], costs[node.name] = _run_call(gm, node, env, state)
            except Exception as error:
                raise NodeRunError(node, error) from error
            if node.name not in state.keys:
                state.keys[node.name] = state.key_tree(env[node.name])
            if after_node is not None:
                after_node(node)
        if finish is not None:
            finish(next(iter(reversed(gm.graph.nodes))), env, state)
    return costs


class NodeRunError(RuntimeError):
    """Running ``node`` on fakes failed; ``reason`` is the op's own error."""

    def __init__(self, node: fx.Node, reason: BaseException) -> None:
        self.node = node
        self.reason = reason
        super().__init__(f"{node.name}: {type(reason).__name__}: {reason}")


def _fake_weights(gm: fx.GraphModule, fake_mode: FakeTensorMode, state: RunState) -> None:
    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    for _, tensor in tensors:
        if id(tensor) in state.fakes:
            continue
        fake = fake_mode.from_tensor(tensor, static_shapes=True)
        fake.fake_device = _FAKE_DEVICE  # type: ignore[attr-defined]
        state.fakes[id(tensor)] = fake
        state.fake_ids.add(id(fake))
        state.weight_keys.add(state.storage_key(fake))


def fake_input(value: Any, batch_size: Any, dim: int | None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0 or dim is None:
        return torch.empty(tuple(value.shape), dtype=value.dtype, device=_FAKE_DEVICE)
    return torch.empty((*value.shape[:dim], batch_size, *value.shape[dim + 1:]), dtype=value.dtype,
                       device=_FAKE_DEVICE)


def _run_get_attr(gm: fx.GraphModule, node: fx.Node, state: RunState) -> tuple[Any, SymbolicCost]:
    value = _fetch_attr(gm, str(node.target))
    param_bytes = 0
    if isinstance(value, torch.Tensor):
        param_bytes = _first_use_bytes([value], state)
        value = state.fakes.get(id(value), value)
    return value, _value_cost(value, state, param_bytes=param_bytes)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _first_use_bytes(tensors: Sequence[torch.Tensor], state: RunState) -> int:
    """Bytes of the parameters among ``tensors`` not counted at an earlier node (tied weights once)."""
    total = 0
    for tensor in tensors:
        if isinstance(tensor, torch.nn.Parameter) and id(tensor) not in state.counted_params:
            state.counted_params.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total


def _module_param_bytes(gm: fx.GraphModule, node: fx.Node, state: RunState) -> int:
    """First-use parameter bytes of a ``call_module`` node's module (0 for other ops)."""
    if node.op != "call_module":
        return 0
    return _first_use_bytes([tensor for _, tensor in module_tensors(gm.get_submodule(str(node.target)))], state)


def _claimed_device(value: Any) -> Any:
    return _FAKE_DEVICE if isinstance(value, torch.device) and value.type == "meta" else value


def _run_call(gm: fx.GraphModule, node: fx.Node, env: dict[str, Any], state: RunState) -> tuple[Any, SymbolicCost]:
    """Replay a node whose signature was measured before, else measure it (and remember it)."""
    args = fx.node.map_arg((node.args, node.kwargs), lambda arg: env[arg.name])
    args = tree_map(_claimed_device, args)  # a graph traced on meta makes its constants on meta
    leaves, spec = tree_flatten(args)
    key_leaves, _ = tree_flatten(fx.node.map_arg((node.args, node.kwargs), lambda arg: state.keys[arg.name]))
    keys = [input_key(leaf, key, state) for leaf, key in zip(leaves, key_leaves, strict=True)]
    signature = node_signature(gm, node, args, keys, state) if state.recipes is not None else None
    if state.recipes is not None and signature in state.recipes:
        return replay(node, state.recipes[signature], keys, state, _module_param_bytes(gm, node, state))
    leaves = [materialize(leaf, key, state) for leaf, key in zip(leaves, keys, strict=True)]
    output, cost, saved = _run_node(gm, node, tree_unflatten(leaves, spec), state)
    state.keys[node.name] = state.key_tree(output)
    if state.recipes is not None and signature is not None:
        recipe = record_recipe(output, cost, saved, keys, state)
        if recipe is not None:
            state.recipes[signature] = recipe
    return output, cost


def _run_node(gm: fx.GraphModule, node: fx.Node, arguments: Any, state: RunState) -> tuple[Any, SymbolicCost, list[torch.Tensor]]:
    """Run one call node on detached local copies of its inputs; count forward, saved and backward."""
    leaves: list[torch.Tensor] = []
    args, kwargs = tree_map(lambda value: local_copy(value, state, leaves), arguments)
    call, weights, param_bytes = _callable(gm, node, state)
    return run_counted(call, args, kwargs, leaves + weights, state, param_bytes, saver=node.name)


def run_counted(call: Callable[..., Any], args: Any, kwargs: Any, grad_inputs: list[torch.Tensor], state: RunState,
                param_bytes: int = 0, *, saver: str) -> tuple[Any, SymbolicCost, list[torch.Tensor]]:
    """``call(*args, **kwargs)`` on fakes: its output, its costs (gradients of ``grad_inputs`` for the
    backward) and the tensors autograd saved, each storage counted once per run (``state.saved_keys``);
    storages an earlier node saved are the cost's ``resaved`` (:meth:`RunState.note_saved`, by ``saver``)."""
    saved: list[torch.Tensor] = []
    grad_enabled = torch.is_grad_enabled()
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack_into(saved), lambda tensor: tensor):
            with count_ops() as forward:
                output = call(*args, **kwargs)
    finally:  # a node that raises leaves the process's grad mode as it found it: torch 2.11's
        # wrap_with_set_grad_enabled (torch.export's no_grad regions) turned it off for good when its body raised
        torch.set_grad_enabled(grad_enabled)
    backward = _run_backward(output, grad_inputs)
    state.keep_alive.extend(saved)
    cost = _value_cost(output, state, param_bytes=param_bytes, forward=forward, backward=backward)
    saved_bytes, resaved = _saved_bytes(saved, state, saver)
    return output, dataclasses.replace(cost, saved_bytes=saved_bytes, resaved=resaved), saved




def local_copy(value: Any, state: RunState, leaves: list[torch.Tensor]) -> Any:
    """A non-leaf clone with its own autograd root, so a node's backward stops at its inputs."""
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) in state.fake_ids:  # a weight read through get_attr: its own autograd leaf
        if value.requires_grad:
            leaves.append(value)
        return value
    if not (value.requires_grad and value.is_floating_point()):
        return value.detach()
    leaf = value.detach().requires_grad_(True)
    local = leaf.clone()  # a clone, not the leaf, so in-place ops (ReLU(inplace=True)) are allowed
    state.storage_alias[int(local.untyped_storage()._cdata)] = state.storage_key(value)
    state.keep_alive.extend((leaf, local))
    leaves.append(leaf)
    return local


def _callable(gm: fx.GraphModule, node: fx.Node, state: RunState) -> tuple[Callable[..., Any], list[torch.Tensor], int]:
    """The function a node calls, the fake parameters it uses directly, and its first-use param bytes."""
    if node.op == "call_function":
        return node.target, [], 0  # type: ignore[return-value]
    if node.op == "call_method":
        return lambda self, *args, **kwargs: getattr(self, str(node.target))(*args, **kwargs), [], 0
    if node.op != "call_module":
        raise AssertionError(f"node {node.name!r} has unknown op {node.op!r}")
    module = gm.get_submodule(str(node.target))
    named = module_tensors(module)
    fake_state = {name: state.fakes[id(tensor)] for name, tensor in named}
    weights = [fake for name, fake in fake_state.items() if fake.requires_grad]
    param_bytes = _first_use_bytes([tensor for _, tensor in named], state)

    def call(*args: Any, **kwargs: Any) -> Any:
        return torch.func.functional_call(module, fake_state, args, kwargs)

    return call, weights, param_bytes



def _pack_into(saved: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    return pack


def _run_backward(output: Any, grad_inputs: list[torch.Tensor]) -> OpTally:
    """Count the backward ops autograd runs for this node (gradients of its inputs and parameters)."""
    outputs = [t for t in _tensors(output) if t.requires_grad and t.is_floating_point()]
    targets = [t for t in grad_inputs if t.requires_grad]
    if not outputs or not targets:
        return OpTally()
    grad_outputs = [torch.ones_like(t) for t in outputs]
    # autograd runs backward ops in the dtypes forward saved, as a training loop's backward outside autocast
    with torch.autocast("cpu", enabled=False), count_ops() as tally:
        torch.autograd.grad(outputs, targets, grad_outputs, retain_graph=True, allow_unused=True)
    return tally


def _saved_bytes(saved: Sequence[torch.Tensor], state: RunState,
                 saver: str) -> tuple[sympy.Expr, tuple[tuple[str, sympy.Expr], ...]]:
    """Bytes of the storages ``saver`` is first to save, and its re-saves (:meth:`RunState.note_saved`)."""
    total = sympy.Integer(0)
    resaved: list[tuple[str, sympy.Expr]] = []
    for tensor in saved:
        if isinstance(tensor, torch.Tensor):
            total += state.note_saved(state.storage_key(tensor), state.expr(tensor.untyped_storage().nbytes()),
                                      saver, resaved)
    return sympy.expand(total), tuple(resaved)


def _value_cost(
    value: Any,
    state: RunState,
    *,
    param_bytes: int = 0,
    forward: OpTally | None = None,
    backward: OpTally | None = None,
) -> SymbolicCost:
    forward = forward or OpTally()
    backward = backward or OpTally()
    leaves, _ = tree_flatten(value)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    to_expr = state.expr
    return SymbolicCost(
        output_shapes=tuple(tuple(to_expr(size) for size in t.shape) for t in tensors),
        output_dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
        output_bytes=sympy.expand(sum((to_expr(t.numel()) * t.element_size() for t in tensors), sympy.Integer(0))),
        forward_flops=to_expr(forward.flops),
        backward_flops=to_expr(backward.flops),
        forward_matmul_flops=_by_dtype(forward, to_expr),
        backward_matmul_flops=_by_dtype(backward, to_expr),
        saved_bytes=sympy.Integer(0),
        param_bytes=param_bytes,
        is_tensor=bool(leaves) and len(tensors) == len(leaves),
        forward_bytes_moved=to_expr(forward.bytes_moved),
        backward_bytes_moved=to_expr(backward.bytes_moved),
        num_forward_kernels=forward.num_kernels,
        num_backward_kernels=backward.num_kernels,
    )


def _by_dtype(tally: OpTally, to_expr: Callable[[Any], sympy.Expr]) -> tuple[tuple[str, sympy.Expr], ...]:
    return tuple(sorted((dtype, to_expr(flops)) for dtype, flops in tally.matmul_flops_by_dtype.items()))
