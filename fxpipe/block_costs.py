"""Block costs measured by every rank of a job at once and agreed as their median: compile's default planner figures."""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from fxpipe.passes.profile import MeasuredCosts, device_of, fit_times, measure_costs, synchronizer

if TYPE_CHECKING:
    from fxpipe.runtime.faults.guard import SetupGroup

# A few rounds suffice: the median over ranks steadies what each rank's median of REPEATS leaves.
WARMUP = 1
REPEATS = 3
# Parameter bytes an optimizer step is timed on at most (the first parameters' copies; the rest scale).
OPTIMIZER_SAMPLE_BYTES = 64 * 2**20
# Bytes written before each timed optimizer step, more than a last-level cache holds (32 MiB on this
# project's CPU, 50-60 MiB of L2 on recent GPUs): in training the step follows a backward that has
# pushed the parameters, gradients and optimizer state out of the caches. Timed hot, an AdamW step of
# vgg-19's 1.2 MiB of parameters took 1.5 ms against 2.5-2.6 ms cold and in training.
CACHE_FLUSH_BYTES = 128 * 2**20
# One rank's figures: its stretch (wall seconds per CPU second while every rank measured), its AdamW
# step's seconds of work per parameter byte and, per block, forward and backward seconds of work at the
# two measured batch sizes (forward low, forward high, backward low, backward high).
Figures = tuple[float, float, list[tuple[float, float, float, float]]]


def measure_block_costs(graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any], *, slowdown: float,
                        group: SetupGroup = None, autocast_dtype: torch.dtype | None = None) -> MeasuredCosts | None:
    """Every rank times every block (``measure_costs``) at the same moment; all ranks get the per-block median.

    A collective over ``group``: call it on every rank alike. On CPU ranks each block is timed in
    CPU seconds of this process (its work, however the OS shares the cores), and the whole
    measuring session gives the rank's stretch: wall seconds per CPU second while every rank (and
    whatever else runs on the host) computes at once, as in training. A block's time is the median
    work times the median stretch, divided by ``slowdown`` (:attr:`Cluster.compute_slowdown`), the
    stretch the simulator puts back on compute. Short blocks timed on the wall clock would miss the
    sharing: a few-millisecond run mostly fits in one scheduler time slice, while a training step
    gets the same share of the core as everything else. On a GPU, blocks are timed on the wall
    clock (kernels, synchronised) and the stretch is 1. The random number generators are left as
    they were (dropout draws while measuring do not shift training's). If measuring fails on any
    rank, every rank warns and returns None (the caller plans with the analytic model), never a hang.
    """
    from fxpipe.runtime.calibration.measure_together import measured_together

    if slowdown < 1:
        raise ValueError(f"slowdown must be >= 1 (ranks per core, at least 1); got {slowdown}")
    local: list[MeasuredCosts | None] = [None]

    def measure() -> Figures | str:
        local[0], stretch, failure = _measure_here(graph_module, example_inputs, autocast_dtype)
        if local[0] is None:
            return failure or "no figures"
        return (stretch, local[0].optimizer_s_per_param_byte, _block_times(local[0]))

    gathered = measured_together(measure, group)
    failures = [item for item in gathered if isinstance(item, str)]
    if local[0] is None or failures:
        reason = failures[0]
        warnings.warn(f"fxpipe: measuring block costs failed ({reason}); planning with the analytic device model "
                      "(costs='analytic' skips the attempt)", RuntimeWarning, stacklevel=2)
        return None
    return agreed_costs(local[0], [item for item in gathered if not isinstance(item, str)], slowdown)


