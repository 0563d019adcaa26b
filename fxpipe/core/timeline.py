"""Timeline events of one iteration: the simulator predicts them, the runtime measures them (so the two overlay)."""

from __future__ import annotations

from typing import NamedTuple


class TimelineEvent(NamedTuple):
    """One executed action of one device (a send ends when it is issued; it takes the cluster's
    ``message_overhead_s`` per message, 0 by default)."""

    device: int
    stage_index: int
    op: str  # "F", "B", "W", "RA", "SA", "RG", "SG", "AR"
    microbatch_index: int  # -1 for AR
    start_s: float
    end_s: float


class TransferEvent(NamedTuple):
    """One piece of a send: ``src_device`` hands ``dst_device`` the rows they share, on the link."""

    src_device: int
    dst_device: int
    op: str  # "SA" (activation) or "SG" (gradient)
    microbatch_index: int
    start_s: float
    end_s: float
