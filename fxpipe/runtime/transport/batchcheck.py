"""One batch: every rank must pass ``step`` the same global batch; a cheap fingerprint exchange checks it."""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from fxpipe.runtime.faults.errors import BatchShapeError, PipelineSetupError
from fxpipe.runtime.transport.comm import PeerExchange, Pending, buffer_shape

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram

CHECK_MODES = ("first", "always", "off")
NUM_CHECKED_FIRST_STEPS = 2  # "first" also fingerprints the data whenever the shapes change


class BatchMismatchError(BatchShapeError):
    """Ranks passed ``step`` different global batches (shapes, dtypes or data); raised on every rank."""


def check_batch_mode(mode: str) -> str:
    if mode not in CHECK_MODES:
        raise PipelineSetupError(f"check_batch={mode!r} is unknown; choose 'first' (data fingerprint on the first "
                         f"{NUM_CHECKED_FIRST_STEPS} steps and when shapes change, shapes every step), 'always' "
                         "or 'off'")
    return mode


def _leaf_layout(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{leaf.dtype}{tuple(leaf.shape)}"
    return f"{type(leaf).__name__}:{leaf!r}"


def _digest(parts: list[bytes]) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return int.from_bytes(digest.digest(), "little") >> 1  # fits an int64


def layout_digest(leaves: list[Any]) -> int:
    """Digest of the batch's structure: each leaf's dtype and shape (or a non-tensor's value)."""
    return _digest([_leaf_layout(leaf).encode() for leaf in leaves])


def data_digest(leaves: list[Any]) -> int:
    """Digest of the batch's exact bytes (tensors copied to the CPU when they live elsewhere)."""
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().contiguous().cpu().reshape(-1)
            parts.append(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        else:
            parts.append(repr(leaf).encode())
    return _digest(parts)


class BatchChecker:
    """Compares ``(layout digest, data digest)`` of each step's batch over all ranks; raises on a difference.

    The layout digest is dtypes and shapes; the data digest the bytes, taken on the first steps and
    whenever this rank's layout changes (``"first"``) or every step (``"always"``). On the first
    steps (every step with ``"always"``) an all_gather before the step compares them. Later steps
    fold 16-bit digests into the loss allreduce that ends the step (no extra collective, which costs
    about a millisecond on local gloo): all ranks agree iff ``n * sum(d * d) == sum(d) ** 2`` (exact
    in float64 for up to ~1000 ranks); a difference then gathers the full digests to name the ranks.
    Every rank sees the same numbers, so every rank raises the same error: no rank is left waiting.
    """

    def __init__(self, mode: str, exchange: PeerExchange, batch_dims: str = "") -> None:
        self.mode = check_batch_mode(mode)
        self.exchange = exchange
        self.batch_dims = batch_dims  # where the batch is, for the messages (describe_batch_dims)
        self.num_steps = 0
        self.last_layout: int | None = None
        self.folded: tuple[int, int] | None = None  # full digests folded into this step's loss allreduce
        self.precision = ""  # the autocast the step's forwards run under, compared with the batch's layout
        # a world of one has no other batch to compare: no digest, no collective, no cost per step
        self.active = self.mode != "off" and dist.is_initialized() and dist.get_world_size() > 1

    def check(self, inputs: tuple[Any, ...], targets: Any, *, partial: bool = False, new_shape: bool = False,
              fold: bool = True) -> None:
        """Before the step: digest the batch; on the first steps and for a shape this rank has not run
        (``new_shape``, the same on every rank that passes the same batches), compare now (all ranks call it):
        ranks with other shapes would post transfers of other sizes.

        Partial data differs between ranks by design: then only the choice of partial data is compared.
        ``fold=False`` (a pass that ends without the loss allreduce): later steps are not compared.
        """
        self.folded = None
        if not self.active:
            return
        leaves = tree_flatten((tuple(inputs), targets))[0]
        layout = layout_digest([self.precision, *(["partial data"] if partial else leaves)])
        before_step = self.mode == "always" or self.num_steps < NUM_CHECKED_FIRST_STEPS or new_shape
        wants_data = not partial and (before_step or layout != self.last_layout)
        if not before_step and not fold:
            return
        data = data_digest(leaves) if wants_data else 0
        self.num_steps += 1
        self.last_layout = layout
        if before_step:
            raise_on_difference(self._gather(layout, data), self.batch_dims)
        else:
            self.folded = (layout, data)

    def fold_values(self) -> list[float]:
        """What this rank adds to the loss allreduce: ``[a, a*a, b, b*b]`` of its folded digests (or none)."""
        if not self.active:
            return []
        layout, data = self.folded or (0, 0)
        small = [(layout & 0xFFFF) + 1 if self.folded else 0, (data & 0xFFFF) + 1 if data else 0]
        return [float(v) for value in small for v in (value, value * value)]

    def check_folded(self, sums: list[float]) -> None:
        """After the loss allreduce: raise on every rank if the folded digests were not all equal."""
        if self.folded is None:
            return
        world_size = dist.get_world_size()
        if all(world_size * sums[i + 1] == sums[i] ** 2 for i in (0, 2)):
            return
        # the full digests decide: a rank whose own layout changed back after an error digests its data
        # when the others do not, which differs here but is no mismatch
        raise_on_difference(self._gather(*self.folded), self.batch_dims)

    def _gather(self, layout: int, data: int) -> list[tuple[int, int]]:
        mine = torch.tensor([layout, data], dtype=torch.int64, device=self.exchange.device)
        world_size = dist.get_world_size()
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        work = dist.all_gather(gathered, mine, async_op=True)
        # a dead rank fails the wait as a CommunicationError; with two ranks it names the other one
        peer = 1 - self.exchange.rank if world_size == 2 else -1
        self.exchange.wait([Pending(work, peer, "batch fingerprint all_gather over all ranks", mine)])
        return [(int(item[0]), int(item[1])) for item in gathered]


def describe_batch_dims(program: SplitProgram, target_batch_dim: int) -> str:
    """``"batch in dim 1 of 'x', dim 1 of the targets"``: where the plan reads the batch, for error messages."""
    inputs = [f"dim {program.values[name].batch_dim} of {name!r}" for name in program.model_inputs
              if program.values[name].batched]
    return f"batch in {', '.join([*inputs, f'dim {target_batch_dim} of the targets'])}"


def raise_on_difference(rows: list[tuple[int, int]], batch_dims: str = "") -> None:
    """``rows[rank] = (layout digest, data digest or 0)``; raise naming the ranks that differ from rank 0.

    ``batch_dims``: where the batch is (:func:`describe_batch_dims`), named when shapes differ.
    """
    layouts = [row[0] for row in rows]
    shape_differs = [rank for rank, layout in enumerate(layouts) if layout != layouts[0]]
    if shape_differs:
        where = f" ({batch_dims})" if batch_dims else ""
        raise BatchMismatchError(
            f"ranks {shape_differs} passed step() inputs/targets of other shapes or dtypes than rank 0{where} (or one "
            "side passed partial=True, or called it under another torch.autocast); every rank must pass the same global batch, or each its own rows with "
            "partial=True (pipe.input_rows() / pipe.target_rows(), concatenated in the batch dims)")
    data = [row[1] for row in rows]
    checked = [rank for rank, value in enumerate(data) if value != 0]
    data_differs = [rank for rank in checked if data[rank] != data[checked[0]]] if checked else []
    if data_differs:
        raise BatchMismatchError(
            f"ranks {data_differs} passed step() a different global batch than rank {checked[0]} (same shapes, "
            "other data); every rank must pass the same global batch (seed the data loader alike, no "
            "DistributedSampler: fxpipe slices rows itself)")


def check_shapes(program: SplitProgram, inputs: tuple[Any, ...], targets: Any, *, num_rows: int,
                 reads: Collection[str] | None, reads_targets: bool, target_batch_dim: int = 0) -> None:
    """Inputs and targets against the plan-time shapes (raises BatchShapeError; no communication).

    ``reads`` None: the global batch of ``num_rows`` rows; else partial data of ``num_rows`` rows, where
    only the inputs named in ``reads`` (and the targets when ``reads_targets``) are checked. Rows are
    counted along each input's batch dim (``ValueSpec.batch_dim``) and the targets' ``target_batch_dim``.
    """
    names = program.model_inputs
    if len(inputs) != len(names):
        raise BatchShapeError(f"step got {len(inputs)} inputs but the model takes {len(names)} ({list(names)})")
    batch = num_rows
    rows_of = "the global batch" if reads is None else "this rank's rows"
    for name, value in zip(names, inputs, strict=True):
        spec = program.values[name]
        if not spec.is_tensor or (reads is not None and name not in reads):
            continue
        if not isinstance(value, torch.Tensor):
            raise BatchShapeError(f"input {name!r} must be a tensor, got {type(value).__name__}")
        expected = buffer_shape(spec.shape, spec.batched, batch, spec.batch_dim)
        if tuple(value.shape) != expected or (spec.dtype is not None and value.dtype != spec.dtype):
            where = f"batch in dim {spec.batch_dim}" if spec.batched else "not batched"
            raise BatchShapeError(
                f"input {name!r} has shape {tuple(value.shape)} {value.dtype} but the plan expects {expected} "
                f"{spec.dtype} ({where}; {rows_of}: {batch} rows); recompile for other shapes, or fix batch_dims "
                "if the batch is in another dim")
    dim = target_batch_dim
    for leaf in tree_flatten(targets if reads_targets else None)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and (leaf.dim() <= dim or leaf.shape[dim] != batch):
            rows = leaf.shape[dim] if leaf.dim() > dim else "no"
            raise BatchShapeError(f"targets have {rows} rows in their batch dim {dim} (shape {tuple(leaf.shape)}) "
                                  f"but {rows_of} is {batch} rows; pass targets with the batch in dim {dim} or set "
                                  "target_batch_dim")
