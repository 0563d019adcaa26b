"""Virtual-stage schedules as data: interleaved 1F1B, interleaved zero-bubble and ZB-V, one list per device group."""

from __future__ import annotations

from collections import deque

from fxpipe.core.schedule_types import Action, Op, Schedule, ScheduleError
from fxpipe.core.virtual import loop_chunk_groups, v_chunk_groups

INTERLEAVED = "interleaved"
INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"
ZBV = "zbv"
# schedules whose backward runs as B then W apart (the one-stage zero_bubble and two virtual ones)
SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", INTERLEAVED_ZERO_BUBBLE, ZBV)


def _check_sizes(name: str, num_groups: int, virtual_stages: int, num_microbatches: int) -> None:
    if num_groups < 1 or num_microbatches < 1 or virtual_stages < 2:
        raise ScheduleError(f"schedule {name!r} needs >= 1 device group, >= 2 chunks per group and >= 1 "
                            f"micro-batch; got G={num_groups}, v={virtual_stages}, M={num_microbatches} (one "
                            "chunk per group: use 'early_backward' or 'zero_bubble')")
    if name != ZBV and num_microbatches < num_groups:
        raise ScheduleError(f"schedule {name!r} runs micro-batches in groups of G={num_groups} (Megatron's "
                            f"microbatch_group_size_per_vp_stage); M={num_microbatches} is fewer: use at least "
                            f"{num_groups} micro-batches or 'zbv'")


def microbatch_groups(num_groups: int, num_microbatches: int) -> list[tuple[int, int]]:
    """``[first, stop)`` of each group of micro-batches the chunks take in turn: G each, the last one G to 2G - 1.

    Megatron's ``microbatch_group_size_per_vp_stage`` (G by default) with the remainder joining the last group,
    so M need not be a multiple of G; a group shorter than G would deadlock (a chunk's next forward would wait
    for the loop around the groups to come back).
    """
    starts = list(range(0, num_microbatches - num_groups + 1, num_groups)) or [0]
    return list(zip(starts, [*starts[1:], num_microbatches], strict=True))


def forward_order(num_groups: int, virtual_stages: int, num_microbatches: int) -> list[tuple[int, int]]:
    """``(micro-batch, local chunk)`` of every forward a group runs, in order (Megatron's schedule table):
    the first local chunk runs a micro-batch group, then the next chunk the same group, and so on; then the
    next group. Backward runs the same table with the local chunks reversed."""
    return [(m, local) for first, stop in microbatch_groups(num_groups, num_microbatches)
            for local in range(virtual_stages) for m in range(first, stop)]


def _looped_1f1b(num_groups: int, virtual_stages: int, num_microbatches: int, group: int,
                 hops_ahead: int) -> list[Action]:
    """Group ``group``'s forwards and backwards in 1F1B order on a loop of chunks (chunk ``local * G + group``).

    Before the k-th backward the group has run k + 1 + ``hops_ahead`` + (v - 1) x (size of that backward's
    micro-batch group) forwards (all of them at most): Megatron's warm-up of 2 (G - 1 - g) + (v - 1) G
    forwards, then one forward and one backward at a time, then the drain; a larger last micro-batch group
    runs its extra forwards where it starts.
    """
    last, total = virtual_stages - 1, virtual_stages * num_microbatches
    order = forward_order(num_groups, virtual_stages, num_microbatches)
    size_of = {m: stop - first for first, stop in microbatch_groups(num_groups, num_microbatches)
               for m in range(first, stop)}
    actions: list[Action] = []
    next_forward = 0
    for k, (m, local) in enumerate(order):
        needed = min(total, k + 1 + hops_ahead + last * size_of[m])
        for forward_m, forward_local in order[next_forward:needed]:
            actions.append(Action(Op.FORWARD, forward_m, forward_local * num_groups + group))
        next_forward = max(next_forward, needed)
        actions.append(Action(Op.BACKWARD, m, (last - local) * num_groups + group))
    return actions


