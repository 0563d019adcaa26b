"""fxpipe runtime overhead: a world-of-one fxpipe step (plan ``dp``, M=1) vs eager forward + loss + backward.

Run: python benchmarks/overhead.py [--device cpu|cuda] [--model gpt-mini] [--batch 16] [--autocast bf16]
     [--set n_layer=2] [--steps 30] [--warmup 3] [--torch-compile] [--write]

``--torch-compile``: both sides compiled with inductor (fxpipe's ``torch_compile=True`` against
``torch.compile(model)`` with its defaults, the loss left eager on both); each side's first step, which
compiles, is timed on its own, and the two are compared to float32 rounding (docs/compile.md).

Both run in one forked process on the CPU, in this process on CUDA (``fxpipe.compile`` makes its own world of
one: gloo on CPU with 1 thread, NCCL on CUDA) on separately built copies of the same model with the same weights and batch,
gradients set to None before each step, alternating step by step (A B B A ...), each step timed between
two device synchronisations. Before timing, the two sides' losses and gradients are compared (a
mismatch raises). The fxpipe step is everything ``PipelinedModule.step`` does: batch check, schedule
interpretation, the generated stage GraphModule, the loss, gradient and loss reductions. The per-step
budget counts what does not depend on machine load: operator events (torch.profiler; host syncs are
``aten::_local_scalar_dense``, collectives the ``c10d::`` ops) and Python function calls (cProfile),
one step of each side.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import Workload, machine_notes, median, zero_grads  # noqa: E402
from tests.mp_utils import run_ranks as run_forked  # noqa: E402

RESULTS = Path(__file__).with_suffix(".md")
HISTORY_MARKER = "<!-- history: kept by --write -->"
DEFAULT_WORKLOAD = Workload("gpt-mini", (("n_layer", 4), ("n_embd", 128), ("block_size", 64)), 16, 1)
TARGET_RATIO = 1.02
NUM_EXTRA_SHOWN = 8
GENERATED = "<eval_with_key>"  # the stage GraphModule's code: the model's own work (eager: the modules' forward)
AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
COUNTED = {"operator events": lambda name: True,
           "host syncs (_local_scalar_dense)": lambda name: name == "aten::_local_scalar_dense",
           "collectives (c10d::)": lambda name: name.startswith("c10d::"),
           "copies (aten::copy_)": lambda name: name == "aten::copy_",
           "allocations (aten::empty*)": lambda name: name.startswith("aten::empty")}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def _check_same(pipe: Any, model: torch.nn.Module, fx_loss: float, eager_loss: float, exact: bool,
                compiled: bool = False) -> None:
    """The two sides must compute the same loss and gradients (bf16: to bf16 rounding; compiled: inductor's
    kernels, chosen per side, to float32 rounding grown over the model's depth)."""
    rtol, atol = ((1e-3, 1e-5) if compiled else (1e-4, 1e-6)) if exact else (5e-2, 1e-3)
    if abs(fx_loss - eager_loss) > atol + rtol * abs(eager_loss):
        raise AssertionError(f"fxpipe loss {fx_loss} differs from eager loss {eager_loss}")
    eager = dict(model.named_parameters())
    for name, param in pipe.named_parameters():
        other = eager[name].grad
        if (param.grad is None) != (other is None) or (other is not None and not torch.allclose(
                param.grad, other, rtol=rtol, atol=atol)):
            raise AssertionError(f"gradient of {name!r} differs between fxpipe and eager")


def _budget(steps: dict[str, Callable[[], Any]]) -> tuple[dict[str, dict[str, int]], list[tuple[str, int, float]]]:
    """Per side, one step's counts of profiler events by kind and of Python function calls; and the
    functions only the fxpipe side calls, ``(function, calls, own seconds)`` by own time (cProfile)."""
    counts: dict[str, dict[str, int]] = {}
    called: dict[str, dict[str, tuple[int, float]]] = {}
    for name, step in steps.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        events = Counter(event.name for event in prof.events())
        counts[name] = {kind: sum(n for event, n in events.items() if match(event)) for kind, match in COUNTED.items()}
        profiler = cProfile.Profile()
        profiler.runcall(step)
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        called[name] = {f"{Path(file).name}:{line}({function})" if line else function: (stat[1], stat[2])
                        for (file, line, function), stat in stats.items()}
        counts[name]["Python function calls (cProfile)"] = sum(n for n, _ in called[name].values())
    extra = sorted(((function, n, seconds) for function, (n, seconds) in called["fxpipe"].items()
                    if function not in called["eager"] and not function.startswith(GENERATED)), key=lambda row: -row[2])
    return counts, extra


def overhead_rank(rank: int, world_size: int, store_dir: str, workload: Workload, device_name: str,
                  autocast: str, num_warmup: int, num_steps: int, torch_compile: bool = False) -> dict[str, Any]:
    import fxpipe

    device = torch.device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(1)  # one rank = one thread, as the local cluster runs them
    dtype = AUTOCAST[autocast]
    example_model, example_inputs = workload.build()
    pipe = fxpipe.compile(example_model, example_inputs, loss_fn=workload.loss_fn(),
                          global_batch_size=workload.global_batch_size, plan="dp", num_microbatches=1,
                          autocast_dtype=dtype, torch_compile=torch_compile)
    model = workload.build()[0].to(device)
    compiled_model = torch.compile(model) if torch_compile else model
    loss_fn = workload.loss_fn()
    inputs, targets = workload.batch()
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    targets = targets.to(device) if isinstance(targets, torch.Tensor) else targets
    fx_params, eager_params = list(pipe.parameters()), list(model.parameters())
    losses: dict[str, Any] = {}

    def fxpipe_step() -> None:
        zero_grads(fx_params)
        losses["fxpipe"] = pipe.step(inputs, targets)

    def eager_step() -> None:
        zero_grads(eager_params)
        with _autocast(device, dtype):
            loss = loss_fn(compiled_model(*inputs), targets)
        loss.backward()
        losses["eager"] = loss

    steps = {"fxpipe": fxpipe_step, "eager": eager_step}
    first_s = {name: _timed(steps[name], device) for name in steps}  # compiled: the step that compiles
    _check_same(pipe, model, losses["fxpipe"], float(losses["eager"]), dtype is None, torch_compile)
    for _ in range(num_warmup):
        for name in steps:
            _timed(steps[name], device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(num_steps):
        for name in list(steps) if index % 2 == 0 else list(reversed(steps)):
            times[name].append(_timed(steps[name], device))
    budget, extra = _budget(steps)
    pipe.close()
    return {"times": times, "budget": budget, "extra_functions": extra, "first_s": first_s}


def run(workload: Workload, *, device: str = "cpu", autocast: str = "none", num_warmup: int = 3,
        num_steps: int = 30, torch_compile: bool = False) -> dict[str, Any]:
    if torch.device(device).type == "cuda":  # in this process: a forked child cannot use CUDA once the parent
        # touched it (torch 2.11's optimizer step does, through torch.accelerator), and fxpipe.compile makes its
        # own world of one here all the same (NCCL)
        result = overhead_rank(0, 1, "", workload, device, autocast, num_warmup, num_steps, torch_compile)
    else:
        with tempfile.TemporaryDirectory() as store_dir:
            result = run_forked(overhead_rank, 1, store_dir, workload, device, autocast, num_warmup, num_steps,
                                torch_compile, timeout_s=1800.0)[0]
    times = result["times"]
    return {"workload": workload, "device": device, "autocast": autocast, "num_steps": num_steps,
            "torch_compile": torch_compile, "first_s": result["first_s"],
            "times": times, "budget": result["budget"], "extra_functions": result["extra_functions"],
            "median_s": {name: median(values) for name, values in times.items()},
            "paired_ratio": median([f / e for f, e in zip(times["fxpipe"], times["eager"], strict=True)])}


def report(result: dict[str, Any], command: str = "python benchmarks/overhead.py") -> str:
    workload: Workload = result["workload"]
    med, times, budget, extra = result["median_s"], result["times"], result["budget"], result["extra_functions"]
    ratio = med["fxpipe"] / med["eager"]
    compiled = result.get("torch_compile", False)
    names = {"fxpipe": "fxpipe torch_compile=True", "eager": "torch.compile(model)"} if compiled else {}
    rows = [[names.get(name, name), f"{med[name] * 1e3:.2f}", f"{min(times[name]) * 1e3:.2f}",
             f"{result['first_s'][name]:.2f}"] for name in ("fxpipe", "eager")]
    kinds = list(budget["fxpipe"])
    budget_rows = [[kind, budget["fxpipe"][kind], budget["eager"][kind], budget["fxpipe"][kind] - budget["eager"][kind]]
                   for kind in kinds]
    return "\n".join([
        f"## {workload.model} on {result['device']}, autocast {result['autocast']}"
        f"{', both sides compiled (inductor)' if compiled else ''}", "",
        f"Command: `{command}`", "", f"Workload: {workload.describe()}; plan `dp`, world of one.", "",
        f"Machine: {machine_notes()}.", "",
        tabulate(rows, ["system", "median step ms", "best step ms", "first step s"], tablefmt="github"), "",
        f"fxpipe / eager step time = **{ratio:.3f}** (medians of {result['num_steps']} alternating steps each); "
        f"median of per-pair ratios {result['paired_ratio']:.3f}; target <= {TARGET_RATIO} "
        f"({'met' if ratio <= TARGET_RATIO else 'MISSED'}).", "",
        "Per-step budget (one step each; counts do not depend on machine load):", "",
        tabulate(budget_rows, ["count per step", "fxpipe", "eager", "extra"], tablefmt="github"), "",
        f"Where the extra time goes: the functions only the fxpipe step calls take "
        f"{sum(row[2] for row in extra) * 1e3:.2f} ms of own time in one profiled step (cProfile; "
        f"load-dependent; the generated stage code is left out: it is the model's own forward); the largest:", "",
        tabulate([[f"`{function}`", n, f"{seconds * 1e3:.3f}"] for function, n, seconds in extra[:NUM_EXTRA_SHOWN]],
                 ["function", "calls", "own ms"], tablefmt="github"), ""])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--model", default=DEFAULT_WORKLOAD.model)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: 16 for gpt-mini)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                        help="model config override, e.g. --set n_layer=2 (repeatable)")
    parser.add_argument("--autocast", choices=sorted(AUTOCAST), default="none")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--torch-compile", action="store_true",
                        help="compile both sides with inductor (fxpipe torch_compile=True vs torch.compile(model))")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name} (keeps its history section)")
    args = parser.parse_args(argv)
    workload = DEFAULT_WORKLOAD if args.model == DEFAULT_WORKLOAD.model else Workload(args.model, (), 8, 1)
    overrides = dict(workload.overrides) | {key: int(value) for key, value in (item.split("=", 1) for item in args.set)}
    workload = Workload(workload.model, tuple(overrides.items()),
                        args.batch if args.batch is not None else workload.global_batch_size, 1)
    command = "python benchmarks/overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(run(workload, device=args.device, autocast=args.autocast, num_warmup=args.warmup,
                      num_steps=args.steps, torch_compile=args.torch_compile), command.strip())
    print(text)
    if args.write:
        old = RESULTS.read_text() if RESULTS.exists() else ""
        history = old[old.index(HISTORY_MARKER):] if HISTORY_MARKER in old else HISTORY_MARKER + "\n"
        RESULTS.write_text("# fxpipe runtime overhead (1 stage, world of one)\n\n" + text + "\n" + history)


if __name__ == "__main__":
    main()
