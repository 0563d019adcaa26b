"""Measured per-block forward/backward times on the local device, fitted as affine costs in the batch size."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten

from fxpipe.core.costgraph import Affine
from fxpipe.core.meta import module_path
from fxpipe.passes.batchdims import graph_batch_dims
from fxpipe.passes.subgraph import extract_subgraph

__all__ = [
    "BlockTime",
    "MeasuredCosts",
    "ProfileError",
    "default_blocks",
    "device_of",
    "fit_times",
    "measure_costs",
    "node_values",
    "run_backward",
    "run_forward",
    "run_once",
    "synchronizer",
    "time_module",
]


class ProfileError(ValueError):
    """measure_costs was given blocks, batch sizes or inputs it cannot measure."""


@dataclass(frozen=True)
class BlockTime:
    """One measured block: its nodes and its forward/backward seconds as ``fixed + per_sample * rows``."""

    name: str
    node_names: tuple[str, ...]
    forward_s: Affine
    backward_s: Affine


@dataclass(frozen=True)
class MeasuredCosts:
    """Measured block times (consumed by ``to_cost_graph(gm, measured=...)``), in graph order.

    ``stretch`` is the factor the times include for sharing the device: wall seconds per CPU second
    while every rank measured (:mod:`fxpipe.block_costs`); 1 for plain wall-clock times.
    ``optimizer_s_per_param_byte``: an AdamW step's seconds per parameter byte on the same terms
    (0: not measured).
    """

    blocks: tuple[BlockTime, ...]
    batch_sizes: tuple[int, int]
    device: str = "cpu"
    stretch: float = 1.0
    optimizer_s_per_param_byte: float = 0.0

    def by_name(self) -> dict[str, BlockTime]:
        return {block.name: block for block in self.blocks}


def default_blocks(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """Runs of consecutive nodes sharing a layer path: the module path cut after its first list index.

    ``transformer.h.3.attn.c_attn`` belongs to layer ``transformer.h.3``; a path without an index
    keeps its first component (``transformer.wte`` -> ``transformer``); top-level nodes (path "")
    and ``get_attr`` nodes join the run they appear in.
    """
    runs: list[tuple[str, list[str]]] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        key = _layer_key(module_path(node))
        if runs and (key == "" or node.op == "get_attr" or key == runs[-1][0]):
            runs[-1][1].append(node.name)
        else:
            runs.append((key, [node.name]))
    return [tuple(names) for _, names in runs]


def _layer_key(path: str) -> str:
    parts = path.split(".") if path else []
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return parts[0] if parts else ""


def measure_costs(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    blocks: Sequence[Sequence[str]] | None = None,
    batch_sizes: tuple[int, int] = (2, 8),
    warmup: int = 2,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
    autocast_dtype: torch.dtype | None = None,
) -> MeasuredCosts:
    """Time forward and backward of every block on its own (median of ``repeats`` after ``warmup``).

    Each block becomes a GraphModule (``extract_subgraph``) fed the real values the full graph
    computes at that batch size; the two batch sizes give an affine fit per block. The harness's
    own cost (an ``empty_block`` timed in the same rounds) is subtracted from every block: a block
    run on its own pays it once, a stage running many blocks once in all. Parameter
    ``.grad`` fields are restored afterwards, so ``gm`` is left as it was. Blocks run where the
    inputs live (``MeasuredCosts.device``); on CUDA every timed region ends in a synchronize.
    ``clock`` reads the time (``time.process_time``: CPU seconds of work, whatever share of a core
    the process got; see :mod:`fxpipe.block_costs`). With ``autocast_dtype`` the values are computed and
    every forward runs under autocast on the blocks' device, as training runs them (backward outside it).
    """
    block_lists = [tuple(block) for block in (blocks if blocks is not None else default_blocks(gm))]
    _check_arguments(gm, block_lists, batch_sizes, repeats)
    saved_grads = {id(p): p.grad for p in gm.parameters()}
    try:
        timings = _time_blocks(gm, example_inputs, block_lists, batch_sizes, warmup, repeats, clock, autocast_dtype)
    finally:
        for parameter in gm.parameters():
            parameter.grad = saved_grads[id(parameter)]
    names = _block_names(gm, block_lists)
    return MeasuredCosts(
        blocks=tuple(
            BlockTime(
                name=name,
                node_names=block,
                forward_s=fit_times(batch_sizes, timings[0][index][0], timings[1][index][0]),
                backward_s=fit_times(batch_sizes, timings[0][index][1], timings[1][index][1]),
            )
            for index, (name, block) in enumerate(zip(names, block_lists, strict=True))
        ),
        batch_sizes=(int(batch_sizes[0]), int(batch_sizes[1])),
        device=str(device_of(gm, example_inputs)),
    )


def _check_arguments(
    gm: fx.GraphModule, blocks: Sequence[tuple[str, ...]], batch_sizes: tuple[int, int], repeats: int
) -> None:
    if len(batch_sizes) != 2 or batch_sizes[0] == batch_sizes[1] or min(batch_sizes) < 1:
        raise ProfileError(f"batch_sizes must be two different positive sizes such as (2, 8); got {batch_sizes}")
    if repeats < 1:
        raise ProfileError(f"repeats must be at least 1; got {repeats}")
    known = {node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output")}
    unknown = sorted({name for block in blocks for name in block} - known)
    if unknown or any(not block for block in blocks):
        raise ProfileError(
            f"blocks name unknown nodes {unknown[:5]} or are empty; use node names of gm (see default_blocks(gm))"
        )


def _block_names(gm: fx.GraphModule, blocks: Sequence[tuple[str, ...]]) -> list[str]:
    nodes = {node.name: node for node in gm.graph.nodes}
    names: list[str] = []
    for block in blocks:
        base = _layer_key(module_path(nodes[block[0]])) or block[0]
        name, suffix = base, 1
        while name in names:
            suffix += 1
            name = f"{base}#{suffix}"
        names.append(name)
    return names


def fit_times(batch_sizes: tuple[int, int], low_s: float, high_s: float) -> Affine:
    """The line through two (rows, seconds) points, kept non-negative (noise can tilt it)."""
    (low_rows, low_t), (high_rows, high_t) = sorted(zip(batch_sizes, (low_s, high_s), strict=True))
    per_sample = (high_t - low_t) / (high_rows - low_rows)
    if per_sample < 0:
        return Affine((low_t + high_t) / 2, 0.0)
    fixed = low_t - per_sample * low_rows
    if fixed < 0:
        return Affine(0.0, high_t / high_rows)
    return Affine(fixed, per_sample)


def resize_batch(value: Any, rows: int, batch_dim: int | None = 0) -> Any:
    """``value`` with its batch dim cycled or cut to ``rows`` rows (None, non-tensors and scalars: unchanged)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or batch_dim is None:
        return value
    index = torch.arange(rows) % value.shape[batch_dim]
    return value.index_select(batch_dim, index.to(value.device))


