"""Does FSDP2 on gloo CPU ranks overlap a prefetched unit's all-gather with compute? An A/B of one step.

Run: python benchmarks/fsdp_prefetch_ab.py [--steps 10] [--rounds 3]

Two gloo ranks (1 thread each) hold 8 Linear blocks, each its own FSDP2 unit (ZeRO-3), and time a forward +
backward interleaved three ways: prefetch on (next unit forward, previous unit backward, as
:mod:`fxpipe.runtime.parallel.sharded_stage` sets it), prefetch off, and the same blocks unsharded on each rank
(compute alone). If the prefetched all-gathers ran beside compute, "on" would be faster than "off" by up to the
collectives' time; medians of the slower rank. (On CPU tensors FSDP2 calls its all-gathers with ``async_op``
false, so gloo blocks the caller until each completes.)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WIDTH, BLOCKS, ROWS = 768, 8, 64


def _blocks() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())
                                 for _ in range(BLOCKS)))


def _sharded(prefetch: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    model = _blocks()
    units = [fully_shard(block) for block in model]
    fully_shard(model)
    if prefetch:
        for before, after in zip(units, units[1:], strict=False):
            before.set_modules_to_forward_prefetch([after])
            after.set_modules_to_backward_prefetch([before])
    return model


def _step(model: torch.nn.Module, inputs: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    model(inputs).square().mean().backward()
    elapsed = time.perf_counter() - start
    for param in model.parameters():
        param.grad = None
    return elapsed


def _rank(rank: int, steps: int, out: dict) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh
    init_device_mesh("cpu", (2,))
    models = {"prefetch on": _sharded(True), "prefetch off": _sharded(False), "unsharded": copy.deepcopy(_blocks())}
    inputs = torch.randn(ROWS, WIDTH)
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(steps + 2):
        for name, model in models.items():
            elapsed = _step(model, inputs)
            if step >= 2:
                times[name].append(elapsed)
    medians = torch.tensor([statistics.median(times[name]) for name in models])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.update(zip(models, medians.tolist(), strict=True))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for round_index in range(args.rounds):
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_rank, args=(args.steps, out), nprocs=2)
            row = dict(out)
        on, off, alone = row["prefetch on"], row["prefetch off"], row["unsharded"]
        print(f"round {round_index}: on {on * 1e3:.1f} ms, off {off * 1e3:.1f} ms, unsharded {alone * 1e3:.1f} ms; "
              f"on/off {on / off:.3f}; collectives exposed on {(on - alone) * 1e3:.1f} ms, off {(off - alone) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
