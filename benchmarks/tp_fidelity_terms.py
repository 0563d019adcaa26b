"""Why a T=2 stage's prediction misses, term by term: compute, collectives and the rest, measured vs charged.

Run: python benchmarks/tp_fidelity_terms.py [--rounds 3] [--steps 8] [--warmup 2] [--write]

On 2 forked gloo ranks (1 thread each), gpt-mini b=8 laid out ``1x2`` M=2 (benchmarks/tp_fidelity.py's case) is
compiled once per round with the default ``costs="auto"``; then, interleaved step by step:

- *real* steps, every call of the runtime's ``GroupCommunicator`` timed (its copies and the gloo call: what the
  step spends in the group's collectives, waits for the peer included), with their kinds and byte counts;
- *local* steps, the same communicator answering without gloo (the shapes a collective returns, from this
  member's own tensor): the stage's compute on its shards with the runtime's copies, no collective;
- bare ``dist.all_reduce`` calls of each size the step used, and of 8 bytes (the per-call latency), after a
  barrier and after ~1.5 ms of matmuls without one (as calibrate_lockstep times the group's link).

Each real step's collectives are split, on the host's monotonic clock both forked ranks share, into the time
rank 0 waited for its peer to enter and the time after both had entered; each step's CPU time of every thread
but the main one (gloo's worker and transport threads, the heartbeat) comes from /proc schedstat; the calls of
the largest size are also binned by the time since the previous call returned (the compute they followed).
The model's side comes from the plan's own chain and cluster (fxpipe/sim/tensor_parallel_cost.py): compute
t ((1 - s) + s / T) summed over the stage's blocks, forward and backward, times M; collectives
``collective_seconds`` of each block's bytes on the group's link, per direction, times M; the rest (fixed
costs, optimizer, the step-end sync) = predicted - both. Medians of rank 0's per-step figures, then over rounds.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import Workload, machine_notes, median, run_ranks  # noqa: E402
from benchmarks.kept_notes import write_keeping_notes  # noqa: E402
from benchmarks.rank_pinning import pin_rank  # noqa: E402
from benchmarks.small_fidelity import _captured_planning  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
COMMAND = "python benchmarks/tp_fidelity_terms.py --write"
GPT = Workload("gpt-mini", (), 8, 2)
LAYOUT = "1x2"
BARE_REPEATS = 15


class CallLog:
    """Each communicator call of the current step: (kind, bytes in, seconds, start on the host's monotonic clock,
    which both forked ranks share); ``local`` skips gloo."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float, float]] = []
        self.local = False


def _instrument(log: CallLog) -> None:
    """Time every GroupCommunicator collective into ``log``; in ``log.local`` mode answer without gloo."""
    from fxpipe.runtime.parallel.tensor_parallel import GroupCommunicator

    originals: dict[str, Callable[..., torch.Tensor]] = {
        name: getattr(GroupCommunicator, name) for name in ("all_reduce", "all_gather", "reduce_scatter")}

    def local_answer(comm: Any, name: str, tensor: torch.Tensor, *dim: int) -> torch.Tensor:
        if name == "all_reduce":
            return tensor.contiguous().clone()
        if name == "all_gather":
            return torch.cat([tensor.contiguous()] * comm.size, dim[0])
        return tensor.contiguous().clone().chunk(comm.size, dim[0])[comm.rank].contiguous()

    def wrap(name: str) -> Callable[..., torch.Tensor]:
        def timed_call(comm: Any, tensor: torch.Tensor, *dim: int) -> torch.Tensor:
            start = time.perf_counter()
            out = local_answer(comm, name, tensor, *dim) if log.local else originals[name](comm, tensor, *dim)
            log.calls.append((name, tensor.numel() * tensor.element_size(), time.perf_counter() - start, start))
            return out
        return timed_call

    for name in originals:
        setattr(GroupCommunicator, name, wrap(name))


