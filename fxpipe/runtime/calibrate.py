"""Short measurements of this machine's CPU ranks (compute, memory, gloo link) for the ``local`` cluster, cached."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

CALIBRATION_VERSION = 4  # 2: link figures are medians, not the fastest ping; files carry their age. 3: allreduce.
# 4: per-message overhead
# A cached calibration older than this is measured again (the machine, its load or its neighbours change).
CALIBRATION_MAX_AGE_S = 7 * 24 * 3600.0
# Bytes for the bandwidth ping: big enough that latency is small next to it, small enough to be quick.
PING_LARGE_BYTES = 8 * 2**20
PING_SMALL_BYTES = 8
PING_REPEATS = 20
# A message as a pipeline cut sends it: two activations of 4 x 64 x 128 float32, packed into one buffer.
MESSAGE_PIECES = ((4, 64, 128), (4, 64, 128))
# Compute run between timed messages: a step posts its transfers between forwards and backwards, whose
# work evicts the caches the transport's code and data need (posting took 2-4x longer after compute here).
MESSAGE_GAP_MATMULS = 10


class CalibrationError(RuntimeError):
    """The local calibration could not run (the gloo ping failed or timed out)."""


def cache_path() -> Path:
    """``$FXPIPE_CACHE_DIR`` or ``~/.cache/fxpipe``, one file per hostname and torch version."""
    folder = Path(os.environ.get("FXPIPE_CACHE_DIR") or Path.home() / ".cache" / "fxpipe")
    safe_version = torch.__version__.replace("+", "_")
    return folder / f"calibration-{socket.gethostname()}-torch{safe_version}.json"


def _rate(work: Callable[[], object], seconds: float) -> tuple[int, float]:
    """Run ``work`` repeatedly for about ``seconds``; return (calls, elapsed)."""
    work()  # warm-up: first-call allocation and dispatch caches
    calls, start = 0, time.perf_counter()
    while True:
        work()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls, elapsed


def measure_matmul_flops(dtype: torch.dtype, size: int = 256, seconds: float = 0.1) -> float:
    """FLOP/s of one thread on a ``size`` x ``size`` matmul (2 size^3 FLOPs per call)."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    calls, elapsed = _rate(lambda: torch.mm(a, b), seconds)
    return 2.0 * size**3 * calls / elapsed