def _time_blocks(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    blocks: Sequence[tuple[str, ...]],
    batch_sizes: tuple[int, int],
    warmup: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
    autocast_dtype: torch.dtype | None = None,
) -> list[list[tuple[float, float]]]:
    """Median (forward, backward) seconds per batch size and block, harness overhead subtracted.

    Each repeat is one sweep per batch size, as a training step runs: every block's forward in
    order, then every backward in reverse, with an empty block timed every ``EMPTY_BLOCK_EVERY``
    blocks. A burst of load from other processes spoils one sample of many blocks, not all samples
    of a few, and a backward does not find its inputs hot from its own forward just before.
    """
    runs: list[tuple[torch.nn.Module, list[Any]]] = []
    dims = graph_batch_dims(gm, example_inputs)
    for rows in batch_sizes:
        with autocast(device_of(gm, example_inputs), autocast_dtype):
            values = node_values(gm, [resize_batch(value, rows, dim)
                                      for value, dim in zip(example_inputs, dims, strict=True)])
        for block in blocks:
            sub = extract_subgraph(gm, block)
            runs.append((sub.module, [_block_input(values[name]) for name in sub.input_names]))
    # The empty block runs in the same rounds, so its overhead is measured under the same load.
    empty = empty_block(device_of(gm, example_inputs))
    samples: list[list[tuple[float, float]]] = [[] for _ in runs]
    empty_samples: list[tuple[float, float]] = []
    for iteration in range(warmup + repeats):
        for first in range(0, len(runs), len(blocks)):  # one sweep per batch size
            sweep: list[tuple[list[tuple[float, float]], torch.nn.Module, list[Any]]] = []
            for index in range(first, first + len(blocks)):
                sweep.append((samples[index], *runs[index]))
                if index % EMPTY_BLOCK_EVERY == 0:
                    sweep.append((empty_samples, *empty))
            # As in training: every forward in order, then every backward in reverse, so a backward
            # finds its saved tensors where a real step leaves them (not hot from its own forward).
            forwards = [run_forward(module, args, clock, autocast_dtype) for _, module, args in sweep]
            for (target, module, args), (forward_s, output) in zip(reversed(sweep), reversed(forwards), strict=True):
                backward_s = run_backward(module, args, output, clock)
                if iteration >= warmup:
                    target.append((forward_s, backward_s))
    overhead = (statistics.median(f for f, _ in empty_samples), statistics.median(b for _, b in empty_samples))
    medians = [
        (
            max(statistics.median(f for f, _ in block_samples) - overhead[0], 0.0),
            max(statistics.median(b for _, b in block_samples) - overhead[1], 0.0),
        )
        for block_samples in samples
    ]
    return [medians[: len(blocks)], medians[len(blocks) :]]


