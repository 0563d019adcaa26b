"""Multi-process test helpers: forked (spawned once CUDA is initialised) gloo ranks, one fresh process group per config, plans from node lists."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import multiprocessing
import os
import pickle
import pkgutil
import queue
import socket
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpipe.core.plan import Plan, StagePlan

torch.set_num_threads(1)  # forked ranks inherit this; 2 shared cores


# torch.compile's backend and partitioner modules, which a rank running a compiled stage imports on first use (py-spy
# on tests/test_sharded_stages.py's 4 ranks: ~2 s of CPU each under load; importing them here took ~1 s, once)
TORCH_COMPILE_MODULES = ("torch._dynamo.backends.common", "torch._dynamo.backends.debugging",
                         "torch._inductor.pattern_matcher", "torch._inductor.debug",
                         "torch.distributed.tensor.experimental")
# fxpipe imports its runtime lazily (inside compile and the pipe's methods); every module but these
SKIPPED_FXPIPE_MODULES = ("fxpipe.hf_examples", "fxpipe.__main__")  # transformers (seconds); the CLI entry point


@functools.cache
def warm_up_parent() -> None:
    """Pay one-time import costs (the first optimizer step imports torch._dynamo, ~10 s) before forking.

    Forked ranks inherit this process's modules: fxpipe's lazily imported ones and torch.compile's are imported
    here once instead of in every rank of every world (fxpipe's: ~0.3 s of CPU per rank in py-spy's samples of
    tests/test_hf_models.py's ranks; 0.4 s here, once).
    """
    parameter = torch.nn.Parameter(torch.zeros(2))
    parameter.grad = torch.ones(2)
    torch.optim.AdamW([parameter]).step()
    with FakeTensorMode(allow_non_fake_inputs=True):  # codegen's shape runs import fake-tensor machinery
        torch.nn.functional.linear(torch.empty(2, 2), parameter.detach().expand(2, 2)).sum()
    import fxpipe
    import fxpipe.passes

    for package in (fxpipe, fxpipe.passes):
        for module in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not module.name.startswith(SKIPPED_FXPIPE_MODULES):
                importlib.import_module(module.name)
    for name in TORCH_COMPILE_MODULES:
        importlib.import_module(name)


def start_method() -> str:
    """``fork`` (fast: children share the parent's imported torch), or ``spawn`` once this process initialised CUDA.

    A forked child cannot use CUDA after its parent initialised it ("CUDA error: initialization error",
    e.g. inside ``optimizer.step``); a spawned child starts a fresh interpreter (~3 s to import torch),
    with CUDA hidden. Any optimizer step initialises CUDA where a GPU is visible (its graph-capture
    check asks torch.accelerator for the current stream; on torch 2.11 without ``torch.cuda.is_initialized()``
    saying so), and any backward starts autograd's device threads, after which a forked child's autograd
    refuses to run ("Unable to handle autograd's threading in combination with fork-based multiprocessing"):
    so machines with a visible GPU spawn (the first device run of issue 36 failed 24 tests on both), CPU-only
    ones fork.
    """
    forced = os.environ.get("FXPIPE_TEST_START_METHOD", "")  # "spawn": try a CUDA machine's path on a CPU one
    if forced:
        if forced not in ("fork", "spawn"):
            raise ValueError(f"FXPIPE_TEST_START_METHOD={forced!r}; use 'fork' or 'spawn'")
        return forced
    return "spawn" if torch.cuda.is_initialized() or torch.cuda.is_available() else "fork"


def rank_context() -> Any:
    """The multiprocessing context for CPU rank processes, after the parent's warm-up (see :func:`start_method`)."""
    warm_up_parent()  # before choosing: on a CUDA machine its optimizer step initialises CUDA (torch.accelerator)
    return multiprocessing.get_context(start_method())


def start_ranks(context: Any, processes: Sequence[Any]) -> None:
    """Start rank processes made by ``context``; spawned ones with ``CUDA_VISIBLE_DEVICES=""`` (CPU ranks, no GPU)."""
    with _cuda_hidden(context.get_start_method() == "spawn"):
        for process in processes:
            process.start()


@contextlib.contextmanager
def _cuda_hidden(hide: bool) -> Iterator[None]:
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if hide:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(f"run_ranks spawns its ranks here (CUDA is initialised in this process), so {fn!r} and its "
                        f"args must be picklable: define the function at module level ({error})") from error


def _child(fn: Callable[..., Any], rank: int, world_size: int, store_dir: str, results: Any,
           args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    try:
        results.put((rank, True, fn(rank, world_size, store_dir, *args)))
    except BaseException:  # reported to the parent, which fails the test with this traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world_size: int, store_dir: str | Path, *args: Any,
              timeout_s: float = 150.0) -> list[Any]:
    """Run ``fn(rank, world_size, store_dir, *args)`` in ``world_size`` processes; results by rank.

    Processes are forked, or spawned when CUDA is initialised here (:func:`start_method`; ``fn`` and
    ``args`` must then be picklable: module-level functions).

    A rank that raises fails the call with its traceback; a rank that hangs past ``timeout_s``
    is terminated (only the processes started here) and the call fails.
    """
    context = rank_context()
    if context.get_start_method() == "spawn":
        _check_picklable(fn, args)
    results = context.Queue()
    processes = [context.Process(target=_child, args=(fn, rank, world_size, str(store_dir), results, args))
                 for rank in range(world_size)]
    start_ranks(context, processes)
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = results.get(timeout=timeout_s)
            (collected.__setitem__(rank, payload) if ok else errors.append(f"rank {rank}:\n{payload}"))
    except queue.Empty:
        errors.append(f"ranks {sorted(set(range(world_size)) - set(collected))} gave no result in {timeout_s} s")
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[rank] for rank in range(world_size)]


@contextlib.contextmanager
def reserved_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A TCP port held for the block: bound (not listening) with SO_REUSEADDR, so the kernel hands it to no
    other ephemeral bind, while a TCPStore (which also sets SO_REUSEADDR) can still listen on it.

    Closing a probe socket and passing its port on (the old ``_free_port``) left a window in which another
    process on a loaded CI machine could take the port.
    """
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host, 0))
        yield int(holder.getsockname()[1])


def join_world(store_dir: str, name: str, rank: int, world_size: int, timeout_s: float = 30.0) -> None:
    """A fresh default gloo group of ``world_size`` ranks, rendezvous through a file named ``name``."""
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(store_dir, name)}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def leave_world() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run_scenarios(scenarios: Mapping[str, Callable[[], Any]], rank: int, world_size: int, store_dir: str,
                  prefix: str) -> dict[str, Any]:
    """Each scenario in a fresh default group of its own (rendezvous file ``prefix-index``); results by name."""
    results = {}
    for index, (name, scenario) in enumerate(scenarios.items()):
        join_world(store_dir, f"{prefix}-{index}", rank, world_size)
        try:
            results[name] = scenario()
        finally:
            leave_world()
    return results


def compute_nodes(gm: fx.GraphModule) -> list[str]:
    """Names of the nodes a stage may compute, in graph order (placeholders, outputs, get_attr excluded)."""
    return [node.name for node in gm.graph.nodes if node.op not in ("placeholder", "output", "get_attr")]


def plan_from_cuts(gm: fx.GraphModule, replicas: Sequence[int], global_batch_size: int, num_microbatches: int,
                   *, schedule: str = "early_backward", warmup_policy: str = "A",
                   fractions: Sequence[float] | None = None) -> Plan:
    """A Plan cutting the graph's compute nodes into ``len(replicas)`` contiguous stages (test fixture).

    Cut points are at ``fractions`` of the node list (default: equal node counts); devices are
    numbered stage by stage.
    """
    names = compute_nodes(gm)
    num_stages = len(replicas)
    fractions = fractions or [i / num_stages for i in range(1, num_stages)]
    bounds = [0, *(round(f * len(names)) for f in fractions), len(names)]
    stages, next_device = [], 0
    for index, count in enumerate(replicas):
        devices = tuple(range(next_device, next_device + count))
        next_device += count
        stages.append(StagePlan(stage_index=index, first_block=index, stop_block=index + 1, replicas=count,
                                devices=devices, node_names=tuple(names[bounds[index]:bounds[index + 1]])))
    return Plan(global_batch_size=global_batch_size, num_microbatches=num_microbatches, stages=tuple(stages),
                schedule=schedule, warmup_policy=warmup_policy, planner="test-cuts")


def with_layout(plan: Plan, layout: Sequence[tuple[int, int]]) -> Plan:
    """``plan`` with each stage as ``replicas`` groups of ``T`` devices (``layout``: (replicas, T) per stage),
    devices numbered stage by stage (test fixture)."""
    stages, first = [], 0
    for stage, (replicas, degree) in zip(plan.stages, layout, strict=True):
        devices = tuple(range(first, first + replicas * degree))
        first += len(devices)
        stages.append(dataclasses.replace(stage, replicas=replicas, devices=devices, tensor_parallel=degree))
    return plan.with_updates(stages=tuple(stages))


def before_each_forward(runner: Any, hook: Callable[[], None]) -> None:
    """Run ``hook()`` first in each forward of a StageRunner (``forward``, and ``forward_loss`` on the last stage)."""
    for name in ("forward", "forward_loss"):
        original = getattr(runner, name)

        def forward(*args: Any, _original: Any = original) -> Any:
            hook()
            return _original(*args)

        setattr(runner, name, forward)


def eager_weights(model_name: str, num_steps: int, batch: int, lr: float) -> dict[str, torch.Tensor]:
    """The zoo model's tiny weights after ``num_steps`` AdamW steps in one process (batches ``make_batch(batch, step)``)."""
    from fxpipe import models as zoo

    entry = zoo.get(model_name)
    model, _ = zoo.build(model_name, **entry.tiny_overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(num_steps):
        inputs, targets = entry.make_batch(batch, step, **entry.tiny_overrides)
        entry.loss_fn(model(*inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}
