"""Short timings of one device (compute, memory, op overhead), of the link between ranks 0 and 1 of a process
group, and of an allreduce over every rank of a job."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from fxpipe.core.fsdp_calls import FIGURE_KEYS
from fxpipe.runtime.calibration.calibrate_fixed import measure_fixed_costs
from fxpipe.runtime.calibration.calibrate_fsdp import measure_fsdp_overhead
from fxpipe.runtime.calibration.calibrate_lockstep import measure_lockstep
from fxpipe.runtime.calibration.calibrate_overlap import measure_overlap
from fxpipe.runtime.calibration.ring_fit import ring_allreduce_fit, ring_fit
from fxpipe.runtime.transport.comm import all_gather_flat, reduce_scatter_flat

# Bytes for the bandwidth ping: big enough that latency is small next to it, small enough to be quick.
PING_LARGE_BYTES = 8 * 2**20
PING_SMALL_BYTES = 8
PING_REPEATS = 20
# A job's own allreduce over all its ranks (measure_job_collective): the step-end sync's size and a
# gradient bucket's order of size, timed in JOB_ROUNDS alternating rounds of JOB_REPEATS calls.
JOB_SMALL_BYTES, JOB_LARGE_BYTES, JOB_ROUNDS, JOB_REPEATS = 7 * 8, 4 * 2**20, 3, 5
# A message as a pipeline cut sends it: two activations of 4 x 64 x 128 float32, packed into one buffer.
MESSAGE_PIECES = ((4, 64, 128), (4, 64, 128))
# Compute run between timed messages: a step posts its transfers between forwards and backwards, whose
# work evicts the caches the transport's code and data need (posting took 2-4x longer after compute here).
MESSAGE_GAP_MATMULS = 10
# Matmul side for timing a GPU: large enough to reach the tensor cores' rate, ~0.1 ms per call on an H100.
GPU_MATMUL_SIZE = 4096

# The reference stage for split backward's overhead: transformer-like blocks (layer norm, a 3x and a 4x
# projection, GELU) over 256 rows of width 128, as a gpt-mini stage sees a 4 x 64-token micro-batch.
SPLIT_REFERENCE_ROWS, SPLIT_REFERENCE_WIDTH, SPLIT_REFERENCE_BLOCKS, SPLIT_REPEATS = 256, 128, 2, 20

# A cache without a key (written before it was measured) is measured again (fxpipe.runtime.calibration.calibrate.read_cache).
DEVICE_KEYS = ("float32", "bfloat16", "float16", "memory_bandwidth", "kernel_launch", "split_backward_overhead",
               "action_overhead", "step_overhead")
LINK_KEYS = ("link_latency", "link_bandwidth", "allreduce_latency", "allreduce_bandwidth", "message_overhead",
             "overlap_compute_slowdown", "overlap_comm_slowdown", "reduce_scatter_latency", "reduce_scatter_bandwidth",
             "all_gather_latency", "all_gather_bandwidth", "lockstep_latency", "lockstep_bandwidth",
             "fsdp_call_overhead", *FIGURE_KEYS)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for ``device``'s queued work (CUDA), or does nothing (CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _rate(work: Callable[[], object], seconds: float, sync: Callable[[], None] = lambda: None,
          clock: Callable[[], float] = time.perf_counter) -> tuple[int, float]:
    """Run ``work`` repeatedly for about ``seconds`` of ``clock`` (waiting for the device each time); return
    (calls, elapsed seconds of ``clock``)."""
    work()  # warm-up: first-call allocation and dispatch caches
    sync()
    calls, start = 0, clock()
    while True:
        work()
        sync()
        calls += 1
        elapsed = clock() - start
        if elapsed >= seconds:
            return calls, elapsed


def peak_clock(device: torch.device) -> Callable[[], float]:
    """The clock a device's peak rates are timed on: on CPU this process's CPU seconds, so that other processes
    sharing the core do not lower the figure (a rate timed on the wall clock while a test suite ran cached a CPU's
    float32 peak 10x low, and the demo then showed MFU above 100%); on a GPU the wall clock (kernels, synchronised)."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def measure_matmul_flops(dtype: torch.dtype, size: int = 256, seconds: float = 0.1,
                         device: torch.device | None = None) -> float:
    """FLOP/s of a ``size`` x ``size`` matmul (2 size^3 FLOPs per call) on ``device`` (default: CPU), timed on
    :func:`peak_clock`."""
    device = device or torch.device("cpu")
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    calls, elapsed = _rate(lambda: torch.mm(a, b), seconds, synchronizer(device), peak_clock(device))
    return 2.0 * size**3 * calls / elapsed


