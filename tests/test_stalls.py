"""Hangs end with a name: stalled ranks, chains of waiting ranks, slow-but-alive ranks and errors between steps (issue 26)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.schedule import Action, Op
from fxpipe.passes import trace
from fxpipe.runtime.faults.stalls import (
    Doing,
    SilenceClock,
    alive_cause,
    culprit,
    describe_action,
    stall_cause,
)
from tests.mp_utils import before_each_forward, join_world, plan_from_cuts, rank_context, start_ranks

ROOT = Path(__file__).resolve().parent.parent
ENTRY = zoo.get("mlp")
BATCH = 8
FAULT_STEP = 2
STALL_S = 3.0  # stall_timeout_s in the multi-rank tests
TIMEOUT_S = 8.0  # timeout_s (the receive timeout) in the multi-rank tests
SLEEP_S = 20.0  # how long a slow-but-alive rank sleeps: far beyond TIMEOUT_S


def _doing(step: int, action: str, waiting_on: int | None = None, waiting_for: str = "") -> Doing:
    return Doing(step, action, time.time() - 2.0, waiting_on, waiting_for, time.time() - 1.0)


def test_chains_of_waiting_ranks_end_at_the_stalled_or_busy_rank() -> None:
    """Exact data: rank 0 waits on 2, which waits on 1: 1 is blamed, stalled or not; a stalled rank off the
    chain is blamed over a busy one; a collective follows the rank that is not in it."""
    doings = {0: _doing(2, "receive gradient of micro-batch 0", 2, "receive gradient of 'x' of micro-batch 0"),
              1: _doing(2, "forward of micro-batch 0"),
              2: _doing(2, "receive activation of micro-batch 0", 1, "receive activation 'h' of micro-batch 0")}
    assert culprit(0, 2, doings, [1]) == [2, 1]
    assert culprit(0, 2, doings, []) == [2, 1]
    assert culprit(2, 1, doings, [0]) == [0]  # the chain ends at a busy rank; the stalled one is to blame
    in_collective = {rank: _doing(3, "allreduce", -1, "loss allreduce over all ranks") for rank in (0, 2)}
    assert culprit(0, -1, {**in_collective, 1: _doing(3, "forward of micro-batch 1")}, []) == [1]
    waited = type("W", (), {"peer": 2, "description": "receive gradient of 'x' of micro-batch 0"})()
    cause = stall_cause(0, waited, [2, 1], doings, 3.2, 2)  # type: ignore[arg-type]
    assert cause.startswith("rank 1 stalled: no heartbeat for 3.2 s (process stopped or frozen")
    assert "its last published status: step 2, forward of micro-batch 0;" in cause
    assert cause.endswith("(rank 0 waits on rank 2, which waits on rank 1)")
    alive = alive_cause(0, 2, "receive gradient of 'x'", [2, 1], doings, 8.0, "at step 2")
    assert alive is not None and alive.startswith(
        "rank 1 is alive but has not sent activation 'h' of micro-batch 0 for 1 s (last action: step 2, forward")
    assert describe_action(3, Action(Op.RECV_ACTIVATION, 1)) == "receive activation of micro-batch 1"
    assert describe_action(3, None).startswith("between steps (user code after step 3")
    clock = SilenceClock()
    assert clock.observe({0: 5, 1: 7}, 10.0) == {0: 0.0, 1: 0.0}
    assert clock.observe({0: 6, 1: 7}, 12.5) == {0: 0.0, 1: 2.5}


def _rank(rank: int, world_size: int, store_dir: str, results: Any, replicas: tuple[int, ...], faulty: int,
          how: str) -> None:
    """Train ``replicas``; in step FAULT_STEP rank ``faulty`` stops itself (``stop``: SIGSTOP at its first
    forward), sleeps SLEEP_S in its loss (``sleep_loss``) or before the step (``sleep_data``), or raises
    between steps (``raise_between``: its data step raises, as uncaught at the top of a script)."""
    torch.set_num_threads(1)
    join_world(store_dir, "stalls", rank, world_size)
    model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
    plan = plan_from_cuts(trace(model, example_inputs), replicas, BATCH, 4)
    step_box = [0]

    def loss_fn(output: Any, targets: Any) -> Any:
        if rank == faulty and how == "sleep_loss" and step_box[0] == FAULT_STEP:
            _note_fault(store_dir)
            time.sleep(SLEEP_S)
        return ENTRY.loss_fn(output, targets)

    pipe = fxpipe.compile(model, example_inputs, loss_fn=loss_fn, global_batch_size=BATCH, plan=plan,
                          timeout_s=TIMEOUT_S, stall_timeout_s=STALL_S)
    if rank == faulty and how == "stop":
        def stop() -> None:
            if step_box[0] == FAULT_STEP:
                _note_fault(store_dir)
                os.kill(os.getpid(), signal.SIGSTOP)

        before_each_forward(pipe.driver.runner, stop)
    try:
        for step in range(FAULT_STEP + 2):
            step_box[0] = step
            if rank == faulty and step == FAULT_STEP and how in ("sleep_data", "raise_between"):
                _note_fault(store_dir)
                if how == "sleep_data":
                    time.sleep(SLEEP_S)
                else:
                    _raise_as_uncaught(ValueError("the data loader failed"))
                    return
            inputs, targets = ENTRY.make_batch(BATCH, step, **ENTRY.tiny_overrides)
            pipe.step(inputs, targets)
        results.put((rank, "finished without noticing the fault", time.monotonic()))
    except Exception as error:  # the test checks what every survivor says, and when
        results.put((rank, f"{type(error).__name__}: {error}", time.monotonic()))


def _note_fault(store_dir: str) -> None:
    """When the fault happens (written at once: a queue's feeder thread would not send it before a SIGSTOP)."""
    Path(store_dir, "fault").write_text(repr(time.monotonic()))


def _raise_as_uncaught(error: Exception) -> None:
    """What the interpreter does with an error uncaught at the top of a script (a multiprocessing child's target
    gets traceback.print_exc instead, so the test calls the hook itself)."""
    try:
        raise error
    except ValueError:
        sys.excepthook(*sys.exc_info())  # type: ignore[arg-type]


def _run_fault(tmp_path: Path, replicas: tuple[int, ...], faulty: int, how: str) -> dict[int, tuple[str, float]]:
    """Every other rank's message and its delay after the fault (seconds)."""
    world_size = sum(replicas)
    context = rank_context()
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, world_size, str(tmp_path), results, replicas, faulty, how))
                 for rank in range(world_size)]
    start_ranks(context, processes)
    outcomes: dict[int, tuple[str, float]] = {}
    try:
        while len(outcomes) < world_size - 1:
            rank, message, at = results.get(timeout=120)
            outcomes[rank] = (message, at)
        for rank, process in enumerate(processes):  # survivors exit once they raised
            if rank != faulty:
                process.join(timeout=30)
                assert process.exitcode is not None, f"rank {rank} raised but did not exit"
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()  # the stopped or sleeping rank (SIGKILL ends a stopped process too)
                process.join()
    fault_at = float((tmp_path / "fault").read_text())
    return {rank: (message, at - fault_at) for rank, (message, at) in outcomes.items()}


