"""`fxpipe train` (one process per device under torchrun) and `fxpipe demo` (4 local CPU ranks)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fxpipe.core.schedule import schedule_names
from fxpipe.core.utilization import utilization_text, utilization_warning

DEMO_MODEL = "gpt-mini"


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name or package.module:factory (returning (model, example_inputs))")
    parser.add_argument("--loss", default=None, help="cross_entropy, mse or package.module:function(output, "
                        "targets); required for a factory, overrides a zoo model's own loss")
    parser.add_argument("--global-batch", type=int, default=32, help="rows per training step, over all ranks "
                        "(every rank loads the same batch; default 32)")
    parser.add_argument("--steps", type=int, default=20, help="training steps to run (default 20)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    parser.add_argument("--plan", default="auto", help="auto, markers (cut at pipe_split() calls), a layout such "
                        "as 2:1:1, or a plan JSON file")
    parser.add_argument("--schedule", default="dapple", choices=[*schedule_names(), "auto"],
                        help="order of forward and backward passes: dapple (default, early backward, 1F1B), gpipe, "
                             "zero_bubble (backward split in two), auto (the planner picks); docs/glossary.md")
    parser.add_argument("--num-microbatches", type=int, default=None,
                        help="split each step's batch into this many micro-batches (default: the planner chooses)")
    parser.add_argument("--recompute", default="auto", help="activation recomputation: auto (where activations do "
                        "not fit, narrowed per block), never, always, selective (attention cores only), or per stage "
                        "keep,recompute,...; a plan file's choices stay with auto")
    parser.add_argument("--sharding", default=None, type=_sharding_argument,
                        help="ZeRO inside each stage's replica group (FSDP2, docs/sharding.md): none, optimizer, "
                             "gradients, parameters, per stage level,level,..., or auto (the planner picks per "
                             "stage); default: a plan file's levels, unsharded for plans made here")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="on stages of T-way tensor-parallel groups (RxT), run norms and adds between the split "
                             "pairs on token shards (docs/tensor_parallel.md); the tokens must divide by T")
    parser.add_argument("--data", default="auto",
                        help="stdlib: byte-level Python standard library text (language models); random: "
                             "synthetic batches (the zoo's, or for a factory random inputs shaped like its example "
                             "inputs); package.module:function(global_batch, step) -> (inputs, targets)")
    parser.add_argument("--batch-dims", default=None,
                        help="where the inputs hold the batch: one dim for every input (1 for a seq-first "
                             "(T, B, C) model) or name=dim pairs (x=1,mask=0); default dim 0 (docs/exactness.md)")
    parser.add_argument("--target-batch-dim", type=int, default=None,
                        help="the targets' batch dim (default: --batch-dims when one dim, else 0)")
    parser.add_argument("--costs", default="auto", choices=["auto", "measured", "analytic"],
                        help="planner block times: measured on the launched ranks (auto, measured) or the analytic "
                             "device model (docs/clusters.md, Honest predictions)")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16", "bf16-params"],
                        help="train in fp32 or under bf16/fp16 autocast (fp32 master weights); bf16-params: bf16 "
                             "autocast with bf16 compute copies of the fp32 masters, gradients reduced in fp32 "
                             "(docs/sharding.md); the planner costs the model in it; default: a plan file's "
                             "precision, else fp32")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights and the data order "
                        "(default 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--measure", action="store_true",
                        help="record per-stage saved-activation peaks and a timeline every step")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="resume from the latest checkpoint here; save one on SIGTERM (preemption), at the end "
                             "and every --checkpoint-every steps")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="with --checkpoint-dir: steps between saves "
                        "(0: only at the end and on preemption)")
    parser.add_argument("--stall-timeout", type=float, default=5.0, help="seconds without a heartbeat after which "
                        "a rank is named as stalled on every rank, which then exit (docs/faults.md)")
    parser.add_argument("--torch-compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                        help="compile each stage with torch.compile (default backend inductor; e.g. aot_eager); the "
                             "first step pays the compile, reported per stage at the end (docs/compile.md)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds a rank waits for a peer (default 60; "
                        "600 with --torch-compile: the first step waits for earlier stages' compiles)")
    parser.add_argument("--json", dest="json_out", default=None, metavar="PLAN", help="write the plan this run "
                        "trains with (rank 0) to this file: the plan file format `fxpipe show` and --plan read")
    parser.add_argument("--trace", default=None, help="with --measure: write the last step's measured timeline "
                        "(Chrome/Perfetto trace, same format as `fxpipe simulate --trace`)")


def _sharding_argument(text: str) -> Any:
    """``--sharding``: parsed by :func:`fxpipe.core.sharding.parse_request`; argparse reports a ShardingError."""
    from fxpipe.core.sharding import ShardingError, parse_request

    try:
        return parse_request(text)
    except ShardingError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _batches(args: argparse.Namespace, example_inputs: Any) -> Any:
    """A function step -> (inputs, targets) for a zoo model: the same global batch on every rank."""
    from fxpipe import models
    from fxpipe.data import TextBatches, stdlib_corpus

    use_text = args.data == "stdlib" or (args.data == "auto" and args.model.startswith("gpt"))
    if use_text:
        block_size = int(example_inputs[0].shape[1])
        text = TextBatches(stdlib_corpus(), block_size=block_size, batch_size=args.global_batch, seed=args.seed)

        def text_batch(step: int) -> tuple[tuple[Any, ...], Any]:
            inputs, targets = text.batch(step)
            return (inputs,), targets

        return text_batch
    entry = models.get(args.model)
    return lambda step: entry.make_batch(args.global_batch, seed=args.seed * 1_000_003 + step)


def _workload(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, Any, Any]:
    """(model, example_inputs, loss_fn, batches) for a zoo name or a ``package.module:factory``."""
    from fxpipe import models
    from fxpipe.models.registry import load_callable, resolve_loss
    from fxpipe.planning import load_model

    model, example_inputs = load_model(args.model)
    factory = ":" in args.model
    if factory and args.loss is None:
        raise ValueError(f"{args.model} is a factory: give its loss with --loss (cross_entropy, mse or "
                         "package.module:function)")
    loss_fn = resolve_loss(args.loss) if args.loss is not None else models.get(args.model).loss_fn
    if ":" in args.data:
        data = load_callable(args.data, "data")
        return model, example_inputs, loss_fn, lambda step: data(args.global_batch, step)
    if not factory:
        return model, example_inputs, loss_fn, _batches(args, example_inputs)
    if args.data not in ("auto", "random"):
        raise ValueError(f"--data {args.data} is for zoo models; a factory takes --data random or "
                         "--data package.module:function")
    return model, example_inputs, loss_fn, synthetic_batches(model, example_inputs, args.global_batch,
                                                             classes=args.loss == "cross_entropy", seed=args.seed)


def _random_like(example: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    shape = (rows, *example.shape[1:])
    if example.is_floating_point():
        return torch.randn(shape, generator=generator, dtype=example.dtype)
    if example.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    high = int(example.max()) + 1 if example.numel() else 2  # token ids / masks stay in the example's range
    return torch.randint(0, max(high, 2), shape, generator=generator, dtype=example.dtype)


def synthetic_batches(model: torch.nn.Module, example_inputs: Any, global_batch: int, *, classes: bool,
                      seed: int) -> Any:
    """step -> (inputs, targets): random inputs shaped like ``example_inputs`` (rows = ``global_batch``) and
    random targets shaped like the model's output: class ids in ``[0, output.shape[-1])`` when ``classes``
    (a cross-entropy loss), standard normal values otherwise. Deterministic in ``seed`` and step."""
    with torch.no_grad():
        output = model(**example_inputs) if isinstance(example_inputs, dict) else model(*example_inputs)
    if not isinstance(output, torch.Tensor):
        raise ValueError(f"the model returns a {type(output).__name__}, so random targets cannot be shaped; give "
                         "--data package.module:function(global_batch, step) -> (inputs, targets)")

    def batch(step: int) -> tuple[Any, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        if isinstance(example_inputs, dict):
            inputs: Any = {name: _random_like(value, global_batch, generator) for name, value in example_inputs.items()}
        else:
            inputs = tuple(_random_like(value, global_batch, generator) for value in example_inputs)
        if classes:
            targets = torch.randint(0, output.shape[-1], (global_batch, *output.shape[1:-1]), generator=generator)
        else:
            targets = torch.randn((global_batch, *output.shape[1:]), generator=generator)
        return inputs, targets

    return batch


def _check_plan_file(args: argparse.Namespace) -> str:
    """The precision to train in (``--precision``, else a plan file's, else fp32). A plan file made for another
    MODEL fails here, naming both, rather than deep in codegen."""
    from fxpipe.core.plan import Plan, plan_argument_kind

    if plan_argument_kind(args.plan) != "file":
        return str(args.precision or "fp32")
    plan = Plan.load(args.plan)
    if plan.model and plan.model != args.model:
        raise ValueError(f"plan file {args.plan} was made for model {plan.model!r}, not {args.model!r}; "
                         f"re-plan with `fxpipe plan {args.model} ... --json FILE`")
    return str(args.precision or plan.precision)


def _stage_memory(stats: list[Any]) -> str:
    """Peak saved-activation bytes per stage (largest replica), e.g. ``kept for backward s0:1.2 MiB s1:0.4 MiB``."""
    from fxpipe.report import format_bytes

    peaks: dict[int, int] = {}
    for item in stats:
        peaks[item.stage_index] = max(peaks.get(item.stage_index, 0), item.peak_activation_bytes or 0)
    return "kept for backward " + " ".join(f"s{index}:{format_bytes(peaks[index])}" for index in sorted(peaks))


def _write_trace(path: str, stats: list[Any]) -> None:
    import json

    from fxpipe.sim.chrome_trace import events_to_chrome_trace

    events = [event for item in stats for event in item.events]
    trace = events_to_chrome_trace(events, (), {"measured": True,
                                                "step_time_s": max(item.step_time_s for item in stats)})
    with open(path, "w") as handle:
        json.dump(trace, handle, sort_keys=True)


def batch_dims_option(args: argparse.Namespace) -> int | dict[str, int] | None:
    """``--batch-dims`` parsed (None when not given)."""
    from fxpipe.passes.batchdims import parse_batch_dims

    return None if args.batch_dims is None else parse_batch_dims(args.batch_dims)


def torch_compile_option(args: argparse.Namespace) -> bool | dict[str, str]:
    """``--torch-compile [BACKEND]`` as ``fxpipe.compile``'s ``torch_compile``."""
    if args.torch_compile is None:
        return False
    return True if args.torch_compile == "inductor" else {"backend": args.torch_compile}


def timeout_option(args: argparse.Namespace) -> float:
    """``--timeout``, else 60 s, or 600 s with ``--torch-compile`` (a cold compile of a stage can take minutes)."""
    if args.timeout is not None:
        return float(args.timeout)
    return 60.0 if args.torch_compile is None else 600.0


def run_train(args: argparse.Namespace) -> int:
    import fxpipe
    from fxpipe.planning import autocast_dtype, param_dtype
    from fxpipe.runtime.faults import preemption

    preemption.install()  # first: SIGTERM before the handler would kill the rank without a checkpoint
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    precision = _check_plan_file(args)
    model, example_inputs, loss_fn, batches = _workload(args)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=loss_fn, global_batch_size=args.global_batch,
                          plan=args.plan, schedule=args.schedule, num_microbatches=args.num_microbatches,
                          recompute=args.recompute, sharding=args.sharding, batch_dims=batch_dims_option(args),
                          target_batch_dim=args.target_batch_dim, costs=args.costs,
                          autocast_dtype=autocast_dtype(precision), param_dtype=param_dtype(precision),
                          stall_timeout_s=args.stall_timeout,
                          torch_compile=torch_compile_option(args), timeout_s=timeout_option(args), verbose=True,
                          sequence_parallel=args.sequence_parallel)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    if precision == "fp16":  # loss scaling, overflow agreed over the job; before _resume, which restores its state
        pipe.grad_scaler()
    first_step = _resume(args, pipe, optimizer)
    leader = pipe.rank == 0
    if leader and args.json_out:
        pipe.plan.with_updates(model=pipe.plan.model or args.model).save(args.json_out)
        print(f"wrote the plan it runs to {args.json_out} (fxpipe show {args.json_out}; fxpipe train --plan "
              f"{args.json_out} runs it again)", flush=True)
    # saved-activation bytes cannot be told apart from FSDP2's gathered weights: a sharded plan measures its timeline
    sharded = any(stage.sharding != "none" for stage in pipe.plan.stages)
    pipe.measure = "timeline" if args.measure and sharded else args.measure
    start = time.perf_counter()
    losses, stats, last_step, step_times = _train_steps(args, pipe, optimizer, batches, first_step)
    compiled = pipe.compile_stats() if args.torch_compile is not None else None  # a collective: every rank
    if leader and compiled is not None and step_times:
        from fxpipe.runtime.compile.stage_compile import format_compile_stats

        print(f"{format_compile_stats(compiled)}\nfirst step {step_times[0]:.1f} s (compiling), then median "
              f"{statistics.median(step_times[1:] or step_times) * 1e3:.4g} ms", flush=True)
    if leader and pipe.preempted and not args.checkpoint_dir:
        print(f"preempted: stopped after step {last_step} (no --checkpoint-dir: nothing saved)", flush=True)
    if leader and losses:
        elapsed = time.perf_counter() - start
        num_steps = last_step - first_step
        median_step_s = statistics.median(step_times) if step_times else None
        utilization = utilization_text(pipe.plan, median_step_s) if median_step_s is not None else ""
        print(f"trained {num_steps} steps in {elapsed:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"({num_steps * args.global_batch / elapsed:.0f} samples/s"
              + (f"; median step: {utilization}" if utilization else "") + ")", flush=True)
        print(prediction_check(pipe.plan, step_times, measuring=args.measure), flush=True)
        warning = utilization_warning(pipe.plan, median_step_s) if median_step_s is not None else ""
        if warning:
            print(warning, flush=True)
        if args.trace and stats:
            _write_trace(args.trace, stats)
            print(f"wrote measured timeline {args.trace}", flush=True)
    pipe.close()
    return 0


def _train_steps(args: argparse.Namespace, pipe: Any, optimizer: torch.optim.Optimizer, batches: Any,
                 first_step: int) -> tuple[list[float], list[Any], int, list[float]]:
    """Steps ``first_step..--steps`` (checkpoints as asked); stops early, saved, once every rank agrees on a preemption.

    Returns the losses, the last step's stats (with --measure), the number of steps done in all and
    each iteration's seconds (``pipe.step`` and the optimizer step, what the plan predicts; loading the
    batch and checkpoints left out).
    """
    leader = pipe.rank == 0
    progress = None
    if leader and not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=first_step, unit="step", file=sys.stdout)
    losses: list[float] = []
    stats: list[Any] = []
    step_times: list[float] = []
    last_step = first_step
    for step in range(first_step, args.steps):
        step_start = time.perf_counter()
        inputs, targets = batches(step)
        pipe_start = time.perf_counter()
        loss = pipe.step(inputs, targets)
        if pipe.scaler is not None:  # fp16: skips a step that overflowed on any rank, on every rank
            pipe.scaler.step(optimizer)
            pipe.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - pipe_start)
        losses.append(loss)
        step_time = time.perf_counter() - step_start
        if args.measure:
            stats = pipe.step_stats()  # a collective: every rank takes part
        if progress is not None:
            # a timeline-only step (a sharded plan's --measure) has no saved-activation peaks to show
            memory = _stage_memory(stats) if stats and stats[0].peak_activation_bytes is not None else ""
            utilization = utilization_text(pipe.plan, step_time)  # measured step: MFU and tokens/s per device
            progress.set_postfix_str(f"loss {loss:.3f} {args.global_batch / step_time:.0f} samples/s "
                                     + (f"{utilization} " if utilization else "") + memory)
            progress.update(1)
        last_step = step + 1
        if _checkpoint_due(args, pipe, last_step):
            saved = pipe.save(Path(args.checkpoint_dir) / f"step-{last_step:06d}", optimizer=optimizer, step=last_step)
            if leader and pipe.preempted:
                print(f"preempted: stopped after step {last_step}, checkpoint {saved}", flush=True)
        if pipe.preempted:  # the same on every rank after the same step
            break
    if progress is not None:
        progress.close()
    return losses, stats, last_step, step_times


