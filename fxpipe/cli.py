"""Command line: `fxpipe plan | simulate | show | train | calibrate | demo`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.core.cluster import Cluster
from fxpipe.core.schedule import TRAINING_SCHEDULES

if TYPE_CHECKING:  # matplotlib is optional: the plot module loads only when a plot is asked for
    from fxpipe.core.chain import CostChain
    from fxpipe.core.plan import Plan
    from fxpipe.sim.timeline_plot import Timeline


class CommandLineError(ValueError):
    """A command line that cannot be served (conflicting or missing options)."""


def _add_planning_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="local", help="preset (dapple-a, dapple-b, dapple-c, dgx-h100:2, local:4), "
                        "compact spec (4x8:h100) or JSON file")
    parser.add_argument("--global-batch", type=int, required=True, help="global batch size (rows per iteration)")
    parser.add_argument("--planner", default="dapple",
                        help="dapple (default), pipedream, gpipe, uniform, params, dp, megatron, exhaustive, markers "
                             "(cut at the model's pipe_split() calls; same as --layout markers)")
    parser.add_argument("--layout", default=None,
                        help="force replica counts per stage: 3:1, 1:1:1:1, dp; RxT for R replicas each a T-way "
                             "tensor-parallel group inside one host (48x8:48x8, 1x2:2); or markers: cut at the "
                             "model's pipe_split() calls, the planner picks replicas and placement")
    parser.add_argument("--num-microbatches", type=int, default=None, help="force M (default: planner chooses)")
    parser.add_argument("--schedule", default="early_backward", choices=[*sorted(TRAINING_SCHEDULES), "auto"],
                        help="early_backward (default, DAPPLE's 1F1B); zero_bubble splits backward (B, W); "
                             "auto: the planner picks per plan")
    parser.add_argument("--optimizer", default="adam", help="memory model: sgd, momentum, adam")
    parser.add_argument("--recompute", default="auto", help="activation recomputation in backward: auto (only "
                        "stages whose activations do not fit, narrowed per block), never, always, selective (attention cores only), "
                        "or per stage: keep,recompute,...")
    parser.add_argument("--allreduce-bucket-mb", type=float, default=25.0, help="gradient allreduce in buckets of "
                        "this many MiB overlapping the last backward (0: one allreduce after backward)")
    parser.add_argument("--batch-dims", default=None,
                        help="where the inputs hold the batch: one dim for every input (1 for a seq-first "
                             "(T, B, C) model) or name=dim pairs (x=1,mask=0); default dim 0 (docs/exactness.md)")
    parser.add_argument("--compare", action="store_true", help="also run every baseline planner")
    parser.add_argument("--json", dest="json_out", default=None, help="write the plan file here")
    parser.add_argument("--no-run-info", action="store_true",
                        help="leave the 'run' object (planning time, host, versions) out of the plan file, so "
                             "the same command writes the same bytes")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxpipe", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="plan a model or a profile file for a cluster")
    plan.add_argument("model", nargs="?", help="zoo name (gpt-mini, bert-48, ...) or package.module:factory")
    plan.add_argument("--profile", default=None, help="PipeDream/DAPPLE profile text instead of a model")
    plan.add_argument("--profile-batch", type=int, default=None, help="batch size the profile was measured at")
    plan.add_argument("--costs", default="auto", choices=["auto", "analytic", "measured"],
                      help="model path: block times measured on this machine (auto: for a local cluster) or the "
                           "analytic device model (auto: for preset and remote clusters; optimistic, see "
                           "docs/clusters.md)")
    plan.add_argument("--max-blocks", type=int, default=64, help="coarsen the graph to at most this many blocks")
    plan.add_argument("--threads", type=int, default=1, help="torch threads while timing blocks (--costs measured): "
                      "as many as each rank of `fxpipe train` uses (its --threads, default 1)")
    plan.add_argument("--sharding", default="none", help="ZeRO inside each stage's replica group: none (default), "
                      "auto (each stage the fastest level that fits), optimizer, gradients, parameters, or one "
                      "level per stage: none,optimizer,... (needs --layout or markers; docs/sharding.md)")
    plan.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16", "bf16-params"],
                      help="what the job trains in: fp32, or bf16/fp16 autocast (tensor-core matmuls, half-size "
                           "activations, fp32 master weights), or bf16-params (bf16 autocast on bf16 copies of the "
                           "fp32 masters, fp32 gradient sums; docs/sharding.md); recorded in the plan (docs/clusters.md)")
    plan.add_argument("--virtual-stages", default="1", type=_virtual_stages,
                      help="model chunks per device group (docs/virtual_stages.md): 1 (default), N, or auto (the "
                           "planner chooses, 1 included); with --schedule interleaved, interleaved_zero_bubble, zbv "
                           "(early_backward, zero_bubble and auto map to them)")
    plan.add_argument("--sequence-parallel", action="store_true",
                      help="cost tensor-parallel stages (RxT) running their norms and adds on token shards, as "
                           "`fxpipe train --sequence-parallel` runs them (default: whole on every group member, as "
                           "train runs them without the flag); recorded in the plan (docs/tensor_parallel.md)")
    _add_planning_options(plan)

    simulate = commands.add_parser("simulate", help="simulate a plan file's iteration")
    simulate.add_argument("plan_file", help="a plan file written by `fxpipe plan --json`")
    simulate.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace JSON here")
    simulate.add_argument("--plot", default=None, help="draw the timeline (a row per device) into this PNG "
                          "(needs the plot extra: pip install 'fxpipe[plot]')")
    simulate.add_argument("--compare-trace", default=None, help="with --plot: a measured trace "
                          "(`fxpipe train --measure --trace FILE`) drawn under the simulated timeline")

    show = commands.add_parser("show", help="print a plan file's stage table, or draw a trace file")
    show.add_argument("plan_file", help="a plan file, or with --plot a Chrome trace written by fxpipe")
    show.add_argument("--plot", default=None, help="draw the trace file's timeline into this PNG")
    show.add_argument("--schedule", action="store_true", help="also print the schedule table")

    from fxpipe.train_cli import add_train_arguments

    train = commands.add_parser("train", help="train a model under torchrun (one process per device)")
    add_train_arguments(train)

    calibrate = commands.add_parser("calibrate", help="measure this machine's ranks for the local cluster and cache "
                                    "the figures (starts local ranks with torchrun's launcher)")
    calibrate.add_argument("--nproc", type=int, default=2, help="local ranks to measure with (links: ranks 0 and 1)")

    demo = commands.add_parser("demo", help="plan and train a small GPT on 4 local CPU ranks")
    demo.add_argument("--nproc", type=int, default=4, help="number of local CPU ranks")
    demo.add_argument("--steps", type=int, default=40, help="training steps to run (default 40)")
    demo.add_argument("--layout", default="2:1:1",
                      help="replica layout; the default 2:1:1 shows a hybrid pipeline (the planner picks the cuts); "
                           "'auto' lets the planner choose everything (plain DP wins for a model this small)")
    return parser


def _bucket_bytes(mebibytes: float) -> int:
    if not mebibytes >= 0:  # also NaN
        raise CommandLineError(f"--allreduce-bucket-mb must be >= 0 (0: allreduce after backward), got {mebibytes}")
    return int(mebibytes * 2**20)


def _chain_for(args: argparse.Namespace, cluster: Cluster):  # type: ignore[no-untyped-def]
    from fxpipe import planning

    if args.profile:
        if args.model:
            raise CommandLineError("give either MODEL or --profile FILE, not both")
        if not args.profile_batch:
            raise CommandLineError("--profile needs --profile-batch N (the batch size it was measured at)")
        return planning.profile_chain(args.profile, args.profile_batch, max_blocks=args.max_blocks)
    if not args.model:
        raise CommandLineError("give MODEL (zoo name or package.module:factory) or --profile FILE")
    chain = _analytic_unless_affordable(args, cluster)
    if chain is not None:
        return chain
    device = planning.measuring_device(cluster) if args.costs == "measured" else "meta"
    model, example_inputs = planning.load_model(args.model, device=device)
    return planning.costed_model(model, example_inputs, cluster, costs=args.costs, max_blocks=args.max_blocks,
                                 batch_dims=_batch_dims(args), precision=args.precision,
                                  **planning.model_loss(args.model, example_inputs)).chain


def _analytic_unless_affordable(args: argparse.Namespace, cluster: Cluster) -> CostChain | None:
    """``--costs auto`` resolved to measured: keep it (None) if measuring fits the budget by the analytic model,
    else switch ``args.costs`` to analytic with a note and return the analytic chain (model built on meta)."""
    from fxpipe import planning

    if args.costs != "measured" or not args.costs_auto:
        return None
    model, example_inputs = planning.load_model(args.model, device="meta")
    chain = planning.costed_model(model, example_inputs, cluster, costs="analytic", max_blocks=args.max_blocks,
                                  batch_dims=_batch_dims(args), precision=args.precision,
                                   **planning.model_loss(args.model, example_inputs)).chain
    args.costs, args.cost_note = planning.affordable_costs(chain)
    return chain if args.costs == "analytic" else None


def _cost_source(args: argparse.Namespace, cluster: Cluster) -> str:
    """``--costs`` resolved: auto measures for a local cluster (the devices are here); a profile is its own source."""
    from fxpipe.planning import cost_source_of

    if args.profile:
        if args.costs != "auto" or args.precision != "fp32":
            option = f"--costs {args.costs}" if args.costs != "auto" else f"--precision {args.precision}"
            raise CommandLineError(f"{option} is for MODEL; a --profile file carries its own times")
        return "profile"
    return cost_source_of(args.costs, cluster)


def _run_plan(args: argparse.Namespace) -> int:
    import fxpipe.runtime.calibration.calibrate  # noqa: F401  (registers how the `local` cluster measures this machine)
    from fxpipe.core.chain import without_sequence_parallel
    from fxpipe.core.cluster import parse_cluster
    from fxpipe.core.planfile import save_plan_file
    from fxpipe.planning import REMEASURED_NOTE, labelled, plan_chain
    from fxpipe.report import format_plan

    cluster = parse_cluster(args.cluster)
    _time_blocks_like_a_rank(args.threads)
    args.costs_auto, args.cost_note = args.costs == "auto", ""
    args.costs = _cost_source(args, cluster)
    options = {"num_microbatches": args.num_microbatches, "schedule": args.schedule, "optimizer": args.optimizer,
               "recompute": args.recompute, "allreduce_bucket_bytes": _bucket_bytes(args.allreduce_bucket_mb),
               "compare": args.compare, "progress": sys.stderr.isatty(), "sharding": _sharding(args.sharding),
               "virtual_stages": args.virtual_stages, "sequence_parallel": args.sequence_parallel}
    if "markers" in (args.layout, args.planner):
        plan, chain = _marker_plan(args, cluster, options)
    else:
        chain = _chain_for(args, cluster)
        plan = plan_chain(chain, cluster, args.global_batch, planner=args.planner, layout=args.layout,
                          precision=args.precision, **options)
    chain = chain if args.sequence_parallel else without_sequence_parallel(chain)  # the chain the plan was costed on
    plan = labelled(plan.with_updates(model=args.model or f"profile:{Path(args.profile).name}"), args.costs)
    if args.cost_note:
        plan = plan.with_updates(notes=(*plan.notes, args.cost_note))
    if args.costs == "measured":
        plan = plan.with_updates(notes=(*plan.notes, REMEASURED_NOTE["plan"]))
    print(f"cluster {cluster.name}: {cluster.num_hosts} host(s) x {cluster.devices_per_host} {cluster.device.name}")
    print(format_plan(plan, chain, cluster))
    if args.json_out:
        save_plan_file(args.json_out, plan, chain, cluster, run=None if args.no_run_info else _run_info(plan))
        print(f"wrote {args.json_out}")
    return 0


def _virtual_stages(text: str) -> int | str:
    """``--virtual-stages``: ``auto`` or a positive integer."""
    if text.strip().lower() == "auto":
        return "auto"
    if not text.strip().isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a positive integer (chunks per device group)")
    return int(text)


def _time_blocks_like_a_rank(threads: int) -> None:
    """Measured block times are taken with the threads one training rank has: with torch's default (every core)
    a block timed here ran 2-10x slower on this project's loaded 2-core VM than on a 1-thread `fxpipe train`
    rank, and the plan cut elsewhere than `fxpipe train --plan LAYOUT` (which measures on its ranks)."""
    if threads < 1:
        raise CommandLineError(f"--threads {threads}: give at least 1 (the torch threads of one training rank)")
    import torch

    torch.set_num_threads(threads)


def _sharding(text: str) -> Any:
    """``--sharding`` parsed (:func:`fxpipe.core.sharding.parse_request`); a bad value is a CommandLineError."""
    from fxpipe.core.sharding import ShardingError, parse_request

    try:
        return parse_request(text)
    except ShardingError as error:
        raise CommandLineError(f"--sharding {text!r}: {error}") from None


def _run_info(plan: Plan) -> dict[str, Any]:
    """The plan file's ``"run"`` object: what differs between two runs of the same command."""
    import platform

    import fxpipe

    return {"planning_time_s": round(plan.planning_time_s, 3), "host": platform.node(),
            "fxpipe_version": fxpipe.__version__, "python_version": platform.python_version()}


