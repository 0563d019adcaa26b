"""Rows of a batch must not see each other: the check that makes splitting a batch into micro-batches and replicas exact.

fxpipe runs every micro-batch, and every replica's share of it, through the model on its own. That
equals one run over the whole batch only when the model computes each row from that row alone
(batch norm aside, which has its own modes: docs/exactness.md). A model that mixes rows (attention
over the declared batch dim because it is really the sequence, in-batch negatives, a normalisation
over the batch written by hand) would train to other numbers without any error, so
:func:`check_rows_independent` runs the model in eval mode on the example batch whole and in two
halves along the batch dims and refuses when the halves' outputs differ from the whole's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe.passes.batchdims import BatchDimError

# Relative tolerance on an output's largest magnitude: float32 matmuls over 8 or 16 rows round
# differently in the last few bits (1e-6 relative); mixing rows changes outputs by far more.
RELATIVE_TOLERANCE = 1e-3


def check_rows_independent(model: torch.nn.Module, inputs: Mapping[str, Any], dims: Sequence[int | None]) -> None:
    """Raise :class:`BatchDimError` when the model's outputs for some rows depend on other rows of the batch.

    ``inputs``: the example inputs by ``forward()`` parameter name, in order; ``dims``: each one's batch
    dim (None: not batched). Runs the model three times without gradients, in eval mode (dropout off,
    batch norm on its running statistics), with the random number generators restored afterwards,
    and leaves the model's training flags as they were. A batch of one row, or inputs on the meta
    device, cannot be checked and pass.
    """
    names = list(inputs)
    values = [inputs[name] for name in names]
    batch = _batch_size(values, dims)
    if batch is None or batch < 2 or any(isinstance(v, torch.Tensor) and v.is_meta for v in values):
        return
    half = batch // 2
    with _evaluating(model), torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(values)):
        whole = _outputs(model, names, values)
        first = _outputs(model, names, [_rows(v, d, 0, half) for v, d in zip(values, dims, strict=True)])
        second = _outputs(model, names, [_rows(v, d, half, batch) for v, d in zip(values, dims, strict=True)])
    for path, full in whole.items():
        if path in first and path in second:
            _compare(path, full, first[path], second[path], batch, half, names, dims)


def _batch_size(values: Sequence[Any], dims: Sequence[int | None]) -> int | None:
    for value, dim in zip(values, dims, strict=True):
        if dim is not None and isinstance(value, torch.Tensor):
            return int(value.shape[dim])
    return None


def _rows(value: Any, dim: int | None, start: int, stop: int) -> Any:
    if dim is None or not isinstance(value, torch.Tensor):
        return value
    return value.narrow(dim, start, stop - start)


def _outputs(model: torch.nn.Module, names: Sequence[str], values: Sequence[Any]) -> dict[str, torch.Tensor]:
    """{pytree path: tensor} of every floating-point tensor the model returns."""
    output = model(**dict(zip(names, values, strict=True)))
    if hasattr(output, "to_tuple") and hasattr(output, "keys"):  # a Hugging Face ModelOutput: compare its fields
        output = dict(output.items())
    leaves, _ = pytree.tree_flatten_with_path(output)
    return {pytree.keystr(path) or "output": leaf for path, leaf in leaves
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()}


def _compare(path: str, whole: torch.Tensor, first: torch.Tensor, second: torch.Tensor, batch: int, half: int,
             names: Sequence[str], dims: Sequence[int | None]) -> None:
    dim = _split_dim(whole, first, second, batch, half)
    if dim is None:  # not batched (a loss, a pooled statistic): nothing row by row to compare
        return
    joined = torch.cat([first, second], dim=dim).float()
    scale = float(whole.float().abs().max()) if whole.numel() else 0.0
    difference = float((joined - whole.float()).abs().max()) if whole.numel() else 0.0
    if difference <= RELATIVE_TOLERANCE * max(scale, 1e-6):
        return
    declared = ", ".join(f"dim {d} of {n!r}" for n, d in zip(names, dims, strict=True) if d is not None)
    raise BatchDimError(
        f"the rows of a batch are not independent: {_output_name(path)} for the first {half} of {batch} rows "
        f"differs from the same rows computed with the whole batch (largest difference {difference:.3g}, outputs "
        f"up to {scale:.3g}; batch read from {declared}, model in eval mode). fxpipe splits every batch into "
        "micro-batches and replicas by rows, so training would silently differ from the unsplit model. Fix: if "
        "another dim is the batch (a seq-first (T, B, C) model), pass batch_dims; if the model mixes rows on "
        "purpose (in-batch negatives, statistics over the batch), only an unsplit run is exact (one rank, "
        "num_microbatches=1); pass check_rows=False to train it split and accept the difference")


def _output_name(path: str) -> str:
    return "the model's output" if path == "output" else f"model output {path}"


def _split_dim(whole: torch.Tensor, first: torch.Tensor, second: torch.Tensor, batch: int, half: int) -> int | None:
    """The one dim where ``whole`` has ``batch`` rows and the halves ``half`` and ``batch - half``, else None."""
    if whole.dim() != first.dim() or whole.dim() != second.dim():
        return None
    found = [d for d in range(whole.dim())
             if (whole.shape[d], first.shape[d], second.shape[d]) == (batch, half, batch - half)]
    others_equal = all(whole.shape[d] == first.shape[d] == second.shape[d] for d in range(whole.dim())
                       if d not in found)
    return found[0] if len(found) == 1 and others_equal else None


@contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _cuda_devices(values: Sequence[Any]) -> list[torch.device]:
    return sorted({v.device for v in values if isinstance(v, torch.Tensor) and v.device.type == "cuda"}, key=str)
