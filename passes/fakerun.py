"""Data of one fake-tensor cost run: each node's symbolic costs, the run's bookkeeping, and the recipes
that replay a repeated node (flops.py runs the graph, nodecache.py records and replays nodes)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch.utils._pytree import tree_map

from fxpipe.passes import meta_kernels  # noqa: F401  (Meta kernels for ops torch has none for)


@dataclass(frozen=True)
class SymbolicCost:
    """Costs of one fx node as sympy expressions in ``BATCH`` (see ``annotate_costs``).

    ``saved_bytes`` is what autograd keeps for backward because of this node (each storage counted
    at the first node that saves it; parameters and buffers excluded); ``resaved`` lists, per storage this
    node saves that an earlier node saved already, ``(name of the last earlier node saving it, bytes)``: a
    stage cut off from that node receives the value as its own tensor and saves it again (see
    :attr:`fxpipe.core.chain.Block.resaved`); ``param_bytes`` counts the
    parameters this node is the first user of. ``*_bytes_moved`` and ``num_*_kernels`` feed the
    roofline time model. ``*_matmul_flops`` are the part of ``*_flops`` that matmuls, convolutions and
    attention did, by the dtype they ran in (``(("bfloat16", ...),)`` under bf16 autocast): they run at
    that dtype's rate, the rest at the float32 rate. ``is_tensor`` is False unless the output is a tensor or a non-empty
    container of tensors only.
    """

    output_shapes: tuple[tuple[sympy.Expr, ...], ...]
    output_dtypes: tuple[str, ...]
    output_bytes: sympy.Expr
    forward_flops: sympy.Expr
    backward_flops: sympy.Expr
    saved_bytes: sympy.Expr
    param_bytes: int
    is_tensor: bool
    forward_bytes_moved: sympy.Expr = sympy.Integer(0)
    backward_bytes_moved: sympy.Expr = sympy.Integer(0)
    num_forward_kernels: int = 0
    num_backward_kernels: int = 0
    forward_matmul_flops: tuple[tuple[str, sympy.Expr], ...] = ()
    backward_matmul_flops: tuple[tuple[str, sympy.Expr], ...] = ()
    resaved: tuple[tuple[str, sympy.Expr], ...] = ()


@dataclass
class RunState:
    """Bookkeeping shared by all nodes of one fake run."""

    to_expr: Callable[[Any], sympy.Expr]
    fakes: dict[int, torch.Tensor]  # id(real parameter/buffer) -> its fake
    fake_ids: set[int]  # ids of those fakes
    weight_keys: set[int]  # storage keys of parameters and buffers (never activations)
    counted_params: set[int] = field(default_factory=set)
    saved_keys: set[int] = field(default_factory=set)
    last_saver: dict[int, str] = field(default_factory=dict)  # saved storage key -> last node that saved it
    storage_alias: dict[int, int] = field(default_factory=dict)  # clone storage -> original storage
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    recipes: dict[Hashable, Recipe] | None = None  # node signature -> recipe; None: no cache
    keys: dict[str, Any] = field(default_factory=dict)  # node name -> its value with storage keys for tensors
    module_keys: dict[int, Hashable] = field(default_factory=dict)  # id(module) -> its signature part
    exprs: dict[Hashable, sympy.Expr] = field(default_factory=dict)  # memo of to_expr
    num_virtual_keys: int = 0  # storages of replayed nodes get keys -1, -2, ... (real ones are > 0)

    def expr(self, value: Any) -> sympy.Expr:
        """``to_expr(value)``, memoised on the value's (symbolic) expression."""
        key = (type(value), value.node.expr if isinstance(value, torch.SymInt | torch.SymFloat) else value)
        if key not in self.exprs:
            self.exprs[key] = self.to_expr(value)
        return self.exprs[key]

    def storage_key(self, tensor: torch.Tensor) -> int:
        key = int(tensor.untyped_storage()._cdata)
        while key in self.storage_alias:
            key = self.storage_alias[key]
        return key

    def note_saved(self, key: int, num_bytes: sympy.Expr, saver: str,
                   resaved: list[tuple[str, sympy.Expr]]) -> sympy.Expr:
        """Record that node ``saver`` saves storage ``key`` of ``num_bytes``; returns the bytes it counts.

        The first node to save a storage counts it; a later node appends ``(the last earlier saver,
        num_bytes)`` to ``resaved`` instead (once per node) and counts 0. Weights count nowhere.
        """
        if key in self.weight_keys:
            return sympy.Integer(0)
        previous = self.last_saver.get(key)
        self.last_saver[key] = saver
        if key not in self.saved_keys:
            self.saved_keys.add(key)
            return num_bytes
        if previous is not None and previous != saver:
            resaved.append((previous, num_bytes))
        return sympy.Integer(0)

    def new_key(self) -> int:
        self.num_virtual_keys += 1
        return -self.num_virtual_keys

    def key_tree(self, value: Any) -> Any:
        """``value`` with every tensor replaced by its storage key and every other leaf by 0."""
        return tree_map(lambda leaf: self.storage_key(leaf) if isinstance(leaf, torch.Tensor) else 0, value)


@dataclass(frozen=True)
class Recipe:
    """A measured node, to replay for a later node with the same signature without running it.

    Storage references: ``("input", i)`` the storage of argument leaf i, ``("output", j)`` that of
    output leaf j, ``("fresh", g)`` the node's own g-th new storage. ``saved`` lists, in order,
    each saved tensor's storage and byte size, so the storage de-duplication replays exactly.
    """

    cost: SymbolicCost
    output: Any  # the measured node's output value, shared (fakes are never mutated by a replay)
    output_storages: tuple[tuple[str, int] | None, ...]  # per output leaf; None for non-tensors
    saved: tuple[tuple[tuple[str, int], sympy.Expr], ...]
