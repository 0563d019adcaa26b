"""Process groups, row routes between stage replicas, and tagged point-to-point transfer of value pieces."""

from __future__ import annotations

import atexit
import functools
import math
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.core.row_slices import row_ranges, shared_rows
from fxpipe.runtime.faults.errors import CommunicationError, MessageLayoutError, PipelineSetupError
from fxpipe.runtime.faults.failures import FailureLog, root_cause_hint

DEFAULT_TIMEOUT_S = 60.0


class MessageKind(IntEnum):
    """What a message carries; part of its tag so gloo never matches a message to the wrong receive."""

    ACTIVATION = 0
    GRADIENT = 1
    OBJECT_LENGTH = 2
    OBJECT_BYTES = 3


@dataclass(frozen=True)
class Route:
    """One piece of a value travelling from a sender replica to a receiver replica.

    Rows are relative to each side's own slice; ``None`` means the whole tensor (unbatched values
    and Python objects go whole).
    """

    value: str
    sender_rank: int
    receiver_rank: int
    sender_rows: tuple[int, int] | None
    receiver_rows: tuple[int, int] | None


@dataclass(frozen=True)
class DistContext:
    """This process's place in the default process group."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    owns_group: bool = False  # fxpipe created the default group, so close() destroys it


def slice_rows(microbatch_index: int, microbatch_rows: int, replica_index: int,
               num_replicas: int) -> tuple[int, int]:
    """Global batch rows ``[start, stop)`` that replica ``replica_index`` of a stage handles in a micro-batch."""
    start, stop = row_ranges(microbatch_rows, num_replicas)[replica_index]
    offset = microbatch_index * microbatch_rows
    return offset + start, offset + stop


def routes_between(value: str, batched: bool, microbatch_rows: int, sender_devices: Sequence[int],
                   receiver_devices: Sequence[int]) -> tuple[Route, ...]:
    """Every piece of ``value`` that goes from the sender stage's replicas to the receiver stage's.

    Batched values: each sender gives each receiver exactly the rows they share. Unbatched values:
    receiver replica j gets the whole value from sender replica ``j % num_senders``.
    """
    if not batched:
        return tuple(Route(value, sender_devices[j % len(sender_devices)], receiver, None, None)
                     for j, receiver in enumerate(receiver_devices))
    sender_ranges = row_ranges(microbatch_rows, len(sender_devices))
    receiver_ranges = row_ranges(microbatch_rows, len(receiver_devices))
    routes = []
    for i, j, start, stop in shared_rows(microbatch_rows, len(sender_devices), len(receiver_devices)):
        sender_offset, receiver_offset = sender_ranges[i][0], receiver_ranges[j][0]
        routes.append(Route(value, sender_devices[i], receiver_devices[j],
                            (start - sender_offset, stop - sender_offset),
                            (start - receiver_offset, stop - receiver_offset)))
    return tuple(routes)


def buffer_shape(plan_shape: Sequence[int], batched: bool, num_rows: int, batch_dim: int = 0) -> tuple[int, ...]:
    """Shape of a receive buffer: the plan-time shape with ``num_rows`` in the batch dim for batched values."""
    if not batched:
        return tuple(plan_shape)
    return (*plan_shape[:batch_dim], num_rows, *plan_shape[batch_dim + 1:])


def take_rows(value: torch.Tensor, batch_dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``value`` along its batch dim, as a view (the value itself when it is all)."""
    if (start, stop) == (0, value.shape[batch_dim]):
        return value
    return value.narrow(batch_dim, start, stop - start)


