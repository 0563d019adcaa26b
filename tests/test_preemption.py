"""Preemption: SIGTERM on one rank stops every rank after the same step; under torchrun the job saves, exits 0 and resumes exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.checkpoint import latest_checkpoint
from fxpipe.passes import trace
from fxpipe.runtime.checkpoint_io import consolidate
from fxpipe.runtime.faults import preemption
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
ENTRY = zoo.get("mlp")
BATCH = 8
SIGNAL_STEP = 2


def _preempted_after(rank: int, world_size: int, store_dir: str) -> list[bool]:
    """2:1 pipeline; the last rank SIGTERMs itself inside a forward of step SIGNAL_STEP."""
    join_world(store_dir, "preempt", rank, world_size)
    model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
    plan = plan_from_cuts(trace(model, example_inputs), (2, 1), BATCH, 4)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan=plan,
                          timeout_s=30.0)
    pipe.handle_preemption()
    step_box = [0]
    if rank == world_size - 1:
        original = pipe.driver.runner.forward_loss

        def forward_then_signal(*args: Any) -> Any:
            if step_box[0] == SIGNAL_STEP:
                os.kill(os.getpid(), signal.SIGTERM)
            return original(*args)

        pipe.driver.runner.forward_loss = forward_then_signal
    seen = []
    for step in range(SIGNAL_STEP + 2):
        step_box[0] = step
        inputs, targets = ENTRY.make_batch(BATCH, step, **ENTRY.tiny_overrides)
        pipe.step(inputs, targets)
        seen.append(pipe.preempted)
    assert preemption.signal_received() == (signal.SIGTERM if rank == world_size - 1 else None)
    leave_world()
    return seen


def test_sigterm_on_one_rank_stops_all_ranks_after_the_same_step(tmp_path: Path) -> None:
    expected = [False] * SIGNAL_STEP + [True, True]
    assert run_ranks(_preempted_after, 3, tmp_path) == [expected] * 3


def test_preempted_in_one_process_and_handler_notes_only() -> None:
    """World of one: the flag still goes through the end-of-step sum; the handler only notes the signal."""
    saved = signal.getsignal(signal.SIGTERM)
    model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH,
                          plan=plan_from_cuts(trace(model, example_inputs), (1,), BATCH, 2))
    inputs, targets = ENTRY.make_batch(BATCH, 0, **ENTRY.tiny_overrides)
    try:
        pipe.handle_preemption()
        pipe.step(inputs, targets)
        assert not pipe.preempted
        os.kill(os.getpid(), signal.SIGTERM)  # noted, the process goes on
        assert preemption.signal_received() == signal.SIGTERM and not pipe.preempted  # until a step ends
        pipe.step(inputs, targets)
        assert pipe.preempted
    finally:
        signal.signal(signal.SIGTERM, saved)
        preemption.clear()
        pipe.close()
    pipe_after = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH,
                                plan=plan_from_cuts(trace(model, example_inputs), (1,), BATCH, 2))
    pipe_after.step(inputs, targets)
    assert not pipe_after.preempted
    pipe_after.close()


def _train_command(checkpoints: Path, num_steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
            "-m", "fxpipe", "train", "mlp", "--global-batch", str(BATCH), "--steps", str(num_steps), "--plan", "1:1",
            "--num-microbatches", "2", "--data", "random", "--quiet", "--checkpoint-dir", str(checkpoints)]


def _worker_pid(agent_pid: int, rank: int) -> int | None:
    """The pid of torchrun worker ``rank`` among the agent's children (read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0") if parent == agent_pid else []
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _uninterrupted(num_steps: int) -> dict[str, torch.Tensor]:
    """What `fxpipe train mlp --data random --seed 0` computes, in one process."""
    torch.manual_seed(0)
    model, _ = zoo.build("mlp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(num_steps):
        inputs, targets = ENTRY.make_batch(BATCH, seed=step)
        ENTRY.loss_fn(model(*inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


@pytest.mark.slow  # two torchrun launches of two workers
def test_sigterm_under_torchrun_saves_exits_0_and_resumes_exactly(tmp_path: Path) -> None:
    checkpoints, num_steps = tmp_path / "checkpoints", 300
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATE": "0", "CUDA_VISIBLE_DEVICES": ""}
    job = subprocess.Popen(_train_command(checkpoints, num_steps), env=env, cwd=tmp_path, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert job.stdout is not None
    log = []
    try:
        for line in job.stdout:  # rank 0 prints the plan once every rank compiled (handlers installed before)
            log.append(line)
            if line.startswith("plan 1:1"):
                break
        worker = _worker_pid(job.pid, 1)
        assert worker is not None, "".join(log)
        os.kill(worker, signal.SIGTERM)
        signalled = time.monotonic()
        log.extend(job.stdout)
        returncode = job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
    text = "".join(log)
    assert returncode == 0, text[-4000:]
    assert time.monotonic() - signalled < 60
    stopped = [line for line in log if line.startswith("preempted: stopped after step")]
    assert stopped, text[-4000:]
    stop_step = int(stopped[0].split("after step ")[1].split(",")[0])
    assert 0 < stop_step < num_steps, text[-4000:]  # mid-run: the signal came before the last step
    assert latest_checkpoint(checkpoints) == checkpoints / f"step-{stop_step:06d}", sorted(checkpoints.iterdir())
    end_step = stop_step + 3  # a few steps past the resume show it exact; the rest of the 300 would add nothing
    restart = subprocess.run(_train_command(checkpoints, end_step), env=env, cwd=tmp_path, text=True,
                             capture_output=True, timeout=300)
    assert restart.returncode == 0, (restart.stdout + restart.stderr)[-4000:]
    assert f"resuming at step {stop_step} from" in restart.stdout, restart.stdout[-4000:]
    final = consolidate(checkpoints / f"step-{end_step:06d}")
    expected = _uninterrupted(end_step)
    assert sorted(final) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-4, atol=1e-5)
