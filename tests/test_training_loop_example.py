"""docs/training_loop.md's script runs: 3 ranks under torchrun, a few steps, validation, a checkpoint and a resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "training_loop.py"


def test_the_doc_shows_the_script_ci_runs() -> None:
    doc = (ROOT / "docs" / "training_loop.md").read_text()
    shown = re.search(r"```python\n(.*?)```", doc, re.DOTALL)
    assert shown is not None and shown.group(1) == SCRIPT.read_text(), "copy examples/training_loop.py into the doc"


def _launch(checkpoint: Path, max_steps: int) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
               "--max-restarts=0", str(SCRIPT), "--epochs", "2", "--batch", "12", "--windows", "72",
               "--seq", "16", "--validate-every", "2", "--max-steps", str(max_steps),
               "--checkpoint-dir", str(checkpoint)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATE": "0", "FXPIPE_COSTS": "analytic",
           "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, timeout=420, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
def test_training_loop_trains_validates_checkpoints_and_resumes(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    first = _launch(checkpoint, max_steps=2)
    lines = [line for line in first.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and " val " in lines[1], first
    assert checkpoint.is_dir()
    second = _launch(checkpoint, max_steps=3)
    assert "resumed at step 2" in second, second
    assert re.search(r"epoch 0 step 3 loss \d", second), second  # 72 windows / (12 x 2): 3 steps per epoch
    assert "done at step 3 of 6" in second, second
