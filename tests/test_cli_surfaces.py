"""CLI options checked on what they produce: `fxpipe plan` flags on the plan JSON, `fxpipe train` flags on the
printed losses (against one process on the whole batch) and the checkpoints written, `fxpipe demo` end to end."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import SHARED_PROFILES

from fxpipe.cli import main
from fxpipe.train_cli import _workload, add_train_arguments
from tests.mp_utils import join_world, leave_world, run_ranks

MIB = 2**20
GPT = ["gpt-mini", "--cluster", "dapple-a", "--global-batch", "32", "--max-blocks", "8"]
TRAINED = re.compile(r"trained (\d+) steps in [\d.]+ s: loss ([\d.]+) -> ([\d.]+)")


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """Run `fxpipe plan ARGV --json FILE` in this process; the plan file's JSON."""
    out = tmp_path / "plan.json"
    code = main(["plan", *argv, "--json", str(out), "--no-run-info"])
    captured = capsys.readouterr()
    assert (code, captured.err) == (0, ""), captured.err
    return dict(json.loads(out.read_text()))


def _covers_chain(plan: dict[str, Any]) -> bool:
    bounds = [(stage["first_block"], stage["stop_block"]) for stage in plan["stages"]]
    return bounds[0][0] == 0 and bounds[-1][1] == plan["num_blocks"] and all(
        left[1] == right[0] for left, right in zip(bounds, bounds[1:], strict=False))


def test_plan_forced_microbatches_schedule_recompute_bucket_and_max_blocks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = _plan(tmp_path, capsys, *GPT[:-1], "6", "--layout", "1:1", "--num-microbatches", "4", "--schedule",
                 "gpipe", "--recompute", "always", "--allreduce-bucket-mb", "1.5")
    assert plan["num_microbatches"] == 4 and plan["schedule"] == "gpipe" and plan["layout"] == "1:1"
    assert [stage["recompute"] for stage in plan["stages"]] == [True, True]
    assert plan["allreduce_bucket_bytes"] == int(1.5 * MIB)
    assert plan["num_blocks"] == 6 == len(plan["block_names"]) == len(plan["cost_chain"]["blocks"])
    assert _covers_chain(plan)


def test_plan_defaults_and_optimizer_memory_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    adam = _plan(tmp_path, capsys, *GPT, "--layout", "1:1")
    assert adam["num_blocks"] == 8 and _covers_chain(adam)  # --max-blocks 8 here, 6 above
    assert adam["allreduce_bucket_bytes"] == 25 * MIB and adam["schedule"] == "early_backward"
    assert [stage["recompute"] for stage in adam["stages"]] == [False, False]  # auto: activations fit
    sgd = _plan(tmp_path, capsys, *GPT, "--layout", "1:1", "--optimizer", "sgd")
    assert [stage["first_block"] for stage in sgd["stages"]] == [stage["first_block"] for stage in adam["stages"]]
    for with_adam, with_sgd in zip(adam["stages"], sgd["stages"], strict=True):
        # AdamW keeps weights, gradients and two moments (4x the parameters); SGD weights and gradients (2x)
        assert with_adam["peak_memory_bytes"] - with_sgd["peak_memory_bytes"] == 2 * with_adam["param_bytes"]
    assert sgd["predicted"]["peak_memory_bytes"] == [stage["peak_memory_bytes"] for stage in sgd["stages"]]


def test_plan_planner_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpipe = _plan(tmp_path, capsys, *GPT, "--planner", "gpipe")
    assert gpipe["planner"] == "gpipe" and gpipe["baselines"] == {}
    assert {stage["replicas"] for stage in gpipe["stages"]} == {2}  # GPipe: equal stages, one per block here
    assert len(gpipe["stages"]) == gpipe["num_blocks"] == 8

    compared = _plan(tmp_path, capsys, *GPT, "--compare")
    baselines = compared["baselines"]
    assert {"dp", "gpipe", "pipedream", "uniform", "params"} <= set(baselines)
    assert baselines["gpipe"]["iteration_time_s"] == pytest.approx(gpipe["predicted"]["iteration_time_s"])
    assert baselines["gpipe"]["layout"] == gpipe["layout"]
    assert baselines["dp"]["iteration_time_s"] == pytest.approx(compared["predicted"]["dp_iteration_time_s"])
    for name, baseline in baselines.items():  # null exactly when infeasible, which a note explains
        assert (baseline["iteration_time_s"] is None) == (not baseline["feasible"]), name
        assert baseline["feasible"] or baseline["note"], name
        assert not baseline["feasible"] or baseline["iteration_time_s"] > 0, name


