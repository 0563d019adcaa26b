"""torchrun smoke test: `fxpipe train` on 2 CPU ranks through torchrun's own launcher, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_fxpipe_train_under_torchrun(tmp_path: Path) -> None:
    trace_path = tmp_path / "timeline.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
        "-m", "fxpipe", "train", "mlp", "--global-batch", "8", "--steps", "4", "--plan", "1:1",
        "--num-microbatches", "2", "--data", "random", "--quiet", "--measure", "--trace", str(trace_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATE": "0",
           "CUDA_VISIBLE_DEVICES": ""}  # CPU ranks even where a GPU is visible (NCCL would want one GPU each)
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "plan 1:1" in result.stdout
    assert "trained 4 steps" in result.stdout
    trace = json.loads(trace_path.read_text())
    names = {event["name"] for event in trace["traceEvents"] if event["ph"] == "X"}
    assert {"F0", "F1", "B0", "B1", "AR"} <= names
    threads = {event["tid"] for event in trace["traceEvents"] if event["ph"] == "X"}
    assert threads == {0, 1}  # one timeline per rank