def measure_memory_bandwidth(num_bytes: int = 32 * 2**20, seconds: float = 0.1) -> float:
    """Bytes/s of one thread copying a buffer (a copy reads and writes: 2 x bytes moved)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    calls, elapsed = _rate(lambda: dst.copy_(src), seconds)
    return 2.0 * num_bytes * calls / elapsed


def measure_op_overhead(seconds: float = 0.05) -> float:
    """Seconds of one tiny eager op (dispatch overhead, the CPU's 'kernel launch')."""
    x = torch.ones(4)
    calls, elapsed = _rate(lambda: torch.add(x, x), seconds)
    return elapsed / calls


def measure_device() -> dict[str, float]:
    """One-thread compute, memory bandwidth and op overhead of this CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank = one thread, as the local cluster runs them
    try:
        return {
            "float32": measure_matmul_flops(torch.float32),
            "bfloat16": measure_matmul_flops(torch.bfloat16, size=128),
            "float16": measure_matmul_flops(torch.float16, size=128),
            "memory_bandwidth": measure_memory_bandwidth(),
            "kernel_launch": measure_op_overhead(),
        }
    finally:
        torch.set_num_threads(previous)


def _round_trip_s(dist: object, rank: int, tensor: torch.Tensor, repeats: int) -> list[float]:
    """Per-repeat round-trip times of ``tensor`` rank 0 -> 1 -> 0."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if rank == 0:
            dist.send(tensor, dst=1)  # type: ignore[attr-defined]
            dist.recv(tensor, src=1)  # type: ignore[attr-defined]
        else:
            dist.recv(tensor, src=0)  # type: ignore[attr-defined]
            dist.send(tensor, dst=0)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return times


def _allreduce_s(dist: object, tensor: torch.Tensor, repeats: int) -> list[float]:
    """Per-repeat times of a SUM allreduce of ``tensor`` over both ranks, each started together."""
    times = []
    for _ in range(repeats):
        dist.barrier()  # type: ignore[attr-defined]
        start = time.perf_counter()
        dist.all_reduce(tensor)  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return times


def _message_overhead_s(dist: object, rank: int, repeats: int) -> float:
    """Median seconds rank 0 takes to pack and post a send, or rank 1 to post a receive, right after compute.

    The runtime's own path (``pack``, ``batch_isend_irecv``), each message after a few matmuls, as in a
    step; the wait for the data is not counted (the link model has it).
    """
    from fxpipe.runtime.comm import pack  # the runtime's packing, timed as it runs in a step

    pieces = [torch.randn(shape) for shape in MESSAGE_PIECES]
    inbox = torch.empty(pack(pieces).numel(), dtype=torch.uint8)
    square = torch.randn(256, 256)
    times = []
    for tag in range(repeats):
        dist.barrier()  # type: ignore[attr-defined]
        for _ in range(MESSAGE_GAP_MATMULS):
            torch.mm(square, square)
        start = time.perf_counter()
        op = (dist.P2POp(dist.isend, pack(pieces), 1, tag=tag) if rank == 0  # type: ignore[attr-defined]
              else dist.P2POp(dist.irecv, inbox, 0, tag=tag))  # type: ignore[attr-defined]
        works = dist.batch_isend_irecv([op])  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
        for work in works:
            work.wait()
    return statistics.median(times)


def _ping_worker(rank: int, init_file: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist  # only the worker processes touch process groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        small = torch.zeros(PING_SMALL_BYTES // 4, dtype=torch.float32)
        large = torch.zeros(PING_LARGE_BYTES // 4, dtype=torch.float32)
        _round_trip_s(dist, rank, large, 2)  # warm-up: connection setup and buffer allocation
        small_times = _round_trip_s(dist, rank, small, PING_REPEATS)
        large_times = _round_trip_s(dist, rank, large, 5)
        small_reduce = _allreduce_s(dist, small, PING_REPEATS)
        large_reduce = _allreduce_s(dist, large, 5)
        # Each end's own time per message; the model charges one figure at both ends: their mean.
        overhead = torch.tensor([_message_overhead_s(dist, rank, PING_REPEATS)], dtype=torch.float64)
        dist.all_reduce(overhead)
        if rank == 0:
            # Medians: what a pipeline's transfers typically see, waking a blocked receiver included
            # (the fastest repeat promised 73 us and 2.9 GB/s here where the medians were 150-190 us
            # and 1.6-2.0 GB/s, and a step's many transfers pay the typical figure, not the best).
            queue.put((statistics.median(small_times), statistics.median(large_times),
                       statistics.median(small_reduce), statistics.median(large_reduce), float(overhead.item()) / 2))
    finally:
        dist.destroy_process_group()


def measure_link(timeout_s: float = 60.0) -> dict[str, float]:
    """Latency (s) and bandwidth (B/s) of a gloo send/recv between two local processes, of its allreduce, and
    the seconds each end spends on a message of its own time (``message_overhead``).

    The allreduce figures are what :meth:`fxpipe.cluster.Cluster.allreduce_time`'s ring formula needs
    to give the measured two-rank times (gloo's allreduce copies and sums besides sending).
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="fxpipe-calibrate-") as folder:
        init_file = str(Path(folder) / "rendezvous")
        workers = [context.Process(target=_ping_worker, args=(rank, init_file, queue)) for rank in range(2)]
        for worker in workers:
            worker.start()
        try:
            small_rt, large_rt, small_ar, large_ar, message_overhead = queue.get(timeout=timeout_s)
        except Exception as error:  # queue.Empty, or a worker died before reporting
            raise CalibrationError(f"gloo ping between 2 local processes gave no result in {timeout_s} s; "
                                   "pass calibrate=False to use default figures") from error
        finally:
            for worker in workers:
                worker.join(timeout=timeout_s)
                if worker.is_alive():
                    worker.terminate()
    latency = small_rt / 2
    one_way = max(large_rt / 2 - latency, 1e-9)
    # Two-rank ring allreduce (Cluster.allreduce_time): 2 latencies + W / bandwidth.
    return {"link_latency": latency, "link_bandwidth": PING_LARGE_BYTES / one_way,
            "allreduce_latency": small_ar / 2, "allreduce_bandwidth": PING_LARGE_BYTES / max(large_ar - small_ar, 1e-9),
            "message_overhead": message_overhead}


def calibrate_local(*, refresh: bool = False) -> dict[str, float]:
    """Device and link figures for this machine, from the cache file or a fresh ~5 s measurement.

    The cache is measured again when ``refresh`` is set, when it is older than
    ``CALIBRATION_MAX_AGE_S`` (or dated in the future), or when it is from another format version.
    """
    path = cache_path()
    if not refresh and path.is_file():
        try:
            cached = json.loads(path.read_text())
            age_s = time.time() - float(cached["measured_at"])
            if cached.get("version") == CALIBRATION_VERSION and 0 <= age_s <= CALIBRATION_MAX_AGE_S:
                return {str(key): float(value) for key, value in cached["figures"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # a damaged cache file is re-measured and overwritten below
    figures = {**measure_device(), **measure_link()}
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"version": CALIBRATION_VERSION, "hostname": socket.gethostname(), "torch": torch.__version__,
               "measured_at": time.time(), "figures": figures}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)  # atomic: concurrent ranks never read a half-written file
    return figures