def device_rows(value: Any, batch_dim: int | None, start: int, stop: int, device: torch.device) -> Any:
    """Rows ``[start, stop)`` of ``value`` along ``batch_dim`` (None: the whole value; non-tensors as they are),
    on ``device``."""
    if not isinstance(value, torch.Tensor):
        return value
    if batch_dim is not None and value.dim() > batch_dim:
        value = take_rows(value, batch_dim, start, stop)
    if value.device == device:
        return value
    # host -> GPU without waiting: the step ends by reading the loss, which waits for this copy, so the
    # caller may reuse its batch after step() (a copy to the CPU must block: CPU ops do not wait)
    return value.to(device, non_blocking=device.type == "cuda")


# Byte alignment of each tensor inside a packed message (so every piece can be viewed as its dtype in place).
PACK_ALIGN = 16

# Every message starts with a header of int64 words: HEADER_MAGIC, the payload's bytes, the number of pieces, then
# each piece's dtype code and element count. gloo fills a receive buffer larger than the message it gets only in
# part, silently (a bfloat16 value received where float32 was expected left half the buffer unwritten: losses of
# 1e35 and nan); with the header the receiver sees what was sent and raises, naming both layouts.
HEADER_MAGIC = 0x6678706970650001  # "fxpipe", format 1
_DTYPES: tuple[torch.dtype, ...] = tuple(sorted({value for value in vars(torch).values()
                                                 if isinstance(value, torch.dtype)}, key=str))
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}

Layouts = Sequence[tuple[Sequence[int], torch.dtype]]