def _measure_here(graph_module: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  autocast_dtype: torch.dtype | None) -> tuple[MeasuredCosts | None, float, str]:
    """(this rank's block times, its stretch, a failure message or "")."""
    cpu = device_of(graph_module, example_inputs).type == "cpu"
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    clock = time.process_time if cpu else time.perf_counter
    try:
        with torch.random.fork_rng(devices=_cuda_devices(graph_module, example_inputs)):
            local = measure_costs(graph_module, example_inputs, warmup=WARMUP, repeats=REPEATS, clock=clock,
                                  autocast_dtype=autocast_dtype)
        local = replace(local, optimizer_s_per_param_byte=optimizer_step_per_byte(graph_module, clock))
    except (RuntimeError, ValueError, TypeError) as error:  # a model measure_costs cannot run block by block
        return None, 1.0, f"{type(error).__name__}: {error}"
    cpu_s = time.process_time() - cpu_start
    stretch = (time.perf_counter() - wall_start) / cpu_s if cpu and cpu_s > 0 else 1.0
    return local, stretch, ""


def optimizer_step_per_byte(module: torch.nn.Module, clock: Any = time.perf_counter) -> float:
    """Seconds per parameter byte of an AdamW step (median of REPEATS after WARMUP) on copies of the
    module's trainable parameters (the first OPTIMIZER_SAMPLE_BYTES of them), with gradients; 0 without any.

    Each timed step starts with cold caches (CACHE_FLUSH_BYTES written first), as in training, where
    it follows a backward. The module's own parameters, gradients and optimizer state are untouched.
    On CUDA each timed step ends in a synchronize.
    """
    copies: list[torch.nn.Parameter] = []
    num_bytes = 0
    for parameter in module.parameters():
        if not parameter.requires_grad or num_bytes >= OPTIMIZER_SAMPLE_BYTES:
            continue
        copy = torch.nn.Parameter(torch.zeros_like(parameter))
        copy.grad = torch.full_like(parameter, 1e-3)
        copies.append(copy)
        num_bytes += parameter.numel() * parameter.element_size()
    if not copies:
        return 0.0
    optimizer = torch.optim.AdamW(copies, lr=1e-3)
    synchronize = synchronizer(copies[0].device)
    flush = torch.empty(CACHE_FLUSH_BYTES, dtype=torch.uint8, device=copies[0].device)
    samples = []
    for round_index in range(WARMUP + REPEATS):
        flush.fill_(round_index)
        synchronize()
        start = clock()
        optimizer.step()
        synchronize()
        samples.append(clock() - start)
    return statistics.median(samples[WARMUP:]) / num_bytes


def _cuda_devices(graph_module: torch.nn.Module, example_inputs: Sequence[Any]) -> list[torch.device]:
    device = device_of(graph_module, example_inputs)
    return [device] if device.type == "cuda" else []


def _block_times(costs: MeasuredCosts) -> list[tuple[float, float, float, float]]:
    low, high = costs.batch_sizes
    return [(block.forward_s.at(low), block.forward_s.at(high), block.backward_s.at(low), block.backward_s.at(high))
            for block in costs.blocks]


def agreed_costs(local: MeasuredCosts, figures: Sequence[Figures], slowdown: float) -> MeasuredCosts:
    """``local``'s blocks refitted through the median over ranks of each block's times at the two batch sizes,
    and the median optimizer step per byte, times the median stretch, divided by ``slowdown``.

    Pure: the same ``figures`` (every rank gathers the same list) give the same costs on every rank.
    """
    counts = {len(times) for _, _, times in figures}
    if counts != {len(local.blocks)}:
        raise AssertionError(f"ranks measured different block counts {sorted(counts)}; the traced graphs differ")
    stretch = statistics.median(stretch for stretch, _, _ in figures)
    scale = stretch / slowdown
    blocks = []
    for index, block in enumerate(local.blocks):
        medians = [statistics.median(times[index][field] for _, _, times in figures) * scale for field in range(4)]
        blocks.append(replace(block, forward_s=fit_times(local.batch_sizes, medians[0], medians[1]),
                              backward_s=fit_times(local.batch_sizes, medians[2], medians[3])))
    optimizer = statistics.median(per_byte for _, per_byte, _ in figures) * scale
    return replace(local, blocks=tuple(blocks), stretch=stretch, optimizer_s_per_param_byte=optimizer)
