"""Shared harness of the runtime benchmarks: local gloo ranks, layer-cut plans, saved-tensor memory meter, stats."""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from benchmarks.kept_notes import write_keeping_notes
from fxpipe.core import meta
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.runtime.autograd.measure import SavedActivationMeter
from tests.mp_utils import run_ranks as run_forked

BENCH_MODEL = "gpt-mini"
GPT_MINI_WIDTH = 128  # gpt-mini's n_embd


def gpt_mini_width(width: int) -> tuple[tuple[str, int], ...]:
    """gpt-mini overrides for ``width`` channels, one head per 32 beyond the default (none at the default): wider
    blocks carry more compute per message or collective byte (rows x h^2 against rows x h)."""
    return () if width == GPT_MINI_WIDTH else (("n_embd", width), ("n_head", width // 32))


# ---- ranks -----------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _in_world(rank: int, world_size: int, store_dir: str, fn: Callable[..., Any], port: int, group_timeout_s: float,
              *args: Any) -> Any:
    torch.set_num_threads(1)  # one rank = one thread, as the local cluster runs them
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=group_timeout_s))
    try:
        return fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 900.0,
              group_timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks (127.0.0.1); results by rank.

    The fork runner is the test suite's (tests/mp_utils.py); this adds a TCP rendezvous per run.
    ``group_timeout_s``: the process group's timeout (a compiling stage keeps its peers waiting for minutes).
    """
    with tempfile.TemporaryDirectory() as store_dir:
        return run_forked(_in_world, world_size, store_dir, fn, free_port(), group_timeout_s, *args,
                          timeout_s=timeout_s)


# ---- plans cut at transformer-block boundaries -------------------------------------------------------


def layer_of(node: fx.Node) -> int | None:
    """Index of the ``h.<i>`` (GPT) or ``blocks.<i>`` (tied-lm's residual MLP) block a node belongs to,
    None outside the blocks."""
    parts = str(node.meta.get(meta.MODULE_PATH, "")).split(".")
    return int(parts[1]) if len(parts) >= 2 and parts[0] in ("h", "blocks") and parts[1].isdigit() else None


def layer_bounds(num_layers: int, num_stages: int) -> list[int]:
    """Even split of ``num_layers`` blocks into stages: first block index of each stage, then num_layers."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages={num_stages} must be in 1..{num_layers} (one block per stage at least)")
    return [round(i * num_layers / num_stages) for i in range(num_stages + 1)]


def layer_cut_stages(gm: fx.GraphModule, num_stages: int) -> list[list[str]]:
    """Node names per stage: embeddings with stage 0, ``h.<i>`` blocks split evenly, head with the last stage."""
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    layers = [layer_of(n) for n in compute]
    num_layers = 1 + max(layer for layer in layers if layer is not None)
    bounds = layer_bounds(num_layers, num_stages)
    stage_of_layer = {layer: s for s in range(num_stages) for layer in range(bounds[s], bounds[s + 1])}
    stages: list[list[str]] = [[] for _ in range(num_stages)]
    seen_block = False
    for node, layer in zip(compute, layers, strict=True):
        if layer is not None:
            seen_block = True
            stages[stage_of_layer[layer]].append(node.name)
        else:  # before the first block: embeddings (stage 0); after: final norm and head (last stage)
            stages[-1 if seen_block else 0].append(node.name)
    return stages


def layer_cut_plan(gm: fx.GraphModule, num_stages: int, global_batch_size: int, num_microbatches: int, *,
                   schedule: str = "early_backward", warmup_policy: str = "A") -> Plan:
    """A Plan with one device per stage, cut at transformer-block boundaries (see :func:`layer_cut_stages`)."""
    stages = tuple(StagePlan(stage_index=s, first_block=s, stop_block=s + 1, replicas=1, devices=(s,),
                             node_names=tuple(names))
                   for s, names in enumerate(layer_cut_stages(gm, num_stages)))
    return Plan(global_batch_size=global_batch_size, num_microbatches=num_microbatches, stages=stages,
                schedule=schedule, warmup_policy=warmup_policy, planner="bench-layer-cuts")


# ---- activation memory: bytes autograd saves for backward ---------------------------------------------


# One meter serves the runtime's --measure and both sides of every benchmark.
ActivationMeter = SavedActivationMeter


# ---- timing and reporting -----------------------------------------------------------------------------


def timed(step: Callable[[], Any], *, barrier: bool = True) -> float:
    """Seconds of one call, between two barriers when a process group is up (all ranks start together)."""
    if barrier and dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    step()
    if barrier and dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


def saved_peaks(calls: dict[str, Callable[[], Any]], params: dict[str, list[torch.nn.Parameter]]) -> dict[str, int]:
    """Peak bytes saved for backward during one call of each (after one warm-up call outside the hooks)."""
    peaks = {}
    for name, call in calls.items():
        call()
        meter = ActivationMeter.for_parameters(params[name])
        with meter.measure():
            call()
        if dist.is_initialized():
            dist.barrier()
        peaks[name] = meter.peak_bytes
    return peaks


