"""Collectives a tensor-parallel stage's generated code calls: autograd functions over a communicator registered per group key.

Interface (the runtime implements the communicator; nothing here imports torch.distributed):

    register_group(key, comm)   # comm.size, comm.rank, and collectives that return new tensors:
                                #   comm.all_reduce(t) (sum), comm.all_gather(t, dim), comm.reduce_scatter(t, dim) (sum)
    unregister_group(key)

Every function below takes the group key (a string constant in the generated code) as an argument:

    copy_to_group(x, key)                  forward identity,        backward all-reduce   (entering a column region)
    reduce_from_group(x, key)              forward all-reduce,      backward identity     (leaving a row region)
    gather_from_group(x, key, dim)         forward all-gather,      backward own chunk    (vocabulary-split logits)
    gather_for_inference(x, key, dim)      gather_from_group without autograd, else x (split logits of a parallel loss)
    gather_sequence(x, key, dim)           forward all-gather,      backward reduce-scatter (sequence parallelism)
    reduce_scatter_sequence(x, key, dim)   forward reduce-scatter,  backward all-gather
    split_sequence(x, key, dim)            forward own chunk,       backward all-gather
    sequence_columns(x, key, dim, biases, *params)   column linears on token-split x: forward all-gather, each
                                           linear; only x's token share is saved; backward all-gather again,
                                           reduce-scatter the summed input gradient (Megatron-LM's sequence parallelism)
    vocab_embedding(ids, weight, key, vocab_start)       a vocabulary-split table lookup, summed over the group
    vocab_parallel_cross_entropy(logits, targets, key, vocab_start, ignore_index=-100)   mean token cross-entropy
                                           of vocabulary-split logits (the same value on every member)

and one local op: add_bias(out, bias), a split layer's bias added in its output's dtype.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from fxpipe.core.backward_phase import current_backward_phase

__all__ = ["Communicator", "add_bias", "copy_to_group", "gather_for_inference", "gather_from_group", "gather_sequence", "group", "reduce_from_group",
           "reduce_scatter_sequence", "register_group", "sequence_columns", "split_sequence", "unregister_group", "vocab_embedding",
           "vocab_parallel_cross_entropy"]


class Communicator(Protocol):
    """One tensor-parallel group as seen by one member; collectives sum and return new tensors."""

    size: int
    rank: int

    def all_reduce(self, tensor: Tensor) -> Tensor: ...

    def all_gather(self, tensor: Tensor, dim: int) -> Tensor: ...

    def reduce_scatter(self, tensor: Tensor, dim: int) -> Tensor: ...


_GROUPS: dict[str, Communicator] = {}


class GroupNotRegisteredError(KeyError):
    """A stage called a collective of a group key nobody registered."""


def register_group(key: str, comm: Communicator) -> None:
    """Make ``comm`` the communicator of group ``key`` (replacing an earlier one)."""
    _GROUPS[key] = comm


def unregister_group(key: str) -> None:
    _GROUPS.pop(key, None)


def group(key: str) -> Communicator:
    """The communicator registered under ``key``."""
    try:
        return _GROUPS[key]
    except KeyError:
        raise GroupNotRegisteredError(f"no tensor-parallel communicator is registered under {key!r} (registered: "
                                      f"{sorted(_GROUPS)}); call fxpipe.passes.tensor_parallel_ops.register_group("
                                      f"{key!r}, comm) before running the stage") from None


def _own_chunk(tensor: Tensor, comm: Communicator, dim: int) -> Tensor:
    size = tensor.shape[dim]
    if size % comm.size:
        raise ValueError(f"dim {dim} of a {tuple(tensor.shape)} tensor has {size} entries, which {comm.size} "
                         "tensor-parallel members cannot split evenly; use a length divisible by the group size")
    return tensor.narrow(dim, comm.rank * (size // comm.size), size // comm.size).contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, key: str) -> Tensor:
        ctx.key = key
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return group(ctx.key).all_reduce(grad), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, key: str) -> Tensor:
        return group(key).all_reduce(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """Forward: the members' parts gathered along ``dim``; backward: the member's part of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, key: str, dim: int) -> Tensor:
        ctx.key, ctx.dim = key, dim
        return group(key).all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _own_chunk(grad, group(ctx.key), ctx.dim), None, None


class _GatherSequence(_GatherFromGroup):
    """As :class:`_GatherFromGroup`, but every member's gradient is a partial sum: reduce-scatter it."""

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return group(ctx.key).reduce_scatter(grad.contiguous(), ctx.dim), None, None