def prediction_check(plan: Any, step_times: list[float], *, measuring: bool = False) -> str:
    """``median step X ms vs predicted Y ms (cost source)``: the plan's prediction next to what the iterations took.

    The first step is left out when there are others (it pays one-time costs); with --measure the
    steps also record timelines and saved-tensor peaks, so they run slower than predicted.
    """
    timed = step_times[1:] if len(step_times) > 1 else step_times
    line = f"median step {statistics.median(timed) * 1e3:.4g} ms over {len(timed)} steps"
    if plan.predicted is None:
        return line
    source = plan.predicted.cost_source or "unrecorded"
    line += f"; predicted {plan.predicted.iteration_time_s * 1e3:.4g} ms ({source} block costs)"
    return line + ("; these steps also recorded their timelines and memory peaks, which slows them" if measuring
                   else "")


def _resume(args: argparse.Namespace, pipe: Any, optimizer: torch.optim.Optimizer) -> int:
    """The step to start at: that of the latest checkpoint in ``--checkpoint-dir`` (loaded), else 0."""
    from fxpipe.core.checkpoint import latest_checkpoint

    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every {args.checkpoint_every} is negative; use 0 (end and preemption "
                         "only) or a number of steps")
    if not args.checkpoint_dir:
        return 0
    found = latest_checkpoint(args.checkpoint_dir)
    if found is None:
        return 0
    step = int(pipe.load(found, optimizer=optimizer)["step"])
    if pipe.rank == 0:
        print(f"resuming at step {step} from {found}", flush=True)
    return step


def _checkpoint_due(args: argparse.Namespace, pipe: Any, step: int) -> bool:
    """Save after this step? On preemption, at the last step, and every ``--checkpoint-every`` steps."""
    if not args.checkpoint_dir:
        return False
    every = args.checkpoint_every
    return bool(pipe.preempted) or step == args.steps or (every > 0 and step % every == 0)


def run_demo(args: argparse.Namespace) -> int:
    """Start ``--nproc`` local CPU ranks with torchrun's own launcher, training gpt-mini on stdlib text."""
    from fxpipe.runtime.launch import launch_local

    train_args = ["train", DEMO_MODEL, "--global-batch", "32", "--steps", str(args.steps), "--data", "stdlib",
                  "--num-microbatches", "8", "--measure", "--plan", args.layout]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return launch_local(args.nproc, train_args)
