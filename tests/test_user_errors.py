"""User mistakes under torchrun: every rank raises the same error, and `fxpipe train` prints it once, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
NUM_RANKS = 2
# case -> (the error type every rank raises, words its message must hold)
EXPECTED = {
    "layout": ("LayoutError", ["you launched 2 ranks", "'2:1' needs 3", "--nproc-per-node 3", "adding up to 2"]),
    "loss-signature": ("LossFunctionError", ["loss_without_targets", "loss_fn(output, targets)"]),
    "loss-not-scalar": ("LossFunctionError", ["returned a tensor of shape (4, 4)", "must be a scalar", ".mean()"]),
    "token-mean-pair": ("ok", []),
    "pair-without-token-mean": ("LossFunctionError", ["returned tuple", "needs loss_reduction='token_mean'"]),
    "transposed-inputs": ("BatchShapeError", ["input 'x' has shape (6, 4, 3)", "looks transposed",
                                              "x.transpose(0, 1)"]),
    "plan-file": ("PlanError", ["plan.json'", "is not JSON", "fxpipe plan"]),
    "cluster": ("ClusterSpecError", ["'1x2:tpu'", "device kind 'tpu' is unknown"]),
    "option": ("PipelineSetupError", ["sync_params='sometimes' is unknown", "'broadcast'"]),
}


def _torchrun(*arguments: str, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NUM_RANKS}",
               "--max-restarts=0", *arguments]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FXPIPE_CALIBRATE": "0", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("FXPIPE_DEBUG", None)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)


def test_every_rank_raises_the_same_user_error(tmp_path: Path) -> None:
    """One launch tries each mistake in turn through the Python API; each rank records what it raised."""
    run = _torchrun(str(ROOT / "tests" / "user_error_cases.py"), str(tmp_path))
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(NUM_RANKS)]
    assert set(ranks[0]) == set(EXPECTED)
    for case, (kind, words) in EXPECTED.items():
        assert all(result[case] == ranks[0][case] for result in ranks), (case, [result[case] for result in ranks])
        got_kind, message = ranks[0][case]
        assert got_kind == kind and all(word in message for word in words), (case, got_kind, message)
    assert "Traceback" not in run.stderr, run.stderr[-3000:]  # a failed guess of the loss's targets logs nothing


@pytest.mark.parametrize(("options", "message"), [
    (["--plan", "2:1"], "you launched 2 ranks; layout '2:1' needs 3"),
    (["--loss", "tests.user_error_cases:loss_without_targets"], "cannot be called as loss_fn(output, targets)"),
], ids=["layout", "loss-signature"])
def test_cli_prints_one_message_and_exits_2_under_torchrun(options: list[str], message: str) -> None:
    run = _torchrun("-m", "fxpipe", "train", "mlp", "--global-batch", "8", "--steps", "1", "--data", "random",
                    "--costs", "analytic", "--quiet", *options)
    output = run.stdout + run.stderr
    errors = [line for line in output.splitlines() if line.startswith("fxpipe train: error: ")]
    assert len(errors) == 1 and message in errors[0], output[-4000:]  # once, from rank 0, on its own line
    assert run.returncode != 0 and "fxpipe/" not in output, output[-4000:]  # no traceback through fxpipe's code
    # every rank exited with status 2 (or was stopped by torchrun after another did), none crashed
    codes = [line.split(":", 1)[1].split()[0] for line in output.splitlines() if line.strip().startswith("exitcode")]
    assert codes and set(codes) <= {"2", "-15"} and "2" in codes, output[-4000:]
    assert "user error" in output  # torchrun's summary reads fxpipe's error file, not its docs link