def _batch_dims(args: argparse.Namespace) -> int | dict[str, int] | None:
    from fxpipe.train_cli import batch_dims_option

    return batch_dims_option(args)


def _marker_plan(args: argparse.Namespace, cluster: Cluster, options: dict[str, Any]):  # type: ignore[no-untyped-def]
    from fxpipe import planning

    if args.layout not in (None, "markers") or args.planner not in ("dapple", "markers"):
        raise CommandLineError(f"markers fix the cuts and let DAPPLE choose the layout; drop --layout {args.layout} "
                               f"/ --planner {args.planner}")
    if args.profile or not args.model:
        raise CommandLineError("markers need MODEL (its pipe_split() calls); a profile file has none")
    _analytic_unless_affordable(args, cluster)
    model, example_inputs = planning.load_model(args.model, device=planning.measuring_device(cluster)
                                                if args.costs == "measured" else "meta")
    return planning.plan_markers(model, example_inputs, cluster, args.global_batch, costs=args.costs,
                                 batch_dims=_batch_dims(args), precision=args.precision, **options)


def _load(path: str):  # type: ignore[no-untyped-def]
    from fxpipe.core.planfile import load_plan_file

    if _is_trace(path):
        raise CommandLineError(f"{path} is a trace (a timeline from `--trace`), not a plan file; draw it with "
                               f"`fxpipe show {path} --plot OUT.png`")
    return load_plan_file(path)