def measure_memory_bandwidth(num_bytes: int = 32 * 2**20, seconds: float = 0.1,
                             device: torch.device | None = None) -> float:
    """Bytes/s of copying a buffer on ``device`` (a copy reads and writes: 2 x bytes moved), timed on
    :func:`peak_clock`."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    calls, elapsed = _rate(lambda: dst.copy_(src), seconds, synchronizer(src.device), peak_clock(src.device))
    return 2.0 * num_bytes * calls / elapsed


def measure_op_overhead(seconds: float = 0.05, device: torch.device | None = None) -> float:
    """Seconds of one tiny eager op (dispatch overhead, the CPU's 'kernel launch'; queued launches on a GPU)."""
    x = torch.ones(4, device=device)
    calls, elapsed = _rate(lambda: torch.add(x, x), seconds)
    synchronizer(x.device)()
    return elapsed / calls


def _reference_stage(device: torch.device) -> torch.nn.Module:
    width = SPLIT_REFERENCE_WIDTH
    layers: list[torch.nn.Module] = []
    for _ in range(SPLIT_REFERENCE_BLOCKS):
        layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 3 * width), torch.nn.Linear(3 * width, width),
                   torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                   torch.nn.Linear(4 * width, width)]
    return torch.nn.Sequential(*layers).to(device)


def measure_split_backward_overhead(device: torch.device | None = None, repeats: int = SPLIT_REPEATS) -> float:
    """(B + W) / fused backward - 1 (at least 0) of a reference stage, with the runtime's split backward.

    Fused and split backwards alternate, each after a fresh forward (not timed) and accumulating into
    ``.grad`` as a step's micro-batches do; the ratio of their medians is what :attr:`fxpipe.core.cluster.Cluster.split_backward_overhead` holds.
    """
    from fxpipe.runtime.autograd.split_backward import (  # the runtime's own B and W
        backward_inputs,
        backward_weights,
    )

    device = device or torch.device("cpu")
    stage, sync = _reference_stage(device), synchronizer(device)
    params = list(stage.parameters())
    rows = torch.randn(SPLIT_REFERENCE_ROWS, SPLIT_REFERENCE_WIDTH, device=device)

    def fused(leaf: torch.Tensor, output: torch.Tensor) -> None:
        torch.autograd.backward([output], [torch.ones_like(output)])

    def split(leaf: torch.Tensor, output: torch.Tensor) -> None:
        _, work = backward_inputs([output], [torch.ones_like(output)], [leaf], params)
        backward_weights(work)

    times: dict[str, list[float]] = {"fused": [], "split": []}
    for index in range(repeats + 2):  # two warm-up rounds
        for name, backward in (("fused", fused), ("split", split)):
            leaf = rows.detach().requires_grad_(True)
            output = stage(leaf)
            sync()
            start = time.perf_counter()
            backward(leaf, output)
            sync()
            if index >= 2:
                times[name].append(time.perf_counter() - start)
    return max(0.0, statistics.median(times["split"]) / statistics.median(times["fused"]) - 1.0)


def measure_device(device: torch.device | None = None) -> dict[str, float]:
    """Compute (FLOP/s per dtype), memory bandwidth, op overhead and the runtime's fixed costs per action and
    per step (:func:`measure_fixed_costs`): one CPU thread, or one GPU."""
    device = device or torch.device("cpu")
    if device.type == "cuda":
        return {
            "float32": measure_matmul_flops(torch.float32, GPU_MATMUL_SIZE, device=device),
            "bfloat16": measure_matmul_flops(torch.bfloat16, GPU_MATMUL_SIZE, device=device),
            "float16": measure_matmul_flops(torch.float16, GPU_MATMUL_SIZE, device=device),
            "memory_bandwidth": measure_memory_bandwidth(256 * 2**20, device=device),
            "kernel_launch": measure_op_overhead(device=device),
            "split_backward_overhead": measure_split_backward_overhead(device),
            **measure_fixed_costs(device),
        }
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank = one thread, as the local cluster runs them
    try:
        return {
            "float32": measure_matmul_flops(torch.float32),
            "bfloat16": measure_matmul_flops(torch.bfloat16, size=128),
            "float16": measure_matmul_flops(torch.float16, size=128),
            "memory_bandwidth": measure_memory_bandwidth(),
            "kernel_launch": measure_op_overhead(),
            "split_backward_overhead": measure_split_backward_overhead(),
            **measure_fixed_costs(),
        }
    finally:
        torch.set_num_threads(previous)