def interleaved_1f1b(num_groups: int, virtual_stages: int, num_microbatches: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): each group runs v chunks laid out as a loop.

    Group g runs 2 (G - 1 - g) + (v - 1) G warm-up forwards (capped at v M), then alternates one forward
    and one backward, then drains the backwards. The bubble is (G - 1) / (v M) of the ideal time on
    uniform chunks with free communication, v times less than 1F1B's.
    """
    _check_sizes(INTERLEAVED, num_groups, virtual_stages, num_microbatches)
    per_group = tuple(tuple(_looped_1f1b(num_groups, virtual_stages, num_microbatches, group,
                                         2 * (num_groups - 1 - group))) for group in range(num_groups))
    return Schedule(INTERLEAVED, num_groups, num_microbatches, per_group, loop_chunk_groups(num_groups, virtual_stages))


def interleaved_zero_bubble(num_groups: int, virtual_stages: int, num_microbatches: int) -> Schedule:
    """torch's ScheduleInterleavedZeroBubble (ZB-1P on a loop of chunks), on Megatron's micro-batch groups.

    Group g runs (G - 1 - g) + (v - 1) G warm-up forwards, then per step one forward (while any is left) and
    one B (input gradients, which the previous chunk waits for); from its (g+1)-th B on, each B is followed by
    the oldest deferred W (parameter gradients), so the later groups fill their drain with W's.
    """
    _check_sizes(INTERLEAVED_ZERO_BUBBLE, num_groups, virtual_stages, num_microbatches)
    per_group = []
    for group in range(num_groups):
        actions: list[Action] = []
        deferred: deque[Action] = deque()
        num_backwards = 0
        for action in _looped_1f1b(num_groups, virtual_stages, num_microbatches, group, num_groups - 1 - group):
            actions.append(action)
            if action.op is Op.BACKWARD:
                deferred.append(action)
                num_backwards += 1
                if num_backwards > group:
                    actions.append(_weight_of(deferred.popleft()))
        actions += [_weight_of(action) for action in deferred]
        per_group.append(tuple(actions))
    return Schedule(INTERLEAVED_ZERO_BUBBLE, num_groups, num_microbatches, tuple(per_group),
                    loop_chunk_groups(num_groups, virtual_stages))


def _weight_of(backward: Action) -> Action:
    return Action(Op.WEIGHT, backward.microbatch_index, backward.chunk_index)


def zbv(num_groups: int, virtual_stages: int, num_microbatches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6; torch's ScheduleZBVZeroBubble): two chunks per group in a V.

    Group g holds chunk g (on the way down) and chunk 2G-1-g (on the way up); the last group hands chunk G-1
    to chunk G locally. Warm-up: 2 (G - g) - 1 forwards of the first chunk, then g pairs of forwards, then
    G - g rounds of (F, B, W) on the second chunk; steady state F B W on each chunk; cool-down B's with
    deferred W's. Built for max(M, 2G - 1) micro-batches and cut to M, as torch does.
    """
    if virtual_stages != 2:
        raise ScheduleError(f"schedule {ZBV!r} runs exactly 2 chunks per group (a V); got virtual_stages="
                            f"{virtual_stages}: use 2, or 'interleaved' for other counts")
    _check_sizes(ZBV, num_groups, virtual_stages, num_microbatches)
    per_group = tuple(tuple(a for a in _zbv_group(num_groups, num_microbatches, group) if
                            a.microbatch_index < num_microbatches) for group in range(num_groups))
    return Schedule(ZBV, num_groups, num_microbatches, per_group, v_chunk_groups(num_groups))


def _zbv_group(num_groups: int, num_microbatches: int, group: int) -> list[Action]:
    """One group's ZB-V list over max(M, 2G - 1) micro-batches (the ones past M are cut by the caller)."""
    count = max(2 * num_groups - 1, num_microbatches)
    down, up = group, 2 * num_groups - 1 - group
    next_f = {down: 0, up: 0}
    next_b = {down: 0, up: 0}
    actions: list[Action] = []

    def run(op: Op, chunk: int) -> None:
        counter = next_f if op is Op.FORWARD else next_b
        actions.append(Action(op, counter[chunk], chunk))
        if op is Op.BACKWARD:
            actions.append(Action(Op.WEIGHT, counter[chunk], chunk))
        counter[chunk] += 1

    for _ in range(2 * (num_groups - group) - 1):
        run(Op.FORWARD, down)
    for _ in range(group):
        run(Op.FORWARD, up)
        run(Op.FORWARD, down)
    for _ in range(num_groups - group):
        run(Op.FORWARD, up)
        run(Op.BACKWARD, up)
    while next_f[up] < next_f[down] or next_f[down] < count:
        if next_f[down] < count:
            run(Op.FORWARD, down)
        run(Op.BACKWARD, down)
        run(Op.FORWARD, up)
        run(Op.BACKWARD, up)
    return actions + _zbv_cooldown(next_b[down], next_b[up], count, down, up, group, num_groups)


def _zbv_cooldown(done_down: int, done_up: int, count: int, down: int, up: int, group: int,
                  num_groups: int) -> list[Action]:
    """The drain: g pairs of B's (down, up), then G - g rounds of (B, W) on the down chunk, then every W left."""
    actions: list[Action] = []
    weights = {down: done_down, up: done_up}
    b_down, b_up = done_down, done_up
    for _ in range(group):
        actions += [Action(Op.BACKWARD, b_down, down), Action(Op.BACKWARD, b_up, up)]
        b_down, b_up = b_down + 1, b_up + 1
    for _ in range(num_groups - group):
        actions += [Action(Op.BACKWARD, b_down, down), Action(Op.WEIGHT, weights[down], down)]
        b_down, weights[down] = b_down + 1, weights[down] + 1
    actions += [Action(Op.WEIGHT, m, up) for m in range(weights[up], b_up)]
    actions += [Action(Op.WEIGHT, m, down) for m in range(weights[down], b_down)]
    assert b_down == b_up == count, (b_down, b_up, count)
    return actions
