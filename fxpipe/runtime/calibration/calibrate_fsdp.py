"""FSDP2's own host time per collective: units run sharded and whole, less each unit's own bare collectives.

Each FSDP2 unit of a ZeRO-3 step all-gathers its weights before its forward and again before its backward and
reduce-scatters its gradients after it; under ZeRO-2 (weights kept gathered) it only reduce-scatters. Around each
call FSDP2 copies into and out of flat buffers, allocates and frees them and runs its hooks in Python: on CPU
ranks milliseconds per call, growing with the unit's bytes and with its parameter tensors (its hooks and copies
work tensor by tensor). Both ranks (call on both; ``group`` holds just them) time the forward and backward of
``FSDP_UNITS`` units shaped like a transformer block (:class:`BlockUnit`: 12 parameter tensors) of each width in
``FSDP_WIDTHS``: whole; each ``fully_shard``-ed keeping its weights gathered (ZeRO-2: one reduce-scatter per unit);
resharding after forward (ZeRO-3: two all-gathers and a reduce-scatter per unit); kept gathered with gradient sync
off (ZeRO-1's micro-batches before the last: no collective, FSDP2's hooks and unsynced accumulation only); and each
unit's bare all-gather and reduce-scatter of its bytes as FSDP2 calls them. :func:`per_call_excess` gives each
kind's host time per call at that unit size (and the pass's per unit), :func:`two_size_fit` a per-call and a
per-byte figure through the two sizes
(:class:`fxpipe.core.fsdp_calls.FsdpCallCost`), which :func:`fxpipe.sim.sharding_cost.unit_collectives` charges
per unit by its bytes. Medians of ``FSDP_REPEATS`` interleaved rounds, averaged over the two ranks.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.core.fsdp_calls import FIGURE_KEYS
from fxpipe.runtime.transport.comm import all_gather_flat, reduce_scatter_flat

# Two unit sizes (a BlockUnit of width w holds 4 w^2 + 8 w floats): 17.4 KB, and 2.37 MB near gpt-mini's blocks
# (2.6 MB per unit in benchmarks/sharding_fidelity.py), so such units are charged by interpolation: with 1.05 MB
# units the slope's noise under load was extrapolated 2.5x (benchmarks/sharding_fidelity.md, 16:33). 15 rounds: six
# calibrations in a row on the quiet 2-core VM put gpt-mini's ZeRO-2 collectives (5 all-gathers, 20 reduce-scatters)
# at 69-134 ms with 5 rounds, 85-130 ms with 15 (2026-12-04, scratch; about 2 s more per calibration).
FSDP_UNITS, FSDP_WIDTHS, FSDP_ROWS, FSDP_REPEATS = 4, (32, 384), 8, 15
# per unit and step under reshard-after-forward: an all-gather in forward, one in backward, a reduce-scatter
CALLS_PER_UNIT = 3


def per_call_excess(whole_s: float, zero2_s: float, zero3_s: float, all_gather_s: float, reduce_scatter_s: float,
                    num_units: int) -> tuple[float, float]:
    """(all-gather, reduce-scatter) host seconds per call beyond the bare collective, each >= 0, from one forward
    and backward of ``num_units`` units: whole, ZeRO-2 (one reduce-scatter per unit) and ZeRO-3 (two all-gathers
    and one reduce-scatter per unit), with one bare all-gather and reduce-scatter of a unit's bytes.

        rs = (zero2 - whole - n RS) / n
        ag = ((zero3 - whole - n (2 AG + RS)) / n - rs) / 2"""
    if num_units < 1:
        raise ValueError(f"the sharded runs need at least one FSDP unit; got {num_units}")
    scatter = max(0.0, (zero2_s - whole_s) / num_units - reduce_scatter_s)
    gather = max(0.0, ((zero3_s - whole_s) / num_units - 2 * all_gather_s - reduce_scatter_s - scatter) / 2)
    return gather, scatter


def two_size_fit(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """``(seconds per call, seconds per byte)`` of the line through ``(bytes, seconds)`` at two unit sizes, each
    >= 0: a slope below 0 (the larger unit timed cheaper, noise) is 0 and the per-call part their mean; an
    intercept below 0 is 0 and the slope goes through the larger point."""
    (small_bytes, small_s), (large_bytes, large_s) = small, large
    if not 0 <= small_bytes < large_bytes:
        raise ValueError(f"two_size_fit needs 0 <= small bytes < large bytes; got {small_bytes} and {large_bytes}")
    per_byte = (large_s - small_s) / (large_bytes - small_bytes)
    if per_byte <= 0:
        return (small_s + large_s) / 2, 0.0
    call = small_s - per_byte * small_bytes
    return (call, per_byte) if call >= 0 else (0.0, large_s / large_bytes)


def interleaved_medians(calls: Sequence[Callable[[], object]], group: dist.ProcessGroup | None) -> list[float]:
    """Median seconds of each of ``calls``, timed in turn round after round (each after a barrier), so that every
    call sees the same moments of a shared host's load; the first two rounds are not counted (they allocate
    FSDP2's buffers, and ZeRO-2 gathers its weights once)."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(FSDP_REPEATS + 2):
        for call, timed in zip(calls, times, strict=True):
            dist.barrier(group=group)
            start = time.perf_counter()
            call()
            timed.append(time.perf_counter() - start)
    return [statistics.median(timed[2:]) for timed in times]