def packed_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Byte offset of each piece in a packed message's payload, and the payload's total bytes."""
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // PACK_ALIGN) * PACK_ALIGN
    return offsets, total


def header_bytes(num_pieces: int) -> int:
    """Bytes of a message's header (``PACK_ALIGN``-aligned, so the payload's pieces stay aligned)."""
    return -(-(8 * (3 + 2 * num_pieces)) // PACK_ALIGN) * PACK_ALIGN


def message_header(layouts: Layouts) -> tuple[int, ...]:
    """The header words of a message holding pieces of these (shape, dtype)."""
    payload = packed_offsets(_piece_bytes(layouts))[1]
    words = [HEADER_MAGIC, payload, len(layouts)]
    for shape, dtype in layouts:
        words += [_DTYPE_CODES[dtype], math.prod(shape)]
    return tuple(words)


@functools.lru_cache(maxsize=1024)
def _header_tensor(words: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The header as int64 words on ``device``, made once per layout (a host-to-GPU copy per send would wait)."""
    return torch.tensor(words, dtype=torch.int64).to(device)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One byte buffer: the header, then every tensor, in order, each at a ``PACK_ALIGN``-aligned offset.

    Values crossing a cut to the same peer go as one message: on gloo every message costs a
    latency and CPU time at both ends, far more than copying small tensors once.
    """
    flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    words = message_header([(tuple(t.shape), t.dtype) for t in tensors])
    start = header_bytes(len(tensors))
    offsets, total = packed_offsets([f.numel() for f in flat])
    buffer = torch.empty(start + total, dtype=torch.uint8, device=tensors[0].device)
    buffer[:8 * len(words)].view(torch.int64).copy_(_header_tensor(words, buffer.device))
    for piece, offset in zip(flat, offsets, strict=True):
        buffer[start + offset:start + offset + piece.numel()].copy_(piece)
    return buffer


def _piece_bytes(layouts: Layouts) -> list[int]:
    return [math.prod(shape) * dtype.itemsize for shape, dtype in layouts]


def packed_bytes(layouts: Layouts) -> int:
    """Size of the packed message for pieces of these (shape, dtype), header included."""
    return header_bytes(len(layouts)) + packed_offsets(_piece_bytes(layouts))[1]


def unpack(buffer: torch.Tensor, layouts: Layouts) -> list[torch.Tensor]:
    """The pieces of a packed message as views of ``buffer`` with their (shape, dtype); the header is not read
    here (:func:`check_header`)."""
    sizes = _piece_bytes(layouts)
    offsets, total = packed_offsets(sizes)
    start = header_bytes(len(layouts))
    if buffer.numel() != start + total:
        raise CommunicationError(f"packed message has {buffer.numel()} bytes but its pieces need {start + total}")
    return [buffer[start + offset:start + offset + size].view(dtype).view(tuple(shape))
            for (shape, dtype), offset, size in zip(layouts, offsets, sizes, strict=True)]


def header_view(buffer: torch.Tensor, num_pieces: int) -> torch.Tensor:
    """The header words of a packed message of ``num_pieces`` pieces, as an int64 view."""
    return buffer[:8 * (3 + 2 * num_pieces)].view(torch.int64)


def check_header(words: Sequence[int], layouts: Layouts, names: Sequence[str], source: str) -> None:
    """Raise :class:`MessageLayoutError` unless a received header (``words``) says the message holds ``layouts``.

    ``names``: each piece's value name; ``source``: what the message is and where it came from, for the error.
    """
    expected = message_header(layouts)
    if tuple(words) == expected:
        return
    if len(words) < 3 or words[0] != HEADER_MAGIC or words[2] != len(layouts):
        raise MessageLayoutError(
            f"{source}: the message is not the expected {len(layouts)} piece(s) of {packed_bytes(layouts)} bytes "
            f"(header {list(words[:3])}): the sender sent a shorter or other message; do all ranks run the same "
            "plan, batch and torch.autocast?")
    differences = []
    for index, ((shape, dtype), name) in enumerate(zip(layouts, names, strict=True)):
        code, count = words[3 + 2 * index], words[4 + 2 * index]
        sent = _DTYPES[code] if 0 <= code < len(_DTYPES) else f"dtype code {code}"
        if (code, count) != (_DTYPE_CODES[dtype], math.prod(shape)):
            differences.append(f"{name!r}: expected {dtype} of shape {tuple(shape)} ({math.prod(shape)} elements), "
                               f"received {sent} with {count} elements")
    raise MessageLayoutError(
        f"{source}: {'; '.join(differences) or 'the payload size differs'} ({words[1]} bytes sent, "
        f"{expected[1]} expected). The ranks disagree on what crosses this cut: do all ranks call step under the "
        "same torch.autocast (or none), or compile with autocast_dtype?")


def message_tag(kind: MessageKind, microbatch_index: int, value_index: int, num_values: int) -> int:
    """A tag unique per (kind, micro-batch, value) within a step; (sender, tag) names one message."""
    return (microbatch_index * num_values + value_index) * len(MessageKind) + int(kind)


def pick_backend() -> tuple[str, torch.device]:
    """NCCL on CUDA (device = LOCAL_RANK), gloo on CPU.

    A host that launches more ranks than it shows GPUs, with every rank seeing the same GPUs (no
    ``CUDA_VISIBLE_DEVICES``), fails here, on every one of its ranks, naming both counts: NCCL refuses two ranks
    on one GPU only at the first collective ("Duplicate GPU detected", the H200 suite run's two-rank torchrun
    test). Where ``CUDA_VISIBLE_DEVICES`` is set, a launcher may give each rank a GPU of its own (one visible
    each), so LOCAL_RANK is taken modulo the visible count as before.
    """
    if torch.cuda.is_available() and dist.is_nccl_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), local_rank + 1)
        num_gpus = torch.cuda.device_count()
        if local_ranks > num_gpus and "CUDA_VISIBLE_DEVICES" not in os.environ:
            raise PipelineSetupError(
                f"rank {os.environ.get('RANK', '0')}: this host runs {local_ranks} ranks "
                f"(LOCAL_WORLD_SIZE) but shows {num_gpus} GPU(s), and NCCL needs a GPU of its own for each rank; "
                f"launch at most {num_gpus} per host (torchrun --nproc-per-node {num_gpus}), or hide the GPUs "
                "(CUDA_VISIBLE_DEVICES='') to train on CPU ranks with gloo")
        return "nccl", torch.device("cuda", local_rank % num_gpus)
    return "gloo", torch.device("cpu")


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the default process group, creating it when needed.

    Under torchrun (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) it uses ``env://``; with no such
    environment it makes a world of one process. An existing group is used as it is.
    """
    if dist.is_initialized():
        backend = str(dist.get_backend())
        device = pick_backend()[1] if backend == "nccl" else torch.device("cpu")
        return DistContext(dist.get_rank(), dist.get_world_size(), backend, device)
    backend, device = pick_backend()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    if all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        try:
            _init_from_env(backend, timeout)
        except dist.DistError as error:  # a rank that failed before compile never joins: say so, not just "timed out"
            raise CommunicationError(
                f"rank {os.environ['RANK']}: not all {os.environ['WORLD_SIZE']} ranks joined the process group within "
                f"{timeout_s:g} s (did a rank fail before fxpipe.compile, or did the launch start fewer processes "
                f"than WORLD_SIZE?): {error}") from error
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    atexit.register(_destroy_own_group, dist.group.WORLD)
    return DistContext(dist.get_rank(), dist.get_world_size(), backend, device, owns_group=True)