@pytest.mark.needs_profiles
def test_plan_from_a_profile_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = SHARED_PROFILES / "bert-48-pbs-2.txt"
    common = ["--profile", str(profile), "--cluster", "dapple-a", "--global-batch", "64"]
    plan = _plan(tmp_path, capsys, *common, "--profile-batch", "2", "--max-blocks", "6", "--num-microbatches", "8")
    assert plan["cost_chain"]["source"] == f"profile:{profile}" and plan["model"] == "profile:bert-48-pbs-2.txt"
    assert plan["num_blocks"] == 6 and plan["num_microbatches"] == 8 and _covers_chain(plan)
    finer = _plan(tmp_path, capsys, *common, "--profile-batch", "2", "--max-blocks", "12")
    assert finer["num_blocks"] == 12
    total_params = sum(block["param_bytes"] for block in plan["cost_chain"]["blocks"])
    assert total_params == sum(block["param_bytes"] for block in finer["cost_chain"]["blocks"]) > 0
    # --profile-batch: the profile's times and bytes were measured for that many rows, so per row they halve at 4
    doubled = _plan(tmp_path, capsys, *common, "--profile-batch", "4", "--max-blocks", "6")
    for at_two, at_four in zip(plan["cost_chain"]["blocks"], doubled["cost_chain"]["blocks"], strict=True):
        assert at_four["forward_s"][1] == pytest.approx(at_two["forward_s"][1] / 2)
        assert at_four["saved_bytes"][1] == pytest.approx(at_two["saved_bytes"][1] / 2)
        assert at_four["param_bytes"] == at_two["param_bytes"]


HOOKS = '''
import torch.nn.functional as F


def doubled_ce(logits, targets):
    return 2.0 * F.cross_entropy(logits.flatten(0, 1), targets.flatten())
'''
TRAIN = ["train", "gpt-mini", "--data", "stdlib", "--global-batch", "8", "--plan", "1:1", "--num-microbatches", "2",
         "--schedule", "gpipe", "--recompute", "always", "--batch-dims", "0", "--costs", "analytic",
         "--loss", "surface_hooks:doubled_ce", "--checkpoint-every", "1", "--steps", "2", "--quiet"]


def _train(rank: int, world_size: int, store_dir: str, checkpoints: str) -> str:
    """`fxpipe train` for 2 steps, a checkpoint after each, the plan it ran written (rank 0); rank 0's output."""
    os.environ.pop("FXPIPE_COSTS", None)  # --costs analytic must hold on its own (auto would measure here)
    join_world(store_dir, "train", rank, world_size)
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert main([*TRAIN, "--checkpoint-dir", checkpoints, "--json", f"{checkpoints}-plan.json"]) == 0
        return out.getvalue()
    finally:
        leave_world()