class BlockUnit(torch.nn.Module):
    """A unit with a transformer block's parameter tensors: GPT-2's 12 (two layer norms, four linears with biases;
    a Llama block has 9). FSDP2's hooks and copies work tensor by tensor, so its host time per call grows with the
    tensors as well as the bytes: beside its reduce-scatter, units of 12 tensors took 0.2-0.3 ms more per call than
    single linears of the same bytes (2 tensors; two scratch runs on gloo ranks of the 2-core VM, 2026-12-04), and
    calibrated on single linears the model under-charged gpt-mini's ZeRO-2 step (benchmarks/sharding_fidelity.md).
    Two residual two-layer MLPs, each behind a layer norm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.up_1, self.down_1 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.up_2, self.down_2 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down_1(torch.relu(self.up_1(self.norm_1(x))))
        return x + self.down_2(torch.relu(self.up_2(self.norm_2(x))))


def block_units(width: int) -> torch.nn.Sequential:
    """FSDP_UNITS :class:`BlockUnit` of ``width``, the same weights each call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(BlockUnit(width) for _ in range(FSDP_UNITS)))


def _sharded(width: int, mesh: Any, reshard_after_forward: bool) -> torch.nn.Module:
    """FSDP_UNITS block units, each its own FSDP unit with the runtime's prefetch, under a parameter-free root."""
    from torch.distributed.fsdp import fully_shard

    model = block_units(width)
    units: list[Any] = [fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward) for layer in model]
    for before, after in zip(units, units[1:], strict=False):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    root: Any = fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if not reshard_after_forward:  # ZeRO-2: keep the gathered weights across steps, reduce-scatter each backward
        root.set_reshard_after_backward(False)
    return model


def _unsynced(width: int, mesh: Any) -> torch.nn.Module:
    """ZeRO-1's micro-batches before the step's last, as the runtime sets them
    (:meth:`fxpipe.runtime.parallel.sharded_stage.ShardedStage.before_backward`): weights kept gathered, gradients
    accumulated without a reduce-scatter, not the step's last backward."""
    model: Any = _sharded(width, mesh, False)
    model.set_is_last_backward(False)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    return model


def _unit_excess(width: int, mesh: Any, group: dist.ProcessGroup | None) -> tuple[float, float, float, float]:
    """(unit bytes, all-gather s, reduce-scatter s, pass s) of host time per call (per unit for the pass) on units
    of ``width``."""
    whole = block_units(width)
    zero2, zero3, unsynced = _sharded(width, mesh, False), _sharded(width, mesh, True), _unsynced(width, mesh)
    inputs = torch.randn(FSDP_ROWS, width)
    unit_numel = sum(param.numel() for param in whole[0].parameters())
    num_ranks = dist.get_world_size(group)
    shard = torch.zeros(-(-unit_numel // num_ranks))
    flat = torch.zeros(shard.numel() * num_ranks)

    def bare(name: str) -> None:
        for _ in range(FSDP_UNITS):
            if name == "all_gather":
                all_gather_flat(flat, shard, group=group)
            else:
                reduce_scatter_flat(shard, flat, group=group)

    def step(model: torch.nn.Module) -> Callable[[], None]:
        return lambda: model(inputs).sum().backward()

    times = interleaved_medians((step(whole), step(zero2), step(zero3), step(unsynced), partial(bare, "all_gather"),
                                 partial(bare, "reduce_scatter")), group)
    whole_s, zero2_s, zero3_s, unsynced_s, gathers_s, scatters_s = times
    gather, scatter = per_call_excess(whole_s, zero2_s, zero3_s, gathers_s / FSDP_UNITS, scatters_s / FSDP_UNITS,
                                      FSDP_UNITS)
    return float(unit_numel * 4), gather, scatter, max(0.0, (unsynced_s - whole_s) / FSDP_UNITS)


def measure_fsdp_overhead(device: torch.device, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """FSDP2's host time per call on this pair of ranks: ``fsdp_call_overhead`` (the mean of a ZeRO-3 unit's three
    calls at the smaller size, the flat figure of caches written before the fit) and :data:`FIGURE_KEYS` (each
    kind's per-call and per-byte fit); 0 off CPU: FSDP2's copies run on the GPU's streams, beside its Python."""
    if device.type != "cpu":
        return {"fsdp_call_overhead": 0.0, **dict.fromkeys(FIGURE_KEYS, 0.0)}
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(group if group is not None else dist.distributed_c10d._get_default_group(), "cpu")
    sizes = [_unit_excess(width, mesh, group) for width in FSDP_WIDTHS]
    mine = torch.tensor([value for _, *figures in sizes for value in figures], dtype=torch.float64)
    dist.all_reduce(mine, group=group)  # the two ranks' mean: the model charges one figure on both
    means = [float(value) / dist.get_world_size(group) for value in mine]
    small_gather, small_scatter, small_pass, large_gather, large_scatter, large_pass = means
    (small_bytes, *_), (large_bytes, *_) = sizes
    gather_fit = two_size_fit((small_bytes, small_gather), (large_bytes, large_gather))
    scatter_fit = two_size_fit((small_bytes, small_scatter), (large_bytes, large_scatter))
    pass_fit = two_size_fit((small_bytes, small_pass), (large_bytes, large_pass))
    return {"fsdp_call_overhead": (2 * small_gather + small_scatter) / CALLS_PER_UNIT,
            **dict(zip(FIGURE_KEYS, (*gather_fit, *scatter_fit, *pass_fit), strict=True))}
