"""Where one rank's chunks (virtual stages) get their values: local hand-offs, and per chunk pair the routes and messages."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fxpipe.core import schedule as schedules
from fxpipe.core.plan import Plan
from fxpipe.runtime.execution.receives import Message, Piece, plan_messages
from fxpipe.runtime.execution.stage_routes import piece_layout
from fxpipe.runtime.transport.batch_layout import BatchLayout
from fxpipe.runtime.transport.comm import MessageKind, Route, message_tag
from fxpipe.runtime.transport.group_routes import group_routes
from fxpipe.runtime.transport.rows import RowMap

if TYPE_CHECKING:
    from fxpipe.core.program import SplitProgram

Op = schedules.Op
Link = tuple[int, int]  # (producer chunk, consumer chunk) of values that cross between two device groups


@functools.cache
def group_actions(schedule: str, num_chunks: int, num_microbatches: int, virtual_stages: int,
                  group_index: int) -> tuple[schedules.Action, ...]:
    """Device group ``group_index``'s lowered list of the named virtual schedule, validated (cached per step shape)."""
    built = schedules.make_schedule(schedule, num_chunks, num_microbatches, virtual_stages=virtual_stages)
    schedules.validate_schedule(built)
    return schedules.lower(built)[group_index]


def forward_only_actions(actions: tuple[schedules.Action, ...]) -> tuple[schedules.Action, ...]:
    """The forwards (and their receives) of a lowered list, in its order: evaluate and predict. Forwards wait only on
    forwards, which every group keeps in the same order, so the filtered lists complete as the whole ones do."""
    return tuple(a for a in actions if a.op in (Op.FORWARD, Op.RECV_ACTIVATION, Op.SEND_ACTIVATION))


def link_tag(kind: MessageKind, microbatch_index: int, value_index: int, num_values: int, link: Link,
             num_chunks: int) -> int:
    """A tag unique per (kind, micro-batch, chunk pair, value): two ranks exchanging values of several chunk pairs
    (a loop's chunk c and c + G on one group) never take one pair's message for another's."""
    pair = link[0] * num_chunks + link[1]
    return message_tag(kind, microbatch_index * num_chunks * num_chunks + pair, value_index, num_values)


@dataclass(frozen=True)
class LinkRoutes:
    """This rank's routes of one chunk pair at one micro-batch size: activations it receives (consumer side) or
    sends (producer side), and the gradient routes back, each per value name."""

    activations: dict[str, list[Route]]
    gradients: dict[str, list[Route]]


def link_routes(program: SplitProgram, plan: Plan, link: Link, rank: int, rows: int, *,
                receiving: bool) -> LinkRoutes:
    """Routes of the values chunk ``link[0]`` hands chunk ``link[1]``: ``receiving`` on the consumer's side."""
    producer, consumer = link
    activations: dict[str, list[Route]] = {}
    gradients: dict[str, list[Route]] = {}
    for name in link_values(program, link):
        spec = program.values[name]
        forward, backward = group_routes(name, spec.batched and spec.is_tensor, rows, plan.stages[producer],
                                         plan.stages[consumer])
        side = (lambda r: r.receiver_rank == rank) if receiving else (lambda r: r.sender_rank == rank)
        activations[name] = [r for r in forward if side(r)]
        if spec.requires_grad and spec.is_tensor:  # what carries a gradient back
            gradients[name] = [r for r in backward if side(r)]
    return LinkRoutes(activations, gradients)


def link_values(program: SplitProgram, link: Link) -> tuple[str, ...]:
    """The values chunk ``link[0]`` produces and chunk ``link[1]`` reads, sorted."""
    return tuple(sorted(name for name, producer in program.producers.items()
                        if producer == link[0] and link[1] in program.consumers.get(name, ())))


def chunk_links(program: SplitProgram, plan: Plan, chunk: int) -> tuple[list[Link], list[Link], list[int]]:
    """Chunk ``chunk``'s remote links in (from producers on other groups), out (to consumers on other groups), and
    the chunks on its own group it reads from (local hand-off)."""
    group = plan.group_of_chunk(chunk)
    producers = sorted({p for name in program.stages[chunk].input_values
                        if (p := program.producers[name]) >= 0 and p != chunk})
    consumers = sorted({k for name in program.stages[chunk].output_values if program.producers.get(name) == chunk
                        for k in program.consumers.get(name, ()) if k != chunk})
    remote_in = [(p, chunk) for p in producers if plan.group_of_chunk(p) != group]
    remote_out = [(chunk, k) for k in consumers if plan.group_of_chunk(k) != group]
    return remote_in, remote_out, [p for p in producers if plan.group_of_chunk(p) == group]