def _reference_losses(argv: list[str]) -> list[float]:
    """What `fxpipe train ARGV` computes, in one process on the whole batch (its seeding, data, loss, AdamW)."""
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    model, _, loss_fn, batches = _workload(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        inputs, targets = batches(step)
        loss = loss_fn(model(*inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.multiprocess
def test_train_flags_give_the_unsplit_losses_and_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "surface_hooks.py").write_text(HOOKS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    checkpoints = tmp_path / "ckpt"
    out = run_ranks(_train, 2, tmp_path, str(checkpoints))[0]
    expected = _reference_losses(TRAIN[1:])

    assert "plan 1:1 " in out and "schedule=gpipe" in out and "micro-batches=2 x 4 rows" in out, out
    assert "analytic block costs" in out and out.count("recompute") >= 2, out  # the stage table: both recompute
    match = TRAINED.search(out)
    assert match is not None and int(match[1]) == 2, out
    assert [float(match[2]), float(match[3])] == pytest.approx(expected, abs=1.5e-3)  # printed with 3 decimals
    assert expected[0] > 2 * 4.0  # the doubled loss: 2 x cross-entropy near log(vocab) at the start
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-000001", "step-000002"]
    manifest = json.loads((checkpoints / "step-000001" / "fxpipe_manifest.json").read_text())
    assert manifest["step"] == 1
    # `--json` wrote the plan it ran; `fxpipe plan` cuts the same layout request on the same costs and cluster alike
    ran = json.loads((tmp_path / "ckpt-plan.json").read_text())
    assert ran["model"] == "gpt-mini" and f"wrote the plan it runs to {checkpoints}-plan.json" in out, out
    assert main(["show", str(tmp_path / "ckpt-plan.json")]) == 0 and "plan 1:1 " in capsys.readouterr().out
    planned = _plan(tmp_path, capsys, "gpt-mini", "--cluster", "local:2", "--global-batch", "8", "--layout", "1:1",
                    "--num-microbatches", "2", "--schedule", "gpipe", "--recompute", "always", "--batch-dims", "0",
                    "--costs", "analytic")

    def cuts(plan: dict[str, Any]) -> list[tuple[Any, ...]]:
        return [(s["first_block"], s["stop_block"], s["replicas"], s["devices"]) for s in plan["stages"]]

    assert cuts(planned) == cuts(ran) and cuts(ran)[0][1] not in (1, ran["num_blocks"] - 1), (cuts(planned), cuts(ran))
    assert (planned["num_microbatches"], planned["schedule"]) == (ran["num_microbatches"], ran["schedule"])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_demo_trains_on_local_ranks(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`fxpipe demo` launches its ranks through torchrun's launcher; rank 0 prints the plan and the losses."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the demo would set it in this process for good
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU ranks even where a GPU is visible
    assert main(["demo", "--nproc", "2", "--steps", "2", "--layout", "1:1"]) == 0
    out = capfd.readouterr().out
    assert "plan 1:1 " in out and "micro-batches=8 x 4 rows" in out, out[-3000:]
    assert "above 100%" not in out, out[-3000:]  # the measured MFU is against a sound peak (utilization_warning)
    match = TRAINED.search(out)
    assert match is not None, out[-3000:]
    demo_args = ["gpt-mini", "--global-batch", "32", "--steps", "2", "--data", "stdlib"]
    assert [float(match[2]), float(match[3])] == pytest.approx(_reference_losses(demo_args), abs=1.5e-3)


def test_a_torchrun_worker_ends_right_after_its_command_skipping_interpreter_teardown(tmp_path: Path) -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set) `fxpipe` runs the exit handlers, then ends at once with the
    command's status: interpreter teardown, where gloo's threads now and then aborted a finished calibrate
    rank (SIGABRT, "terminate called without an active exception"), never runs. Outside torchrun, main returns."""
    script = ("import atexit, sys\n"
              "from fxpipe.cli import main\n"
              "class Teardown:\n"
              "    def __del__(self):\n"
              "        print('teardown ran', flush=True)\n"
              "keep = Teardown()\n"
              "atexit.register(print, 'handlers ran', flush=True)\n"
              f"status = main(['plan', *{GPT!r}, '--json', {str(tmp_path / 'plan.json')!r}, '--no-run-info'])\n"
              "print('main returned', status, flush=True)\n")
    env = {key: value for key, value in os.environ.items() if key != "TORCHELASTIC_RUN_ID"}
    outside = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert outside.returncode == 0, outside.stderr[-2000:]
    assert ["main returned 0", "handlers ran", "teardown ran"] == \
        [line for line in outside.stdout.splitlines() if line.startswith(("main returned", "handlers", "teardown"))]
    worker = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**env, "TORCHELASTIC_RUN_ID": "test"}, timeout=120)
    assert worker.returncode == 0, worker.stderr[-2000:]
    assert "handlers ran" in worker.stdout and "main returned" not in worker.stdout
    assert "teardown ran" not in worker.stdout
