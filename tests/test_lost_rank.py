"""Surviving a lost rank: the others fail fast naming it, and torchrun restarts resume from the last checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from fxpipe.runtime.faults import failures
from fxpipe.runtime.faults.errors import BatchShapeError
from tests.mp_utils import (
    before_each_forward,
    eager_weights,
    join_world,
    plan_from_cuts,
    rank_context,
    reserved_port,
    start_ranks,
)

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
ENTRY = zoo.get("mlp")
BATCH = 8
KILL_STEP = 2


def _explain_while_beating(log: failures.FailureLog, beating_ranks: tuple[int, ...], peer: int,
                           description: str, error: Exception) -> str:
    """``log.explain(...)`` while a thread keeps the heartbeats of ``beating_ranks`` going."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.05):
            for rank in beating_ranks:
                log.store.add(log.prefix + f"alive/{rank}", 1)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        return log.explain(peer, description, error)
    finally:
        stop.set()
        thread.join()


def test_failure_log_names_the_silent_rank_and_keeps_the_first_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact data: a rank whose heartbeat stopped is named over the peer that errored; an alive peer is
    named as not answering; the first record stands; refusals are not recorded."""
    monkeypatch.setattr(failures, "DEAD_AFTER_S", 0.3)
    store = torch.distributed.HashStore()
    log = failures.FailureLog(store, rank=0, world_size=3, namespace="t")
    log.step_index = 4
    cause = _explain_while_beating(log, (2,), 2, "receive gradient of 'x' of micro-batch 1 with rank 2",
                                   RuntimeError("closed"))
    assert cause == ("rank 1 unreachable (no heartbeat for 0.3 s: process died or froze) at step 4, noticed by "
                     "rank 0 during receive gradient of 'x' of micro-batch 1 with rank 2")
    later = failures.FailureLog(store, rank=2, world_size=3, namespace="t")
    later.note_error(ValueError("not first"))
    assert later.explain(0, "anything", RuntimeError("x")) == cause
    stalled = failures.FailureLog(store, rank=0, world_size=2, namespace="v")
    cause = _explain_while_beating(stalled, (1,), 1, "receive activation 'h' of micro-batch 0 with rank 1",
                                   RuntimeError("timed out"))
    assert cause == ("rank 1 failed to communicate (its heartbeat still runs: stalled, or running another plan or "
                     "batch) at step -1, noticed by rank 0 during receive activation 'h' of micro-batch 0 with "
                     "rank 1: timed out")
    fresh = failures.FailureLog(store, rank=1, world_size=3, namespace="u")
    fresh.note_error(BatchShapeError("every rank refuses this batch"))  # a refusal: not a root cause
    assert fresh.recorded() is None
    fresh.note_error(ZeroDivisionError("in the loss"))
    assert fresh.recorded() == "rank 1 raised ZeroDivisionError at step -1: in the loss"


def _rank_until_killed(rank: int, world_size: int, store_dir: str, results: Any, replicas: tuple[int, ...],
                       lost_rank: int, how: str = "kill") -> None:
    """Train a pipeline of ``replicas``; rank ``lost_rank`` SIGKILLs itself (``how="kill"``) or raises
    RuntimeError (``"raise"``) in the middle of step KILL_STEP."""
    torch.set_num_threads(1)
    if store_dir.startswith("tcp://"):  # rank 0 serves the store: killing it takes the store down too
        torch.distributed.init_process_group("gloo", init_method=store_dir, rank=rank, world_size=world_size,
                                             timeout=timedelta(seconds=30))
    else:
        join_world(store_dir, "lost", rank, world_size)
    model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
    plan = plan_from_cuts(trace(model, example_inputs), replicas, BATCH, 4)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan=plan,
                          timeout_s=20.0)
    step_box = [0]
    if rank == lost_rank:  # die at this rank's first forward of the step: mid-iteration for everyone
        def die() -> None:
            if step_box[0] == KILL_STEP and how == "raise":
                raise RuntimeError("loss exploded")
            if step_box[0] == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)

        before_each_forward(pipe.driver.runner, die)
    try:
        for step in range(KILL_STEP + 2):
            step_box[0] = step
            inputs, targets = ENTRY.make_batch(BATCH, step, **ENTRY.tiny_overrides)
            pipe.step(inputs, targets)
        results.put((rank, "finished without noticing the lost rank", time.monotonic()))
    except Exception as error:  # the test checks that every survivor fails, and with which message
        results.put((rank, f"{type(error).__name__}: {error}", time.monotonic()))


def _descendants(pids: set[int]) -> list[str]:
    """Live processes (not zombies) among ``pids`` and their descendants, read from /proc."""
    parents: dict[int, int] = {}
    states: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            states[int(entry.name)], parents[int(entry.name)] = fields[0], int(fields[1])
    found, frontier = set(), set(pids)
    while frontier:
        found |= frontier
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
    return [f"pid {pid} ({states[pid]})" for pid in sorted(found) if pid in states and states[pid] != "Z"]


# Each layout with its first-stage replica, middle and last rank killed (issue 14 item 2): a transport
# error only names a neighbour (in 2:1, rank 0 used to blame rank 2, a survivor that had exited).
# "tcp": rendezvous through a TCPStore served by rank 0 (env:// without torchrun), which dies with it.
@pytest.mark.parametrize(("replicas", "lost_rank", "store"), [
    ((2, 1), 0, "file"), ((2, 1), 1, "file"), ((2, 1), 2, "file"), ((1, 1, 1), 0, "file"), ((1, 1, 1), 1, "file"),
    ((1, 1, 1), 2, "file"), ((2, 1), 0, "tcp")],
    ids=lambda value: ":".join(map(str, value)) if isinstance(value, tuple) else (
        f"kill{value}" if isinstance(value, int) else value))
def test_survivors_exit_fast_naming_the_lost_rank(tmp_path: Path, replicas: tuple[int, ...], lost_rank: int,
                                                  store: str) -> None:
    with reserved_port() as port:
        _kill_and_check(tmp_path, replicas, lost_rank, str(tmp_path) if store == "file" else f"tcp://127.0.0.1:{port}")


def _kill_and_check(tmp_path: Path, replicas: tuple[int, ...], lost_rank: int, rendezvous: str) -> None:
    world_size = sum(replicas)
    context = rank_context()  # fork, or spawn where this process initialised CUDA
    results = context.Queue()
    processes = [context.Process(target=_rank_until_killed,
                                 args=(rank, world_size, rendezvous, results, replicas, lost_rank))
                 for rank in range(world_size)]
    start_ranks(context, processes)
    pids = {process.pid for process in processes if process.pid is not None}
    processes[lost_rank].join(timeout=60)
    killed_at = time.monotonic()
    assert processes[lost_rank].exitcode == -signal.SIGKILL
    survivors = [rank for rank in range(world_size) if rank != lost_rank]
    outcomes = {}
    try:
        for _ in survivors:
            rank, message, finished_at = results.get(timeout=60)
            outcomes[rank] = (message, finished_at - killed_at)
        for process in processes:
            process.join(timeout=max(1.0, 60 - (time.monotonic() - killed_at)))
    finally:
        stray = _descendants(pids)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    assert not stray, f"processes left after the survivors should have exited: {stray}"
    assert all(processes[rank].exitcode == 0 for rank in survivors)
    for rank in survivors:
        message, elapsed = outcomes[rank]
        assert message.startswith("CommunicationError"), (rank, message)
        assert f"Root cause (the job's first failure): rank {lost_rank} unreachable" in message, (rank, message)
        assert f"at step {KILL_STEP}" in message, (rank, message)
        assert elapsed < 30, (rank, elapsed, message)


def test_survivors_name_the_rank_that_raised(tmp_path: Path) -> None:
    """A rank whose step raises (here its stage's forward) is the root cause the others report."""
    context = rank_context()
    results = context.Queue()
    processes = [context.Process(target=_rank_until_killed, args=(rank, 3, str(tmp_path), results, (1, 1, 1), 1,
                                                                  "raise")) for rank in range(3)]
    start_ranks(context, processes)
    try:
        outcomes = dict(results.get(timeout=60)[:2] for _ in range(3))
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
    assert outcomes[1] == "RuntimeError: loss exploded"
    for rank in (0, 2):
        assert outcomes[rank].startswith("CommunicationError"), (rank, outcomes[rank])
        assert (f"Root cause (the job's first failure): rank 1 raised RuntimeError at step {KILL_STEP}: loss exploded"
                in outcomes[rank]), (rank, outcomes[rank])


JOB = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    import fxpipe
    from fxpipe import models as zoo
    from fxpipe.core.checkpoint import latest_checkpoint
    from fxpipe.runtime.checkpoint_io import load_checkpoint, save_checkpoint
    from fxpipe.passes import trace
    from tests.mp_utils import plan_from_cuts

    # fxpipe.compile rendezvouses each torchrun attempt under its own store prefix.
    root, marker, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    kill_step, num_steps, batch = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    entry = zoo.get("mlp")
    model, example_inputs = zoo.build("mlp", **entry.tiny_overrides)
    plan = plan_from_cuts(trace(model, example_inputs), (1, 1), batch, 2)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=batch, plan=plan,
                          timeout_s=120.0)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    found = latest_checkpoint(root)
    start = load_checkpoint(pipe, found, optimizer=optimizer)["step"] if found is not None else 0
    print(f"rank {pipe.rank} starts at step {start}", flush=True)
    for step in range(start, num_steps):
        if step == kill_step and pipe.rank == 1 and not marker.exists():
            marker.write_text("killed once")
            os.kill(os.getpid(), signal.SIGKILL)
        inputs, targets = entry.make_batch(batch, step, **entry.tiny_overrides)
        pipe.step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
        save_checkpoint(pipe, root / f"step-{step + 1:04d}", optimizer=optimizer, step=step + 1)
    torch.save(pipe.state_dict(), out / f"rank{pipe.rank}.pt")