def _is_trace(path: str) -> bool:
    """Whether ``path`` holds a Chrome trace (``traceEvents``) rather than a plan; unreadable files are the loader's."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and "traceEvents" in data and "format_version" not in data


def _run_simulate(args: argparse.Namespace) -> int:
    from fxpipe.sim.chrome_trace import write_chrome_trace
    from fxpipe.sim.simulate import simulate
    from fxpipe.sim.virtual_simulate import simulate_virtual

    plan, chain, cluster = _load(args.plan_file)
    if chain is None or cluster is None:
        raise CommandLineError(f"{args.plan_file} holds no cost chain/cluster; write it with `fxpipe plan --json`")
    result = (simulate_virtual if plan.chunk_groups else simulate)(plan, chain, cluster)
    print(json.dumps({
        "layout": plan.layout,
        "iteration_time_s": result.iteration_time_s,
        "throughput_samples_per_s": result.throughput_samples_per_s,
        "bubble_fraction": result.bubble_fraction,
        "peak_memory_bytes": list(result.peak_memory_bytes),
    }, indent=2))
    if args.trace:
        write_chrome_trace(result, args.trace)
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if args.compare_trace and not args.plot:
        raise CommandLineError("--compare-trace draws next to the simulated timeline: add --plot OUT.png")
    if args.plot:
        from fxpipe.sim import timeline_plot

        title = (f"plan {plan.layout} M={plan.num_microbatches} {plan.schedule}/{plan.warmup_policy}: "
                 f"simulated iteration {1e3 * result.iteration_time_s:.1f} ms")
        timelines = [timeline_plot.timeline_bars(result.events, result.transfers, title)]
        if args.compare_trace:
            timelines.append(_trace_timeline(args.compare_trace))
        timeline_plot.save_timelines(timelines, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _trace_timeline(path: str) -> Timeline:
    from fxpipe.sim import timeline_plot

    try:
        trace = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CommandLineError(f"cannot read trace file {path!r}: {error}") from None
    return timeline_plot.timeline_from_chrome_trace(trace, timeline_plot.trace_title(trace, Path(path).name))


def _run_show(args: argparse.Namespace) -> int:
    from fxpipe.core.schedule import format_schedule, make_schedule
    from fxpipe.report import format_plan

    if args.plot:
        from fxpipe.sim import timeline_plot

        timeline_plot.save_timelines([_trace_timeline(args.plan_file)], args.plot)
        print(f"wrote {args.plot}")
        return 0
    plan, chain, cluster = _load(args.plan_file)
    print(format_plan(plan, chain, cluster))
    if args.schedule:
        print()
        print(format_schedule(make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches,
                                            plan.warmup_policy, plan.virtual_stages)))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a torchrun worker (a rank of ``calibrate``, ``train`` or ``demo``) then ends at once with
    the command's status (:func:`fxpipe.user_errors.exit_now`): its work is done and flushed, and interpreter
    teardown is where gloo's threads now and then aborted a finished rank."""
    status = _run_command(_build_parser().parse_args(argv))
    from fxpipe.user_errors import exit_now, torchrun_worker

    if torchrun_worker():
        exit_now(status)
    return status


def _run_command(args: argparse.Namespace) -> int:
    # MODEL may be module:factory in the current folder; `python -m fxpipe` finds it there, so the
    # console script does too.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from fxpipe.passes.trace_inputs import ExampleInputsTypeError

    try:
        if args.command == "plan":
            return _run_plan(args)
        if args.command == "simulate":
            return _run_simulate(args)
        if args.command == "show":
            return _run_show(args)
        if args.command == "calibrate":
            from fxpipe.runtime.launch import calibrate_command

            return calibrate_command(args.nproc)
        from fxpipe import train_cli

        if args.command == "train":
            return train_cli.run_train(args)
        return train_cli.run_demo(args)
    except (ValueError, ExampleInputsTypeError) as error:  # user mistakes: one clear line, no traceback
        from fxpipe.user_errors import report_user_error

        return report_user_error(args.command, error)  # once, from rank 0; status 2