class _Identity(torch.nn.Module):
    def forward(self, value: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)


# How often (in blocks) the empty block is timed within each round of block measurements.
EMPTY_BLOCK_EVERY = 4


def empty_block(device: torch.device | str = "cpu") -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A traced identity block and its one-element input: its time is the harness's own cost."""
    return fx.symbolic_trace(_Identity()), [torch.zeros(1, device=device, requires_grad=True)]


def device_of(module: torch.nn.Module, args: Sequence[Any]) -> torch.device:
    """Where a run happens: the device of the first tensor argument, else of the first parameter."""
    for tensor in [*(a for a in tree_flatten(list(args))[0] if isinstance(a, torch.Tensor)), *module.parameters()]:
        return tensor.device
    return torch.device("cpu")


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for ``device`` to finish queued work: ``torch.cuda.synchronize`` on CUDA, else nothing."""
    if device.type == "cuda" and torch.cuda.is_available():
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def node_values(gm: fx.GraphModule, inputs: Sequence[Any]) -> dict[str, Any]:
    """Every node's value on one real forward (with autograd on, so requires_grad is as in training)."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> Any:
            values[node.name] = result = super().run_node(node)
            return result

    Recorder(gm).run(*inputs)
    return values


def _block_input(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.detach().requires_grad_(value.requires_grad)
    return value


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` on ``device`` in ``dtype``; nothing when ``dtype`` is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def run_forward(module: torch.nn.Module, args: Sequence[Any], clock: Callable[[], float] = time.perf_counter,
                autocast_dtype: torch.dtype | None = None) -> tuple[float, Any]:
    """Seconds of one ``module(*args)`` and its output (gradients of the module and inputs cleared first).

    The module gets fresh copies of the tensor arguments, made before the clock starts: a block whose
    first op works in place on its input (``ReLU(inplace=True)``) modifies the copy, not an autograd
    leaf (which autograd refuses), and every run starts from the same values. Gradients still reach
    the ``args`` themselves; the empty block gets copies too, so the harness overhead includes them.
    """
    for tensor in [*module.parameters(), *(a for a in args if isinstance(a, torch.Tensor))]:
        tensor.grad = None
    copies = [_fresh_copy(arg) for arg in args]
    device = device_of(module, args)
    synchronize = synchronizer(device)
    with autocast(device, autocast_dtype):
        synchronize()
        start = clock()
        output = module(*copies)
        synchronize()
    return clock() - start, output


def _fresh_copy(value: Any) -> Any:
    """A tensor argument's clone (a non-leaf when it needs gradients); parameters and non-tensors as they are."""
    if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
        return value.clone()
    return value


def run_backward(module: torch.nn.Module, args: Sequence[Any], output: Any,
                 clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of the backward of every output of ``run_forward`` that needs a gradient (ones as gradients)."""
    synchronize = synchronizer(device_of(module, args))
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = [torch.ones_like(t) for t in tensors]
    synchronize()
    start = clock()
    if tensors:
        torch.autograd.backward(tensors, grads)
    synchronize()
    return clock() - start


def run_once(module: torch.nn.Module, args: Sequence[Any]) -> tuple[float, float]:
    """Forward and backward seconds of one ``module(*args)`` (backward of all its outputs needing grad).

    On a CUDA device the queue is drained before each clock read, so the times are kernel times.
    """
    forward_s, output = run_forward(module, args)
    return forward_s, run_backward(module, args, output)


def time_module(module: torch.nn.Module, args: Sequence[Any], *, warmup: int = 2, repeats: int = 5) -> tuple[float, float]:
    """Median forward and backward seconds of ``module(*args)`` over ``repeats`` after ``warmup`` runs."""
    samples = [run_once(module, args) for _ in range(warmup + repeats)][warmup:]
    return statistics.median(f for f, _ in samples), statistics.median(b for _, b in samples)
