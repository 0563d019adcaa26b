"""One stage's lowered actions for a schedule and micro-batch count, with what the runtime reads off them."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from fxpipe.core import schedule as schedules
from fxpipe.runtime.transport.comm import MessageKind

Op = schedules.Op


@dataclass(frozen=True)
class StageActions:
    """``actions`` in order; ``following[kind][m]``: the micro-batch whose message of ``kind`` this stage receives
    after micro-batch ``m``'s (-1: the first), for receives posted ahead; ``last_gradient``: the micro-batch whose
    backward (W under split backward) produces the step's last gradients (-1: a forward-only pass)."""

    actions: tuple[schedules.Action, ...]
    following: Mapping[MessageKind, Mapping[int, int]]
    last_gradient: int


@functools.cache
def stage_actions(schedule: str, num_stages: int, num_microbatches: int, warmup_policy: str,
                  stage_index: int) -> StageActions:
    """Stage ``stage_index``'s actions of the named schedule, validated, lowered (cached: every step reads them)."""
    built = schedules.make_schedule(schedule, num_stages, num_microbatches, warmup_policy)
    schedules.validate_schedule(built)
    actions = schedules.lower(built)[stage_index]
    following = {}
    for kind, op in ((MessageKind.ACTIVATION, Op.RECV_ACTIVATION), (MessageKind.GRADIENT, Op.RECV_GRADIENT)):
        order = [action.microbatch_index for action in actions if action.op is op]
        following[kind] = dict(zip([-1, *order], order, strict=False))
    gradient_op = Op.WEIGHT if built.split_backward else Op.BACKWARD
    producing = [action.microbatch_index for action in actions if action.op is gradient_op]
    return StageActions(actions, following, producing[-1] if producing else -1)