def _destroy_own_group(group: object) -> None:
    """At interpreter exit, tear down the default group fxpipe created (unless the script already did):
    left to interpreter teardown, a torchrun worker aborted there now and then ("terminate called without
    an active exception", about 1 in 10 restarted jobs under load)."""
    if dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()


def _init_from_env(backend: str, timeout: timedelta) -> None:
    """env:// rendezvous; under torchrun restarts, each attempt uses its own key prefix.

    torchrun keeps one agent store across restarts, so a restarted worker would otherwise read
    the killed attempt's gloo addresses and fail to connect.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"fxpipe-attempt-{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def close_distributed(context: DistContext) -> None:
    """Wait for every rank, then destroy the default group if fxpipe created it."""
    if not dist.is_initialized():
        return
    dist.barrier()
    if context.owns_group:
        dist.destroy_process_group()


def new_groups(rank_lists: Sequence[Sequence[int]]) -> list[dist.ProcessGroup | None]:
    """One process group per rank list (None for single-rank lists); every rank must call this alike."""
    groups: list[dist.ProcessGroup | None] = []
    for ranks in rank_lists:
        if len(ranks) <= 1:  # no group, and no question to the default group (a driver in a world of one)
            groups.append(None)
            continue
        group = dist.new_group(sorted(ranks))
        groups.append(group if dist.get_rank() in ranks else None)
    return groups


@dataclass
class Pending:
    """An in-flight send or receive and what it is, for error messages."""

    work: dist.Work | None
    peer: int
    description: str
    tensor: torch.Tensor


class PeerExchange:
    """Posts tagged sends/receives and waits on them with a timeout that names the peer on failure."""

    def __init__(self, rank: int, device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        # the job's first-failure record and heartbeats; set by the driver (None: name the peer only)
        self.failures: FailureLog | None = None

    def post(self, ops: Sequence[tuple[bool, torch.Tensor, int, int, str]]) -> list[Pending]:
        """Start ``(is_send, tensor, peer, tag, description)`` operations as one batch."""
        if not ops:
            return []
        p2p_ops = [dist.P2POp(dist.isend if is_send else dist.irecv, tensor, peer, tag=tag)
                   for is_send, tensor, peer, tag, _ in ops]
        try:
            works = dist.batch_isend_irecv(p2p_ops)
        except RuntimeError as error:
            names = "; ".join(f"{d} (rank {p})" for _, _, p, _, d in ops)
            hint = root_cause_hint(self.failures, ops[0][2], f"starting transfers [{names}]", error)
            raise CommunicationError(
                f"rank {self.rank}: starting transfers failed [{names}]: {error}.{hint}") from error
        if len(works) != len(ops):  # coalesced backends (NCCL) return one work for the whole batch
            names = "; ".join(f"{d} with rank {p}" for _, _, p, _, d in ops)
            return [Pending(works[0] if works else None, ops[0][2], names, ops[0][1])] + [
                Pending(None, p, d, t) for _, t, p, _, d in ops[1:]]
        return [Pending(work, peer, description, tensor)
                for work, (_, tensor, peer, _, description) in zip(works, ops, strict=True)]

    def wait(self, pending: Sequence[Pending]) -> None:
        """Wait for every operation; a failure, a timeout or a stalled rank raises CommunicationError naming the rank.

        While it waits, the failure log's heartbeat thread watches the job (``failures.waiting``): a
        recorded failure or a rank whose heartbeat stopped breaks the wait within ``stall_timeout_s``.
        """
        log = self.failures
        for item in pending:
            if item.work is None:
                continue
            if log is not None:
                log.waiting = item
            try:
                item.work.wait(self.timeout)
            except RuntimeError as error:
                raise self._failed(item, error) from error
            finally:
                if log is not None:
                    log.waiting = None

    def _failed(self, item: Pending, error: RuntimeError) -> CommunicationError:
        peer = f"rank {item.peer}" if item.peer >= 0 else "a rank of the group"
        if self.failures is not None and self.failures.aborted is not None:
            return CommunicationError(
                f"rank {self.rank}: stopped waiting for {item.description} with {peer}: the job cannot finish this "
                f"step. Root cause (the job's first failure): {self.failures.aborted}.")
        hint = root_cause_hint(self.failures, item.peer, f"{item.description} with {peer}", error)
        return CommunicationError(
            f"rank {self.rank}: {item.description} with {peer} failed or timed out after "
            f"{self.timeout.total_seconds():.0f} s (is {peer} alive and running the same "
            f"plan and batch?): {error}.{hint}")

    def send_object(self, obj: object, peer: int, tags: tuple[int, int], description: str) -> list[Pending]:
        """Send a Python object as its pickled length then its bytes (for non-tensor values)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        return self.post([(True, length, peer, tags[0], description + " (length)"),
                          (True, payload, peer, tags[1], description)])

    def recv_object(self, peer: int, tags: tuple[int, int], description: str) -> object:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.wait(self.post([(False, length, peer, tags[0], description + " (length)")]))
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.wait(self.post([(False, payload, peer, tags[1], description)]))
        return pickle.loads(payload.cpu().numpy().tobytes())