""")


@pytest.mark.slow  # two torchrun launches of two workers: ~25 s idle, 80 s on a loaded 2-core machine
def test_torchrun_restart_resumes_from_last_complete_checkpoint(tmp_path: Path) -> None:
    script, root, marker = tmp_path / "job.py", tmp_path / "checkpoints", tmp_path / "killed"
    script.write_text(JOB)
    num_steps, kill_step = 5, 3
    # Two restarts allowed so that a second one shows up in the log instead of as a bare torchrun failure
    # (a restarted worker aborted with SIGABRT, "terminate called without an active exception": once in
    # CI, and in 4 of 36 runs under load at interpreter exit, after its last checkpoint; 0 of 22 since
    # fxpipe destroys the default group it created at exit); the test then fails on the attempt count
    # below: a restart must work.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "2", "--monitor-interval", "0.2", str(script), str(root), str(marker),
               str(tmp_path), str(kill_step), str(num_steps), str(BATCH)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATE": "0",
           "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks even where a GPU is visible (NCCL would want one GPU each)
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150, cwd=tmp_path)
    log = job.stdout + job.stderr
    (tmp_path / "torchrun.log").write_text(log)
    assert job.returncode == 0, log[-4000:]
    assert marker.exists(), "the job was never killed"
    assert "rank 1 starts at step 0" in log and f"rank 1 starts at step {kill_step}" in log, log[-4000:]
    for rank in range(2):  # exactly one restart: a first attempt and one resumed attempt per worker
        starts = [line for line in log.splitlines() if f"rank {rank} starts at step" in line]
        assert len(starts) == 2, f"rank {rank} started {len(starts)} times (an aborted restart?):\n" + log[-4000:]
    final: dict[str, torch.Tensor] = {}
    for rank in range(2):
        final.update(torch.load(tmp_path / f"rank{rank}.pt", weights_only=True))
    expected = eager_weights("mlp", num_steps, BATCH, 1e-2)
    assert sorted(final) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-6)
