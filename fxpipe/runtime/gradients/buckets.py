"""Gradient allreduce in buckets launched while the step's last backward is still producing gradients (as DDP)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from fxpipe.runtime.transport.comm import allreduce_async

Reduction = tuple[dist.Work, torch.Tensor, list[torch.Tensor]]  # (work, flat buffer, gradients to fill)


def make_buckets(params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Parameters in reverse order (backward makes later layers' gradients first), cut into buckets.

    A bucket closes once it holds ``bucket_bytes`` or before a parameter of another dtype (one flat
    buffer per bucket). Every replica of a stage holds the same parameters in the same order, so
    they make the same buckets.
    """
    buckets: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    filled = 0
    for param in reversed(params):
        if current and current[-1].dtype != param.dtype:
            buckets.append(current)
            current, filled = [], 0
        current.append(param)
        filled += param.numel() * param.element_size()
        if filled >= bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


class OverlappedAllreduce:
    """SUM allreduce of ``params``' gradients over ``group``, bucket by bucket, during the armed backward.

    :meth:`arm` before the step's last backward on this rank: a post-accumulate-grad hook counts
    each parameter's final gradient (split backward's W, which writes ``.grad`` itself, calls
    :meth:`gradient_ready`), and full buckets are launched in bucket order (the same order on every
    replica, as collectives on one group must be). :meth:`launch_rest` launches what the
    backward did not complete (parameters without a gradient contribute zeros) and returns every
    reduction to wait for before the optimizer step.
    """

    def __init__(self, group: dist.ProcessGroup, params: Sequence[torch.nn.Parameter], bucket_bytes: int) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.group = group
        self.buckets = make_buckets(params, bucket_bytes)
        self._bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket}
        self._missing = [0] * len(self.buckets)
        self._next = len(self.buckets)  # nothing to launch until armed
        self._armed = False
        self._launched: list[Reduction] = []
        self._times: list[float] = []  # perf_counter: arm, then each launch in the armed backward
        self.launch_fractions: tuple[float, ...] = ()  # of the last armed backward (see backward_done)
        self._counted: set[int] = set()  # parameters counted in the armed pass
        self._hooks = [param.register_post_accumulate_grad_hook(self.gradient_ready) for param in params]

    def arm(self, ready: Sequence[torch.nn.Parameter] = ()) -> None:
        """Count final gradients from now on; ``ready`` already hold theirs (under split backward, what B
        produced before the last W), so full buckets of them launch at once."""
        self._missing = [len(bucket) for bucket in self.buckets]
        self._next = 0
        self._launched = []
        self._armed = True
        self._counted = set()
        self._times = [time.perf_counter()]
        for param in ready:
            self.gradient_ready(param)

    def backward_done(self) -> None:
        """End of the armed backward: :attr:`launch_fractions` becomes each bucket launched during it as
        (launch - backward start) / backward duration (what :mod:`fxpipe.sim.allreduce_overlap` predicts)."""
        now = time.perf_counter()
        start = self._times[0]
        self.launch_fractions = tuple((t - start) / (now - start) for t in self._times[1:])

    def gradient_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is final for this step (a hook fired, or split backward's W wrote it): launch
        every bucket that is now full, in order. A parameter counts once per armed pass; others are ignored."""
        if not self._armed or id(param) in self._counted or id(param) not in self._bucket_of:
            return
        self._counted.add(id(param))
        self._missing[self._bucket_of[id(param)]] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] <= 0:
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        gradients = []
        for param in self.buckets[index]:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            gradients.append(param.grad)
        if self._armed:
            self._times.append(time.perf_counter())
        work, flat = allreduce_async(gradients, self.group)
        self._launched.append((work, flat, gradients))
        self._next = index + 1

    def launch_rest(self) -> list[Reduction]:
        """Launch the buckets not launched yet, in order; every reduction of this step, to wait for."""
        if not self._armed:  # no backward ran on this rank (cannot happen with a valid schedule)
            self.arm()
        while self._next < len(self.buckets):
            self._launch(self._next)
        self._armed = False
        launched, self._launched = self._launched, []
        return launched

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def split_overlapped(reduce_sets: Sequence[tuple[dist.ProcessGroup, list[torch.nn.Parameter]]],
                     replica_group: dist.ProcessGroup | None, bucket_bytes: int,
                     ) -> tuple[OverlappedAllreduce | None, list[tuple[dist.ProcessGroup, list[torch.nn.Parameter]]]]:
    """The stage's own replica allreduce as :class:`OverlappedAllreduce` (``bucket_bytes > 0``), and the
    sets still reduced after backward (tied parameters: their groups span several stages)."""
    if bucket_bytes <= 0 or replica_group is None:
        return None, list(reduce_sets)
    overlapped = None
    rest = []
    for group, params in reduce_sets:
        if group is replica_group and overlapped is None:
            overlapped = OverlappedAllreduce(group, params, bucket_bytes)
        else:
            rest.append((group, params))
    return overlapped, rest