def _bare_allreduce_s(num_bytes: int) -> float:
    import torch.distributed as dist

    tensor = torch.zeros(max(1, num_bytes // 4))
    times = []
    for _ in range(BARE_REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _between_compute_allreduce_s(num_bytes: int) -> float:
    """Median seconds of an all-reduce posted right after the calibration's ~1.5 ms of matmuls, no barrier: as a
    TP stage calls it, and as calibrate_lockstep times it."""
    import functools

    import torch.distributed as dist

    from fxpipe.runtime.calibration.calibrate_lockstep import (
        LOCKSTEP_MATMUL_SIZE,
        lockstep_matmuls,
        timed_after_compute,
    )

    tensor, square = torch.zeros(max(1, num_bytes // 4)), torch.randn(LOCKSTEP_MATMUL_SIZE, LOCKSTEP_MATMUL_SIZE)
    count = lockstep_matmuls(square, None)

    def compute() -> None:
        for _ in range(count):
            torch.mm(square, square)

    dist.barrier()
    return statistics.median(timed_after_compute(compute, functools.partial(dist.all_reduce, tensor),
                                                 BARE_REPEATS + 1)[1:])


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this process's threads by id (/proc schedstat; empty where there is none)."""
    times = {}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                times[tid] = int(stat.read().split()[0]) / 1e9
        except OSError:
            continue
    return times


GAP_BINS_S = (0.5e-3, 1.5e-3, 3e-3)  # upper edges of the bins of the compute before a call; the last bin is open


def _by_gap(steps: list[list[Any]]) -> dict[int, list[float]]:
    """Seconds of the real steps' calls of the largest size (each step's first left out) by the bin of the time
    since the previous call returned: what the call followed, as calibrate_lockstep's ~1.5 ms of matmuls."""
    bins: dict[int, list[float]] = {}
    largest = max(call[1] for calls in steps for call in calls)
    for calls in steps:
        for before, call in itertools.pairwise(calls):
            if call[1] == largest:
                gap = call[3] - (before[3] + before[2])
                bins.setdefault(sum(gap >= edge for edge in GAP_BINS_S), []).append(call[2])
    return bins


def _phases(mine: list[list[Any]], peers: list[list[Any]]) -> dict[str, float]:
    """Per real step, the seconds rank 0's collectives waited for the peer to enter (max(entries) - own entry)
    and spent after both had entered; medians over the steps."""
    waited, after = [], []
    for own, peer in zip(mine, peers, strict=True):
        pairs = list(zip(own, peer, strict=True))
        waited.append(sum(max(a[3], b[3]) - a[3] for a, b in pairs))
        after.append(sum(a[3] + a[2] - max(a[3], b[3]) for a, b in pairs))
    return {"peer_wait_s": statistics.median(waited), "after_both_s": statistics.median(after)}


def _model_terms(plan: Any, chain: Any, cluster: Any) -> dict[str, Any]:
    """The model's compute, lock-step wait and collective seconds of the stage's step, and its calls charged."""
    from fxpipe.sim.tensor_parallel_cost import collective_seconds, splits, tensor_parallel_link

    stage = plan.stages[0]
    degree, rows, num_mb = stage.tensor_parallel, plan.global_batch_size / plan.num_microbatches, plan.num_microbatches
    compute = comm = 0.0
    charged = 0
    for block in chain.blocks[stage.first_block:stage.stop_block]:
        both = block.forward_s.at(rows) + block.backward_s.at(rows)
        if splits(block, degree):
            both *= (1.0 - block.tp.time_share) + block.tp.time_share / degree
            block_comm = collective_seconds(cluster, block.tp.comm_bytes.at(rows), degree)
            comm += 2 * block_comm
            charged += 4 if block_comm > 0 else 0
        compute += both
    link, bare = tensor_parallel_link(cluster, "all_gather"), cluster.collective_link((0, 1))
    return {"compute_s": compute * num_mb, "comm_s": comm * num_mb, "charged_calls": charged * num_mb,
            "link_latency_s": link.latency_s, "link_bandwidth": link.bandwidth_bytes_per_s,
            "bare_latency_s": bare.latency_s, "bare_bandwidth": bare.bandwidth_bytes_per_s}


def _steps(pipe: Any, optimizer: Any, inputs: Any, targets: Any, log: CallLog, num_warmup: int,
           num_steps: int) -> dict[str, list[Any]]:
    import torch.distributed as dist

    out: dict[str, list[Any]] = {"real": [], "local": [], "real_comm": [], "local_comm": [], "calls": [],
                                 "real_helpers_cpu": [], "local_helpers_cpu": []}
    main = str(os.getpid())
    for index in range(num_warmup + num_steps):
        for mode in ("real", "local"):
            log.local, log.calls = mode == "local", []
            dist.barrier()
            before = _thread_cpu_s()
            start = time.perf_counter()
            pipe.step(inputs, targets)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            after = _thread_cpu_s()
            if index >= num_warmup:
                out[mode].append(elapsed)
                out[f"{mode}_comm"].append(sum(call[2] for call in log.calls))
                # gloo's worker and transport threads (and the heartbeat's): every thread but the main one
                out[f"{mode}_helpers_cpu"].append(sum(cpu - before[tid] for tid, cpu in after.items()
                                                      if tid in before and tid != main))
                if mode == "real":
                    out["calls"].append(list(log.calls))
    log.local = False
    return out


def one_round(rank: int, num_warmup: int, num_steps: int, log: CallLog, seen: dict[str, Any]) -> dict[str, Any]:
    import fxpipe

    model, example_inputs = GPT.build()
    pipe = fxpipe.compile(model, example_inputs, loss_fn=GPT.loss_fn(), plan=LAYOUT, loss_reduction="mean",
                          global_batch_size=GPT.global_batch_size, num_microbatches=GPT.num_microbatches)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    inputs, targets = GPT.batch()
    import torch.distributed as dist

    steps = _steps(pipe, optimizer, inputs, targets, log, num_warmup, num_steps)
    calls = steps["calls"][0]
    sizes = sorted({call[1] for call in calls})
    bare = {num_bytes: _bare_allreduce_s(num_bytes) for num_bytes in [8, *sizes]}
    between = {num_bytes: _between_compute_allreduce_s(num_bytes) for num_bytes in [8, *sizes]}
    both: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, steps["calls"])
    if rank != 0:
        return {}
    plan = pipe.plan
    assert plan.predicted is not None
    by_kind: dict[str, list[float]] = {}
    for kind, num_bytes, seconds, _ in (call for step in steps["calls"] for call in step):
        by_kind.setdefault(f"{kind} {num_bytes} B", []).append(seconds)
    return {"predicted_s": plan.predicted.iteration_time_s, **_model_terms(plan, seen["chain"], seen["cluster"]),
            **{key: statistics.median(values) for key, values in steps.items() if key != "calls"},
            "num_calls": len(calls), "bare": bare, "between": between, "per_call": {k: statistics.median(v) for k, v in by_kind.items()},
            "calls_per_step": {k: len(v) // len(steps["calls"]) for k, v in by_kind.items()},
            "bare_sum_s": sum(bare[call[1]] for call in calls),
            "between_sum_s": sum(between[call[1]] for call in calls), "by_gap": _by_gap(steps["calls"]),
            **_phases(both[0], both[1])}


def terms_rank(rank: int, world_size: int, num_rounds: int, num_warmup: int, num_steps: int,
               pin: bool = False) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    if pin:  # every thread of this rank on a core of its own (benchmarks/tp_fidelity.py --pin)
        pin_rank(rank)
    log = CallLog()
    _instrument(log)
    seen = _captured_planning()
    return [one_round(rank, num_warmup, num_steps, log, seen) for _ in range(num_rounds)]


def report(rounds: list[dict[str, Any]], args: Any) -> str:
    def med(key: str) -> float:
        return median([r[key] for r in rounds])

    rows: list[tuple[str, float | None, float]] = [
        ("whole step", med("predicted_s"), med("real")),
        ("compute (local steps, no gloo)", med("compute_s"), med("local") - med("local_comm")),
        ("collectives (timed calls in real steps)", med("comm_s"), med("real_comm")),
        ("  of which waiting for the peer to enter", None, med("peer_wait_s")),
        ("  of which after both entered", None, med("after_both_s")),
        ("  the same sizes, bare dist.all_reduce after a barrier", None, med("bare_sum_s")),
        ("  the same sizes, each after ~1.5 ms of matmuls (as the link is calibrated)", None, med("between_sum_s")),
        ("the rest: real step - its collectives", med("predicted_s") - med("comm_s"), med("real") - med("real_comm")),
        ("gloo's (and other helper) threads' CPU, real step", None, med("real_helpers_cpu")),
        ("  the same, local step (no collective)", None, med("local_helpers_cpu")),
    ]
    table = [[name, "-" if p is None else f"{p * 1e3:.2f}", f"{m * 1e3:.2f}",
              f"{m / p:.2f}" if p is not None and p > 0 else "-"] for name, p, m in rows]
    calls = [[key, rounds[0]["calls_per_step"][key], f"{median([r['per_call'][key] for r in rounds]) * 1e3:.3f}"]
             for key in sorted(rounds[0]["per_call"])]
    bare = [[f"{size} B", f"{median([r['bare'][size] for r in rounds]) * 1e3:.3f}",
             f"{median([r['between'][size] for r in rounds]) * 1e3:.3f}"] for size in sorted(rounds[0]["bare"])]
    edges = [0.0, *GAP_BINS_S]
    gaps = [[f"{edges[b] * 1e3:g}-{edges[b + 1] * 1e3:g} ms" if b < len(GAP_BINS_S) else f">= {edges[b] * 1e3:g} ms",
             sum(len(r["by_gap"].get(b, [])) for r in rounds),
             f"{median([t for r in rounds for t in r['by_gap'].get(b, [])]) * 1e3:.3f}"]
            for b in range(len(edges)) if any(r["by_gap"].get(b) for r in rounds)]
    return "\n".join([
        "# Tensor-parallel fidelity, term by term: gpt-mini b=8 `1x2` M=2 on 2 gloo ranks", "",
        f"Command: `{COMMAND} --rounds {args.rounds} --steps {args.steps} --warmup {args.warmup}"
        f"{' --pin' if args.pin else ''}`", "",
        f"Machine: {machine_notes()}.", "",
        f"Model's link for the group's collectives (the lock-step link, calibrate_lockstep): latency "
        f"{med('link_latency_s') * 1e6:.0f} us, bandwidth {med('link_bandwidth') / 1e6:.0f} MB/s (the bare allreduce "
        f"link: {med('bare_latency_s') * 1e6:.0f} us, {med('bare_bandwidth') / 1e6:.0f} MB/s); collective calls "
        f"charged per step {rounds[0]['charged_calls']}, made per step {rounds[0]['num_calls']}.", "",
        tabulate(table, ["term", "model ms", "measured ms", "measured / model"], tablefmt="github"), "",
        tabulate(calls, ["communicator call (bytes in)", "per step", "median ms per call"], tablefmt="github"), "",
        tabulate(bare, ["dist.all_reduce of", "median ms, after a barrier",
                        "median ms, after ~1.5 ms of matmuls (no barrier)"], tablefmt="github"), "",
        tabulate(gaps, ["in the real steps, a call of the largest size after (since the previous one returned)", "calls",
                        "median ms per call"], tablefmt="github"), "",
        __doc__.split("\n\n", 2)[2].strip() if __doc__ else "", ""])


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    parser.add_argument("--pin", action="store_true",
                        help="pin every thread of each rank (gloo's included) to a core of its own")
    parser.add_argument("--cached", action="store_true",
                        help="plan with the calibration cache as it is (default: calibrate afresh, as the steps run)")
    args = parser.parse_args(argv)
    if not args.cached:  # the figures of this moment's load, not of whenever the shared cache was written
        os.environ["FXPIPE_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxpipe-calibration-")
    rounds = run_ranks(terms_rank, 2, args.rounds, args.warmup, args.steps, args.pin)[0]
    print(json.dumps(rounds, default=str))
    text = report(rounds, args)
    print(text)
    if args.write:
        write_keeping_notes(RESULTS, text)


if __name__ == "__main__":
    main()