def interleaved(steps: dict[str, Callable[[], Any]], num_warmup: int, num_measured: int) -> dict[str, list[float]]:
    """Run the steps round-robin (A B A B ...) so slow phases of a noisy machine hit all of them alike."""
    for _ in range(num_warmup):
        for step in steps.values():
            timed(step)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(num_measured):
        order = list(steps) if index % 2 == 0 else list(reversed(steps))
        for name in order:
            times[name].append(timed(steps[name]))
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def machine_notes() -> str:
    """One line on the machine the numbers come from."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.machine()} {platform.processor() or 'cpu'}, {os.cpu_count()} logical cores shared with "
            f"other jobs (load average {load} at the end), torch {torch.__version__}, python "
            f"{platform.python_version()}, gloo over 127.0.0.1, 1 thread per rank")


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.2f}"


# ---- workloads -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A zoo model at a CPU size, a global batch and its micro-batch count: what every system runs."""

    model: str = BENCH_MODEL
    overrides: tuple[tuple[str, Any], ...] = ()
    global_batch_size: int = 32
    num_microbatches: int = 8
    seed: int = 0

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.overrides)

    def build(self) -> tuple[torch.nn.Module, tuple[Any, ...]]:
        """The model (weights from ``seed``) and example inputs of one micro-batch."""
        from fxpipe import models as zoo

        rows = self.global_batch_size // self.num_microbatches
        return zoo.build(self.model, batch_size=rows, seed=self.seed, **self.config)

    def batch(self) -> tuple[tuple[Any, ...], Any]:
        """The global batch every rank feeds (SPMD), the same on every rank."""
        from fxpipe import models as zoo

        return zoo.get(self.model).make_batch(self.global_batch_size, self.seed + 1, **self.config)

    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        from fxpipe import models as zoo

        return zoo.get(self.model).loss_fn

    def describe(self) -> str:
        sizes = ", ".join(f"{key}={value}" for key, value in self.overrides) or "zoo defaults"
        return (f"{self.model} ({sizes}), global batch {self.global_batch_size}, "
                f"{self.num_microbatches} micro-batches of {self.global_batch_size // self.num_microbatches}")


def stage_names(workload: Workload, num_stages: int) -> list[list[str]]:
    """The layer-cut stage node names for the workload's traced model (same on every rank)."""
    from fxpipe.passes import trace

    model, example_inputs = workload.build()
    return layer_cut_stages(trace(model, example_inputs), num_stages)


def compile_fxpipe(workload: Workload, num_stages: int, *, schedule: str = "early_backward",
                   warmup_policy: str = "A", torch_compile: Any = False, timeout_s: float = 60.0) -> Any:
    """fxpipe.compile of the workload with the layer-cut plan on this process group; a PipelinedModule
    (``torch_compile``, ``timeout_s``: as in ``fxpipe.compile``, docs/compile.md)."""
    import fxpipe
    from fxpipe.passes import trace

    model, example_inputs = workload.build()
    traced = trace(workload.build()[0], example_inputs)  # a separate copy: planning never touches the model
    plan = layer_cut_plan(traced, num_stages, workload.global_batch_size, workload.num_microbatches,
                          schedule=schedule, warmup_policy=warmup_policy)
    return fxpipe.compile(model, example_inputs, loss_fn=workload.loss_fn(),
                          global_batch_size=workload.global_batch_size, plan=plan, torch_compile=torch_compile,
                          timeout_s=timeout_s)


def zero_grads(parameters: Sequence[torch.nn.Parameter]) -> None:
    for parameter in parameters:
        parameter.grad = None


def bench_main(argv: list[str] | None, doc: str | None, results: Path,
               run_and_report: Callable[[int, int], str], *, steps: int, warmup: int) -> None:
    """The command line every runtime benchmark shares: --steps, --warmup, --write (the .md file)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--write", action="store_true", help=f"write {results.name}")
    args = parser.parse_args(argv)
    text = run_and_report(args.warmup, args.steps)
    print(text)
    if args.write:
        write_keeping_notes(results, text)


def short_layout(layout: str) -> str:
    """A layout of many stages by its stage and replica counts, anything after a space kept:
    ``"2:2:...:2 M=256"`` (64 stages) -> ``"64 x 2 M=256"``, mixed ones ``"64 stages: 32 x 1, 32 x 2 M=256"``."""
    head, _, rest = layout.partition(" ")
    parts = head.split(":")
    if len(parts) <= 4:
        return layout
    if len(set(parts)) == 1:
        text = f"{len(parts)} x {parts[0]}"
    else:
        text = f"{len(parts)} stages: " + ", ".join(f"{parts.count(w)} x {w}" for w in sorted(set(parts), key=int))
    return f"{text} {rest}".rstrip()
