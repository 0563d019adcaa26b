"""Routes between stages whose replicas are tensor-parallel groups: replica rows, then group member pairs."""

from __future__ import annotations

from dataclasses import replace

from fxpipe.core.plan import StagePlan
from fxpipe.runtime.transport.comm import Route, routes_between

RoutePair = tuple[tuple[Route, ...], tuple[Route, ...]]


def group_routes(value: str, batched: bool, microbatch_rows: int, sender: StagePlan,
                 receiver: StagePlan) -> RoutePair:
    """``(activation routes, gradient routes)`` of ``value`` from stage ``sender`` to stage ``receiver``.

    Rows go replica to replica as without tensor parallelism (:func:`routes_between` over replica indices);
    inside one replica pair every value is whole on each group member, so forward, receiver member ``j`` takes
    its rows from sender member ``j mod T_sender`` (each receiver member gets them once), and backward, sender
    member ``j`` takes their gradient from receiver member ``j mod T_receiver`` (each sender member gets its
    output gradient once; members of a group hold the same input gradient). With T = 1 on both sides both
    lists are :func:`routes_between` over the stages' devices.
    """
    replica_routes = routes_between(value, batched, microbatch_rows, range(sender.replicas), range(receiver.replicas))
    activation: list[Route] = []
    gradient: list[Route] = []
    for route in replica_routes:
        senders = sender.replica_devices(route.sender_rank)
        receivers = receiver.replica_devices(route.receiver_rank)
        activation.extend(replace(route, sender_rank=senders[j % len(senders)], receiver_rank=receivers[j])
                          for j in range(len(receivers)))
        gradient.extend(replace(route, sender_rank=senders[j], receiver_rank=receivers[j % len(receivers)])
                        for j in range(len(senders)))
    return tuple(activation), tuple(gradient)
