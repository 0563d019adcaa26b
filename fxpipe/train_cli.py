"""`fxpipe train` (one process per device under torchrun) and `fxpipe demo` (4 local CPU ranks)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEMO_MODEL = "gpt-mini"


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="zoo name or package.module:factory")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--plan", default="auto", help="auto, a layout such as 2:1:1, or a plan JSON file")
    parser.add_argument("--schedule", default="dapple", choices=["dapple", "gpipe"])
    parser.add_argument("--num-microbatches", type=int, default=None)
    parser.add_argument("--data", default="auto", choices=["auto", "stdlib", "random"],
                        help="stdlib: byte-level Python standard library text (language models); random: "
                             "the zoo's synthetic batches")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--measure", action="store_true",
                        help="record per-stage saved-activation peaks and a timeline every step")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="resume from the latest checkpoint here; save one on SIGTERM (preemption), at the end "
                             "and every --checkpoint-every steps")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="with --checkpoint-dir: steps between saves "
                        "(0: only at the end and on preemption)")
    parser.add_argument("--trace", default=None, help="with --measure: write the last step's measured timeline "
                        "(Chrome/Perfetto trace, same format as `fxpipe simulate --trace`)")


def _batches(args: argparse.Namespace, example_inputs: tuple[Any, ...]) -> Any:
    """A function step -> (inputs tuple, targets): the same global batch on every rank."""
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


def _stage_memory(stats: list[Any]) -> str:
    """Peak saved-activation bytes per stage (largest replica), e.g. ``act s0:1.2 MiB s1:0.4 MiB``."""
    from fxpipe.report import format_bytes

    peaks: dict[int, int] = {}
    for item in stats:
        peaks[item.stage_index] = max(peaks.get(item.stage_index, 0), item.peak_activation_bytes or 0)
    return "act " + " ".join(f"s{index}:{format_bytes(peaks[index])}" for index in sorted(peaks))


def _write_trace(path: str, stats: list[Any]) -> None:
    import json

    from fxpipe.simulate_trace import events_to_chrome_trace

    events = [event for item in stats for event in item.events]
    trace = events_to_chrome_trace(events, (), {"measured": True,
                                                "step_time_s": max(item.step_time_s for item in stats)})
    with open(path, "w") as handle:
        json.dump(trace, handle, sort_keys=True)


def run_train(args: argparse.Namespace) -> int:
    import fxpipe
    from fxpipe import models
    from fxpipe.report import format_plan
    from fxpipe.runtime import preemption

    preemption.install()  # first: SIGTERM before the handler would kill the rank without a checkpoint
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model, example_inputs = models.build(args.model)
    entry = models.get(args.model)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=args.global_batch,
                          plan=args.plan, schedule=args.schedule, num_microbatches=args.num_microbatches)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=args.lr)
    first_step = _resume(args, pipe, optimizer)
    leader = pipe.rank == 0
    if leader:
        print(format_plan(pipe.plan), flush=True)
    pipe.measure = args.measure
    start = time.perf_counter()
    losses, stats, last_step = _train_steps(args, pipe, optimizer, _batches(args, example_inputs), first_step)
    if leader and pipe.preempted and not args.checkpoint_dir:
        print(f"preempted: stopped after step {last_step} (no --checkpoint-dir: nothing saved)", flush=True)
    if leader and losses:
        elapsed = time.perf_counter() - start
        num_steps = last_step - first_step
        print(f"trained {num_steps} steps in {elapsed:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f} "
              f"({num_steps * args.global_batch / elapsed:.0f} samples/s)", flush=True)
        if args.trace and stats:
            _write_trace(args.trace, stats)
            print(f"wrote measured timeline {args.trace}", flush=True)
    pipe.close()
    return 0


def _train_steps(args: argparse.Namespace, pipe: Any, optimizer: torch.optim.Optimizer, batches: Any,
                 first_step: int) -> tuple[list[float], list[Any], int]:
    """Steps ``first_step..--steps`` (checkpoints as asked); stops early, saved, once every rank agrees on a preemption.

    Returns the losses, the last step's stats (with --measure) and the number of steps done in all.
    """
    leader = pipe.rank == 0
    progress = None
    if leader and not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=first_step, unit="step", file=sys.stdout)
    losses: list[float] = []
    stats: list[Any] = []
    last_step = first_step
    for step in range(first_step, args.steps):
        step_start = time.perf_counter()
        inputs, targets = batches(step)
        loss = pipe.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        step_time = time.perf_counter() - step_start
        if args.measure:
            stats = pipe.step_stats()  # a collective: every rank takes part
        if progress is not None:
            memory = _stage_memory(stats) if stats else ""
            progress.set_postfix_str(f"loss {loss:.3f} {args.global_batch / step_time:.0f} samples/s {memory}")
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
    return losses, stats, last_step


def _resume(args: argparse.Namespace, pipe: Any, optimizer: torch.optim.Optimizer) -> int:
    """The step to start at: that of the latest checkpoint in ``--checkpoint-dir`` (loaded), else 0."""
    from fxpipe.checkpoint import latest_checkpoint

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