class _GatherInBackward(torch.autograd.Function):
    """Forward: the member's part along ``dim`` (``_part``); backward: the gradient parts gathered."""

    @staticmethod
    def _part(x: Tensor, comm: Communicator, dim: int) -> Tensor:
        raise NotImplementedError

    @classmethod
    def forward(cls, ctx: Any, x: Tensor, key: str, dim: int) -> Tensor:  # type: ignore[override]
        ctx.key, ctx.dim = key, dim
        return cls._part(x, group(key), dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return group(ctx.key).all_gather(grad.contiguous(), ctx.dim), None, None


class _ReduceScatterSequence(_GatherInBackward):
    @staticmethod
    def _part(x: Tensor, comm: Communicator, dim: int) -> Tensor:
        _own_chunk(x, comm, dim)  # the same divisibility check and message as a split
        return comm.reduce_scatter(x.contiguous(), dim)


class _SplitSequence(_GatherInBackward):
    @staticmethod
    def _part(x: Tensor, comm: Communicator, dim: int) -> Tensor:
        return _own_chunk(x, comm, dim)


class _SequenceColumns(torch.autograd.Function):
    """Column linears ``F.linear(gathered, weight_i, bias_i)`` reading one input split over the tokens, as Megatron-LM
    runs a sequence-parallel column linear: the gathered input is not kept for backward (T times the token share,
    per member, per layer), only the share is, in the dtype the linears compute in; backward gathers it again for
    the weight gradients. Autocast is applied as ``F.linear`` applies it (each floating input but float64 cast to
    the autocast dtype), so outputs and gradients are those of the linears on the gathered input."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, key: str, dim: int, biases: tuple[bool, ...],  # type: ignore[override]
                *params: Tensor) -> tuple[Tensor, ...]:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        share = _compute_cast(x, dtype)
        full = group(key).all_gather(share.contiguous(), dim)
        pairs = _pairs(biases, params)
        with torch.autocast(device, enabled=False):
            outputs = tuple(F.linear(full, _compute_cast(weight, dtype), None if bias is None else
                                     _compute_cast(bias, dtype)) for weight, bias in pairs)
        ctx.save_for_backward(share, *(weight for weight, _ in pairs))  # a bias gradient needs no saved value
        ctx.key, ctx.dim, ctx.dtype, ctx.input_dtype = key, dim, dtype, x.dtype
        ctx.bias_dtypes = tuple(None if bias is None else bias.dtype for _, bias in pairs)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        share, *weights = ctx.saved_tensors
        with torch.autocast(share.device.type, enabled=False):  # the forward's casts, whatever the caller's state
            return _SequenceColumns._gradients(ctx, share, weights, grads)

    @staticmethod
    def _gradients(ctx: Any, share: Tensor, weights: list[Tensor], grads: tuple[Tensor | None, ...],
                   ) -> tuple[Tensor | None, ...]:
        comm = group(ctx.key)
        # a split backward's B (input gradients) skips the weight gradients and so the gathered input; its W skips the
        # input gradient and its reduce-scatter (fxpipe.core.backward_phase); bias gradients are cheap: always
        phase = current_backward_phase()
        needs_input = ctx.needs_input_grad[0] and phase != "weights"
        needs_params = iter(ctx.needs_input_grad[4:])
        flags = [(next(needs_params) and phase != "inputs", bias_dtype is not None and next(needs_params))
                 for bias_dtype in ctx.bias_dtypes]
        rows = comm.all_gather(share.contiguous(), ctx.dim).flatten(0, -2) if any(w for w, _ in flags) else None
        input_grad: Tensor | None = None
        param_grads: list[Tensor | None] = []
        for weight, bias_dtype, (needs_weight, needs_bias), grad in zip(weights, ctx.bias_dtypes, flags, grads,
                                                                       strict=True):
            if grad is None:
                param_grads += [None] * (1 if bias_dtype is None else 2)
                continue
            grad_rows = grad.reshape(-1, grad.shape[-1])
            if needs_input:  # each linear's input cast back to the input's dtype, then summed
                part = grad.matmul(_compute_cast(weight, ctx.dtype)).to(ctx.input_dtype)
                input_grad = part if input_grad is None else input_grad + part
            param_grads.append(grad_rows.t().mm(rows).to(weight.dtype) if needs_weight and rows is not None else None)
            if bias_dtype is not None:
                param_grads.append(grad_rows.sum(0).to(bias_dtype) if needs_bias else None)
        if input_grad is not None:
            input_grad = comm.reduce_scatter(input_grad.contiguous(), ctx.dim)
        return (input_grad, None, None, None, *param_grads)


def _compute_cast(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``tensor`` as autocast hands it to a lower-precision op (``dtype``; None: autocast off)."""
    if dtype is None or not tensor.is_floating_point() or tensor.dtype in (dtype, torch.float64):
        return tensor
    return tensor.to(dtype)


def _pairs(biases: tuple[bool, ...], params: tuple[Tensor, ...] | list[Tensor]) -> list[tuple[Tensor, Tensor | None]]:
    """``(weight, bias or None)`` per linear from the flat ``params`` (a weight, then its bias where it has one)."""
    pairs, position = [], 0
    for has_bias in biases:
        pairs.append((params[position], params[position + 1] if has_bias else None))
        position += 2 if has_bias else 1
    return pairs


def add_bias(out: Tensor, bias: Tensor) -> Tensor:
    """``out + bias`` in ``out``'s dtype. The unsplit layer (F.linear, or addmm for GPT-2's Conv1D) casts its bias
    to the compute dtype under autocast and returns bf16; a plain add of the fp32 bias would promote the split
    layer's output to fp32, which the next stage (expecting the unsplit dtype) refuses. Without autocast both are
    fp32 and this is the plain add."""
    return out + bias.to(out.dtype)


def copy_to_group(x: Tensor, key: str) -> Tensor:
    return _CopyToGroup.apply(x, key)  # type: ignore[no-any-return]


def reduce_from_group(x: Tensor, key: str) -> Tensor:
    return _ReduceFromGroup.apply(x, key)  # type: ignore[no-any-return]


def gather_from_group(x: Tensor, key: str, dim: int) -> Tensor:
    return _GatherFromGroup.apply(x, key, dim)  # type: ignore[no-any-return]


def gather_for_inference(x: Tensor, key: str, dim: int) -> Tensor:
    """``x`` while autograd records (training: the parallel loss takes the split logits); gathered under no_grad,
    where evaluate and predict run and predict returns whole outputs."""
    return x if torch.is_grad_enabled() else gather_from_group(x, key, dim)


def gather_sequence(x: Tensor, key: str, dim: int) -> Tensor:
    return _GatherSequence.apply(x, key, dim)  # type: ignore[no-any-return]


def sequence_columns(x: Tensor, key: str, dim: int, biases: tuple[bool, ...], *params: Tensor) -> tuple[Tensor, ...]:
    """``tuple(F.linear(gather_sequence(x, key, dim), weight_i, bias_i))`` for the linears whose ``params`` are
    listed (a weight, then its bias where ``biases[i]``), keeping only ``x``'s token share for backward
    (:class:`_SequenceColumns`)."""
    return _SequenceColumns.apply(x, key, dim, biases, *params)  # type: ignore[no-any-return]


def reduce_scatter_sequence(x: Tensor, key: str, dim: int) -> Tensor:
    return _ReduceScatterSequence.apply(x, key, dim)  # type: ignore[no-any-return]


def split_sequence(x: Tensor, key: str, dim: int) -> Tensor:
    return _SplitSequence.apply(x, key, dim)  # type: ignore[no-any-return]


def vocab_embedding(ids: Tensor, weight: Tensor, key: str, vocab_start: int) -> Tensor:
    """Rows ``[vocab_start, vocab_start + len(weight))`` of a table split over the group by rows: each member looks
    up the ids it holds (zeros for the others); the sum over the group is the full lookup."""
    local = ids - vocab_start
    outside = (local < 0) | (local >= weight.shape[0])
    found = F.embedding(local.masked_fill(outside, 0), weight)
    return reduce_from_group(found.masked_fill(outside.unsqueeze(-1), 0.0), key)


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, key: str, vocab_start: int,
                                 ignore_index: int = -100) -> Tensor:
    """``F.cross_entropy(full_logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)`` from each
    member's vocabulary columns ``[vocab_start, vocab_start + logits.shape[-1])``, without gathering the logits.

    The shift by the row maximum is a constant for autograd (the loss does not depend on it), so the sums over
    the group (forward all-reduce, backward identity) give every member its logits' exact gradient.
    """
    comm = group(key)
    # the dtype F.cross_entropy gives: autocast runs it in fp32 (a bf16 loss would round the reported value)
    autocast = torch.is_autocast_enabled(logits.device.type) and logits.dtype in (torch.bfloat16, torch.float16)
    dtype = torch.float32 if autocast else logits.dtype
    flat = logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32))
    labels = targets.flatten()
    local_max = flat.detach().amax(dim=-1, keepdim=True)
    row_max = comm.all_gather(local_max, 1).amax(dim=-1, keepdim=True)
    shifted = flat - row_max
    sum_exp = reduce_from_group(shifted.exp().sum(dim=-1), key)
    local = labels - vocab_start
    held = (local >= 0) & (local < flat.shape[-1])
    # indexing, not gather: gather's backward keeps its whole input (this member's logits again) where indexing
    # keeps only the indices, so the loss saves one shard of the logits (exp's output), as F.cross_entropy saves one
    picked = shifted[torch.arange(flat.shape[0], device=flat.device), local.clamp(0, flat.shape[-1] - 1)]
    target_logit = reduce_from_group(picked.masked_fill(~held, 0.0), key)
    valid = labels != ignore_index
    losses = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
    return (losses.sum() / valid.sum()).to(dtype)