def allreduce_async(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> tuple[dist.Work, torch.Tensor]:
    """Start a SUM allreduce of ``tensors`` flattened into one buffer; returns (work, flat buffer)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
    assert work is not None
    return work, flat


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a flat buffer made by :func:`allreduce_async` back into ``tensors``."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


def broadcast_text(text: str | None, source_rank: int = 0) -> str:
    """``text`` from ``source_rank`` on every rank (plans made on one rank, so every rank runs the same one)."""
    if dist.get_world_size() == 1:
        assert text is not None
        return text
    box: list[str | None] = [text if dist.get_rank() == source_rank else None]
    dist.broadcast_object_list(box, src=source_rank)
    assert isinstance(box[0], str)
    return box[0]


def current_rank() -> int:
    """This process's rank in the default group (0 when there is none)."""
    return dist.get_rank() if dist.is_initialized() else 0


def reduce_scatter_flat(shard: torch.Tensor, whole: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum ``whole`` over ``group`` and keep this rank's ``shard`` of it (one flat buffer, as FSDP2 calls it).

    torch 2.13 names the call ``reduce_scatter_single`` and deprecates ``reduce_scatter_tensor``; torch 2.11 and
    earlier have only the latter (the same collective).
    """
    call = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    call(shard, whole, group=group)


def all_gather_flat(whole: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Every rank's ``shard`` of ``group`` into ``whole``, in rank order (``all_gather_single`` on torch 2.13,
    ``all_gather_into_tensor`` before it)."""
    call = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    call(whole, shard, group=group)