def _report(what: str, outcomes: dict[int, tuple[str, float]]) -> None:
    """Detection times (docs/faults.md quotes them) and one survivor's message, shown with ``pytest -s``."""
    print(what, {rank: round(delay, 1) for rank, (_, delay) in sorted(outcomes.items())})
    print("  ", next(iter(outcomes.values()))[0])


# SIGSTOP at each position: a first-stage replica of 2:1 (the case: rank 0 used to blame rank 2,
# which only waited on rank 1), the middle and the last stage of 1:1:1.
@pytest.mark.multiprocess
@pytest.mark.parametrize(("replicas", "faulty"), [((2, 1), 1), ((1, 1, 1), 1), ((1, 1, 1), 2), ((1, 1, 1), 0)],
                         ids=["2:1-stop1", "1:1:1-stop1", "1:1:1-stop2", "1:1:1-stop0"])
def test_a_stopped_rank_is_named_by_every_survivor_within_the_stall_limit(
        tmp_path: Path, replicas: tuple[int, ...], faulty: int) -> None:
    outcomes = _run_fault(tmp_path, replicas, faulty, "stop")
    for rank, (message, delay) in outcomes.items():
        assert message.startswith("CommunicationError"), (rank, message)
        assert f"Root cause (the job's first failure): rank {faulty} stalled: no heartbeat for" in message, (rank, message)
        # the status is its heartbeat thread's last tick (0.1 s apart): the tiny model runs whole steps faster
        assert "its last published status: step " in message, message
        assert delay < STALL_S + 6.0, (rank, delay, message)  # the documented bound: stall limit + a few seconds
    _report("detection after the stop:", outcomes)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("replicas", "faulty", "how", "waits_for"), [
    ((2, 1), 2, "sleep_loss", "gradient of"), ((2, 1), 1, "sleep_data", "activation")],
    ids=["2:1-loss2", "2:1-data1"])