def _round_trip_s(rank: int, tensor: torch.Tensor, repeats: int) -> list[float]:
    """Per-repeat round-trip times of ``tensor`` rank 0 -> 1 -> 0."""
    sync = synchronizer(tensor.device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, dst=1)
            dist.recv(tensor, src=1)
        else:
            dist.recv(tensor, src=0)
            dist.send(tensor, dst=0)
        sync()
        times.append(time.perf_counter() - start)
    return times


def _allreduce_s(tensor: torch.Tensor, repeats: int, group: dist.ProcessGroup | None) -> list[float]:
    """Per-repeat times of a SUM allreduce of ``tensor`` over ``group``'s ranks, each started together."""
    return _collective_s(lambda: dist.all_reduce(tensor, group=group), tensor.device, repeats, group)


def _collective_s(call: Callable[[], object], device: torch.device, repeats: int,
                  group: dist.ProcessGroup | None) -> list[float]:
    """Per-repeat times of a collective ``call`` over ``group``'s ranks, each started together."""
    sync = synchronizer(device)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return times


def sharding_collective_figures(device: torch.device, group: dist.ProcessGroup | None) -> dict[str, float]:
    """Latency and bandwidth of a reduce-scatter and of an all-gather over ``group``'s ranks, as FSDP2 calls
    them (``reduce_scatter_single``/``all_gather_single`` of one flat buffer; the all-gather's input is
    1/R of the output), fitted like the allreduce (:func:`ring_fit` with one pass: a ring reduce-scatter or
    all-gather is half a ring allreduce). A backend that runs either slower shows in these figures (gloo's
    reduce-scatter took longer than its allreduce of the same buffer here)."""
    num_ranks = dist.get_world_size(group)
    figures = {}
    for name in ("reduce_scatter", "all_gather"):
        medians = []
        for num_bytes, repeats in ((PING_SMALL_BYTES, PING_REPEATS), (PING_LARGE_BYTES, 5)):
            whole = torch.zeros(num_bytes // 4, dtype=torch.float32, device=device)
            shard = torch.zeros(whole.numel() // num_ranks, dtype=torch.float32, device=device)
            whole = whole[:shard.numel() * num_ranks]
            call = (partial(reduce_scatter_flat, shard, whole, group=group) if name == "reduce_scatter"
                    else partial(all_gather_flat, whole, shard, group=group))
            medians.append(statistics.median(_collective_s(call, device, repeats + 1, group)[1:]))
        figures[f"{name}_latency"], figures[f"{name}_bandwidth"] = ring_fit(
            num_ranks, (PING_SMALL_BYTES, medians[0]), (PING_LARGE_BYTES, medians[1]), passes=1)
    return figures


def _message_overhead_s(rank: int, repeats: int, group: dist.ProcessGroup | None) -> float:
    """Median seconds rank 0 takes to pack and post a send, or rank 1 to post a receive, right after compute.

    The runtime's own path (``pack``, ``batch_isend_irecv``), each message after a few matmuls, as in a
    step; the wait for the data is not counted (the link model has it).
    """
    from fxpipe.runtime.transport.comm import pack  # the runtime's packing, timed as it runs in a step

    pieces = [torch.randn(shape) for shape in MESSAGE_PIECES]
    inbox = torch.empty(pack(pieces).numel(), dtype=torch.uint8)
    square = torch.randn(256, 256)
    times = []
    for tag in range(repeats):
        dist.barrier(group=group)
        for _ in range(MESSAGE_GAP_MATMULS):
            torch.mm(square, square)
        start = time.perf_counter()
        op = (dist.P2POp(dist.isend, pack(pieces), 1, tag=tag) if rank == 0
              else dist.P2POp(dist.irecv, inbox, 0, tag=tag))
        works = dist.batch_isend_irecv([op])
        times.append(time.perf_counter() - start)
        for work in works:
            work.wait()
    return statistics.median(times)


def measure_pair_link(rank: int, device: torch.device, group: dist.ProcessGroup | None) -> dict[str, float]:
    """Link figures between global ranks 0 and 1 (call on both; ``group`` holds just those two).

    Latency (s) and bandwidth (B/s) of send/recv and of a two-rank allreduce (what
    :meth:`fxpipe.core.cluster.Cluster.allreduce_time`'s ring formula needs to give the measured times), and
    the seconds each end spends on a message of its own time (``message_overhead``; 0 on CUDA, where
    copy engines move the data), what overlapping an allreduce with compute costs on CPU ranks
    (:func:`fxpipe.runtime.calibration.calibrate_overlap.measure_overlap`), a two-rank allreduce as it runs between
    compute in lock-step (:func:`fxpipe.runtime.calibration.calibrate_lockstep.measure_lockstep`), and FSDP2's host time
    per collective (:func:`fxpipe.runtime.calibration.calibrate_fsdp.measure_fsdp_overhead`).
    """
    small = torch.zeros(PING_SMALL_BYTES // 4, dtype=torch.float32, device=device)
    large = torch.zeros(PING_LARGE_BYTES // 4, dtype=torch.float32, device=device)
    _round_trip_s(rank, large, 2)  # warm-up: connection setup and buffer allocation
    # Medians: what a pipeline's transfers typically see, waking a blocked receiver included (the
    # fastest repeat promised 73 us and 2.9 GB/s here where the medians were 150-190 us and 1.6-2.0 GB/s).
    small_rt = statistics.median(_round_trip_s(rank, small, PING_REPEATS))
    large_rt = statistics.median(_round_trip_s(rank, large, 5))
    small_ar = statistics.median(_allreduce_s(small, PING_REPEATS, group))
    large_ar = statistics.median(_allreduce_s(large, 5, group))
    overhead = 0.0
    if device.type == "cpu":
        # Each end's own time per message; the model charges one figure at both ends: their mean.
        mine = torch.tensor([_message_overhead_s(rank, PING_REPEATS, group)], dtype=torch.float64)
        dist.all_reduce(mine, group=group)
        overhead = float(mine.item()) / 2
    latency = small_rt / 2
    one_way = max(large_rt / 2 - latency, 1e-9)
    allreduce_latency, allreduce_bandwidth = ring_allreduce_fit(2, (PING_SMALL_BYTES, small_ar),
                                                                (PING_LARGE_BYTES, large_ar))
    return {"link_latency": latency, "link_bandwidth": PING_LARGE_BYTES / one_way,
            "allreduce_latency": allreduce_latency, "allreduce_bandwidth": allreduce_bandwidth,
            "message_overhead": overhead, **measure_overlap(device, group),
            **sharding_collective_figures(device, group), **measure_lockstep(device, group),
            **measure_fsdp_overhead(device, group)}


def measure_job_collective(device: torch.device, group: dist.ProcessGroup | None = None) -> tuple[float, float]:
    """``(latency s, bandwidth B/s)`` of a SUM allreduce over every rank of ``group`` (the training backend's
    default group when None), fitted by :func:`ring_allreduce_fit` to the mean over ranks of each rank's
    median time at JOB_SMALL_BYTES and JOB_LARGE_BYTES. A collective: call it on every rank alike.

    The calibrated figures come from two ranks; a job's own ranks can be slower per hop (4 gloo ranks
    sharing 2 cores: 2-7 ms for the step-end allreduce against 0.3-0.6 ms for 2 ranks). Small
    allreduces on this VM switch between a fast and a slow regime (0.4 or 2-4 ms on 2 ranks) for
    several calls at a time, so the two sizes alternate, JOB_ROUNDS rounds of JOB_REPEATS back-to-back
    calls each (as the step's allreduces follow each other), and the medians take every round.
    """
    small = torch.zeros(JOB_SMALL_BYTES // 4, dtype=torch.float32, device=device)
    large = torch.zeros(JOB_LARGE_BYTES // 4, dtype=torch.float32, device=device)
    sync = synchronizer(device)
    samples: tuple[list[float], list[float]] = ([], [])
    dist.barrier(group=group)
    for _ in range(JOB_ROUNDS):
        for tensor, times in zip((small, large), samples, strict=True):
            dist.all_reduce(tensor, group=group)  # warm-up: the previous size's buffers, the other regime
            sync()
            for _ in range(JOB_REPEATS):
                start = time.perf_counter()
                dist.all_reduce(tensor, group=group)
                sync()
                times.append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times) for times in samples], dtype=torch.float64, device=device)
    dist.all_reduce(medians, group=group)
    num_ranks = dist.get_world_size(group)
    small_s, large_s = (value / num_ranks for value in medians.tolist())
    return ring_allreduce_fit(num_ranks, (JOB_SMALL_BYTES, small_s), (JOB_LARGE_BYTES, large_s))