def _pieces(program: SplitProgram, routes: Mapping[str, list[Route]], layout: BatchLayout, *,
            activation: bool) -> list[Piece]:
    """The pieces this rank receives on ``routes``: activations from the producer side, gradients from the consumer's."""
    pieces: list[Piece] = []
    for name, named_routes in routes.items():
        if not program.values[name].is_tensor:  # a Python object goes as its own two messages (send_object)
            continue
        for index, route in enumerate(named_routes):
            peer = route.sender_rank if activation else route.receiver_rank
            rows = route.receiver_rows if activation else route.sender_rows
            pieces.append((peer, (name, index), *piece_layout(program.values[name], layout.dtypes,
                                                                layout.shapes[name], rows)))
    return pieces


@dataclass(frozen=True)
class VirtualStep:
    """What a step of one batch layout needs on this rank: the layout, its replica's rows (the same for all its
    chunks: they share the group's replicas), per micro-batch the routes of every remote link, the messages each
    link's receiving side expects, and the group's lowered list (and its forward-only part)."""

    layout: BatchLayout
    rows: RowMap
    in_routes: tuple[dict[Link, LinkRoutes], ...]  # per micro-batch: links into this rank's chunks
    out_routes: tuple[dict[Link, LinkRoutes], ...]  # per micro-batch: links out of them
    messages: dict[tuple[Link, MessageKind], dict[MessageKind, list[list[Message]]]]
    actions: tuple[schedules.Action, ...]
    forward_actions: tuple[schedules.Action, ...]

    @classmethod
    def of(cls, program: SplitProgram, plan: Plan, group_index: int, rank: int, layout: BatchLayout) -> VirtualStep:
        chunks = plan.chunks_of_group(group_index)
        first = plan.stages[chunks[0]]
        rows = RowMap.split(layout.microbatch_ranges, first.devices.index(rank) // first.tensor_parallel, first.replicas)
        links_in = [link for c in chunks for link in chunk_links(program, plan, c)[0]]
        links_out = [link for c in chunks for link in chunk_links(program, plan, c)[1]]
        num_microbatches = len(layout.microbatch_ranges)
        by_rows: dict[int, tuple[dict[Link, LinkRoutes], dict[Link, LinkRoutes]]] = {}
        for m in range(num_microbatches):
            size = layout.microbatch_rows(m)
            if size not in by_rows:
                by_rows[size] = ({link: link_routes(program, plan, link, rank, size, receiving=True) for link in links_in},
                                 {link: link_routes(program, plan, link, rank, size, receiving=False)
                                  for link in links_out})
        per_m = [by_rows[layout.microbatch_rows(m)] for m in range(num_microbatches)]
        messages = {}
        for link in links_in:  # activations arrive from the producer's ranks
            messages[link, MessageKind.ACTIVATION] = plan_messages({MessageKind.ACTIVATION: [
                _pieces(program, per_m[m][0][link].activations, layout, activation=True)
                for m in range(num_microbatches)]})
        for link in links_out:  # gradients arrive from the consumer's ranks
            messages[link, MessageKind.GRADIENT] = plan_messages({MessageKind.GRADIENT: [
                _pieces(program, per_m[m][1][link].gradients, layout, activation=False)
                for m in range(num_microbatches)]})
        actions = group_actions(plan.schedule, plan.num_stages, num_microbatches, plan.virtual_stages, group_index)
        return cls(layout, rows, tuple(p[0] for p in per_m), tuple(p[1] for p in per_m), messages, actions,
                   forward_only_actions(actions))

    def following(self, link: Link, kind: MessageKind, forward_only: bool = False) -> dict[MessageKind, dict[int, int]]:
        """The order link ``link`` receives its ``kind`` messages in: the micro-batches of its receiving chunk's
        forwards (activations) or backwards (gradients), as the Inbox posts them ahead."""
        chunk = link[1] if kind is MessageKind.ACTIVATION else link[0]
        op = Op.FORWARD if kind is MessageKind.ACTIVATION else Op.BACKWARD
        actions = self.forward_actions if forward_only else self.actions
        order = [a.microbatch_index for a in actions if a.op is op and a.chunk_index == chunk]
        return {kind: dict(zip([-1, *order], order, strict=False))}

