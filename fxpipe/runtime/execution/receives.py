"""One rank's tensor receives: message layouts fixed at setup, posted one receive ahead of use on gloo."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.transport.comm import (
    MessageKind,
    PeerExchange,
    Pending,
    check_header,
    header_view,
    packed_bytes,
    unpack,
)

Piece = tuple[int, tuple[str, int], tuple[int, ...], torch.dtype]  # (peer rank, (value, route index), shape, dtype)
Layout = list[tuple[tuple[int, ...], torch.dtype]]
Tag = Callable[[MessageKind, int, str], int]  # (kind, micro-batch, value name) -> message tag


@dataclass(frozen=True)
class Message:
    """What one peer sends per micro-batch: its pieces' keys and layouts, packed behind a header that says what
    they are (:func:`fxpipe.runtime.transport.comm.pack`), even a single piece: the receiver checks what it got."""

    peer: int
    keys: tuple[tuple[str, int], ...]
    layouts: Layout
    num_bytes: int
    names: str  # for error messages


def _messages(pieces: Sequence[Piece]) -> list[Message]:
    by_peer: dict[int, list[tuple[tuple[str, int], tuple[int, ...], torch.dtype]]] = {}
    for peer, key, shape, dtype in pieces:
        by_peer.setdefault(peer, []).append((key, shape, dtype))
    messages = []
    for peer, items in by_peer.items():
        keys = tuple(key for key, _, _ in items)
        layouts = [(shape, dtype) for _, shape, dtype in items]
        messages.append(Message(peer, keys, layouts, packed_bytes(layouts), ", ".join(repr(name) for name, _ in keys)))
    return messages


@dataclass
class _Posted:
    pending: list[Pending]
    messages: list[Message]


# kind -> per micro-batch -> the messages that micro-batch receives (one per peer)
MessagePlan = Mapping[MessageKind, Sequence[Sequence[Message]]]


def plan_messages(pieces: Mapping[MessageKind, Sequence[Sequence[Piece]]]) -> dict[MessageKind, list[list[Message]]]:
    """The messages of every kind and micro-batch from their pieces (done once per batch layout)."""
    return {kind: [_messages(microbatch_pieces) for microbatch_pieces in per_microbatch]
            for kind, per_microbatch in pieces.items()}


class Inbox:
    """Receives of activation and gradient pieces, one message per peer and micro-batch.

    gloo moves a message only once its receive is posted (the sender waits for the receiver's
    notice), so a receive posted when its action comes costs a round trip that needs the sender's
    transport thread to get a core, even when the data was sent long before (here 4-5 ms when both
    ranks compute, against 0.02-0.04 ms when the receive was already posted). With ``ahead`` the
    inbox posts the first receive of each kind when a step starts and the next one whenever it
    hands one out. Not for NCCL: its point-to-point operations between two ranks run in order on
    one stream, so an early receive would hold back this rank's sends to that peer. Each step says
    which messages it receives (:meth:`start_step`): their shapes follow the step's batch.
    """

    def __init__(self, exchange: PeerExchange, device: torch.device, tag: Tag, *, ahead: bool,
                 stage_of: Callable[[int], int]) -> None:
        self.exchange, self.device, self.tag, self.ahead = exchange, device, tag, ahead
        self.stage_of = stage_of  # a peer rank's stage, for error messages
        self.posted: dict[tuple[MessageKind, int], _Posted] = {}
        # on a GPU, headers are checked at the step's end (reading one now would wait for the device)
        self.unchecked: list[tuple[torch.Tensor, Message, str]] = []
        self.messages: MessagePlan = {}
        self.following: Mapping[MessageKind, Mapping[int, int]] = {}

    def start_step(self, messages: MessagePlan, following: Mapping[MessageKind, Mapping[int, int]]) -> None:
        """Receive ``messages`` this step (kinds left out: none), in the order ``following`` gives (the
        micro-batch each kind receives after micro-batch m, -1: the first); post each kind's first receive;
        refuse if a failed step left receives posted."""
        self.check_clean()
        self.messages, self.following = messages, following
        for kind in messages:
            self._post_following(kind, -1)

    def check_clean(self) -> None:
        """Refuse (locally, before any communication) if a failed step left receives posted."""
        self.unchecked.clear()
        if self.posted:
            raise PipelineSetupError(
                f"rank {self.exchange.rank}: an earlier step failed with {len(self.posted)} receive(s) still "
                "posted; they would take this step's messages. Build the pipeline again (fxpipe.compile) to go on")

    def take(self, kind: MessageKind, m: int) -> dict[tuple[str, int], torch.Tensor]:
        """Micro-batch ``m``'s pieces of ``kind`` by (value, route index), once they arrived."""
        posted = self.posted.pop((kind, m), None) or self._post(kind, m)
        self._post_following(kind, m)
        self.exchange.wait(posted.pending)
        pieces: dict[tuple[str, int], torch.Tensor] = {}
        for item, message in zip(posted.pending, posted.messages, strict=True):
            header = header_view(item.tensor, len(message.layouts))
            source = (f"rank {self.exchange.rank}: {item.description} from rank {message.peer} "
                      f"(stage {self.stage_of(message.peer)})")
            if header.device.type == "cpu":
                self._check(header, message, source)
            else:
                self.unchecked.append((header.clone(), message, source))
            received = unpack(item.tensor, message.layouts)
            if len(received) > 1:  # each piece its own storage: a piece this stage saves for backward would keep
                received = [piece.clone() for piece in received]  # the whole message alive (header, other pieces)
            pieces.update(zip(message.keys, received, strict=True))
        return pieces

    def verify(self) -> None:
        """Check the headers of this step's messages not checked on arrival (on a GPU): MessageLayoutError."""
        unchecked, self.unchecked = self.unchecked, []
        for header, message, source in unchecked:
            self._check(header, message, source)

    @staticmethod
    def _check(header: torch.Tensor, message: Message, source: str) -> None:
        check_header(header.tolist(), message.layouts, [name for name, _ in message.keys], source)

    def _post_following(self, kind: MessageKind, m: int) -> None:
        following = self.following[kind].get(m)
        if self.ahead and following is not None and self.messages[kind][following]:
            self.posted[kind, following] = self._post(kind, following)

    def _post(self, kind: MessageKind, m: int) -> _Posted:
        what = "activation" if kind is MessageKind.ACTIVATION else "gradient of"
        messages = self.messages[kind][m]
        ops = [(False, torch.empty(message.num_bytes, dtype=torch.uint8, device=self.device), message.peer,
                self.tag(kind, m, message.keys[0][0]), f"receive {what} {message.names} of micro-batch {m}")
               for message in messages]
        return _Posted(self.exchange.post(ops), list(messages))