def test_a_slow_rank_whose_heartbeat_runs_is_alive_but_has_not_sent(
        tmp_path: Path, replicas: tuple[int, ...], faulty: int, how: str, waits_for: str) -> None:
    outcomes = _run_fault(tmp_path, replicas, faulty, how)
    for rank, (message, delay) in outcomes.items():
        assert f"rank {faulty} is alive but has not sent {waits_for}" in message, (rank, message)
        assert "stalled" not in message.split("Root cause")[-1], message
        assert TIMEOUT_S - 1.0 < delay < TIMEOUT_S + 8.0, (rank, delay, message)
    _report("detection after the sleep began:", outcomes)


@pytest.mark.multiprocess
def test_an_error_between_steps_is_the_root_cause_on_every_rank(tmp_path: Path) -> None:
    outcomes = _run_fault(tmp_path, (1, 1, 1), 1, "raise_between")
    for rank, (message, delay) in outcomes.items():
        assert ("Root cause (the job's first failure): rank 1 raised ValueError outside fxpipe, after step 1 "
                "(user code between steps") in message, (rank, message)
        assert delay < 5.0, (rank, delay, message)
    _report("detection after the error:", outcomes)


JOB = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import fxpipe
    from fxpipe import models as zoo

    torch.set_num_threads(1)
    entry = zoo.get("mlp")
    model, example_inputs = zoo.build("mlp", **entry.tiny_overrides)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=8, plan="2:1",
                          costs="analytic", num_microbatches=4)
    for step in range(4):
        if step == 2 and pipe.rank == 1:
            print(f"STOPPED at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        inputs, targets = entry.make_batch(8, step, **entry.tiny_overrides)
        pipe.step(inputs, targets)
    print(f"rank {pipe.rank} finished", flush=True)
""")


@pytest.mark.slow  # one torchrun launch of three workers: ~40 s, most of it torchrun's 30 s SIGTERM grace
def test_torchrun_job_with_a_stopped_worker_ends_naming_it(tmp_path: Path) -> None:
    """The issue's job (3 ranks, 2:1, default options, rank 1 SIGSTOPs in step 2) ends within a bound."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               "--monitor-interval", "0.2", str(script)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATE": "0",
           "CUDA_VISIBLE_DEVICES": ""}
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    ended = time.time()
    log = job.stdout + job.stderr
    (tmp_path / "torchrun.log").write_text(log)
    assert job.returncode != 0, log[-4000:]
    stopped = [float(line.split()[-1]) for line in log.splitlines() if line.startswith("STOPPED at")]
    assert stopped, log[-4000:]
    assert "Root cause (the job's first failure): rank 1 stalled: no heartbeat" in log, log[-4000:]
    elapsed = ended - stopped[0]
    print(f"torchrun job ended {elapsed:.1f} s after the stop")
    # stall limit (5 s) + torchrun's 30 s grace before it SIGKILLs the stopped worker + start-up slack
    assert elapsed < 60.0, (elapsed, log[-4000:])
