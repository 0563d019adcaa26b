"""Calibration as users meet it: unguarded scripts (file, -c, stdin), ranks of a process group, failures, CUDA parents."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe.core.cluster_spec import lockstep_link
from fxpipe.core.hardware import LOCAL_LINK_DEFAULT, LinkSpec
from tests import mp_utils
from tests.mp_utils import join_world, leave_world, run_ranks

# A training script as most are written: no `if __name__ == "__main__":` guard. It makes starting a
# process fail loudly, so a library that spawns (the old calibration did) cannot pass unnoticed.
UNGUARDED_SCRIPT = """
import multiprocessing, subprocess
import torch, fxpipe

def refuse(*args, **kwargs):
    raise AssertionError("fxpipe started a process from the user's script")

multiprocessing.Process.start = refuse
subprocess.Popen.__init__ = refuse
model, example_inputs = fxpipe.models.build("mlp")
entry = fxpipe.models.get("mlp")
pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=8)
opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
inputs, targets = entry.make_batch(8, seed=0)
loss = pipe.step(inputs, targets)
opt.step()
print("fxpipe-step-loss", loss)
"""


@pytest.mark.parametrize("how", ["file", "-c", "stdin"])
def test_an_unguarded_script_calibrates_and_trains_quickly(how: str, tmp_path: Path) -> None:
    cache = tmp_path / "empty-cache"
    env = {key: value for key, value in os.environ.items() if key != "FXPIPE_CALIBRATE"}  # calibration on
    env.update(FXPIPE_CACHE_DIR=str(cache), CUDA_VISIBLE_DEVICES="")  # a world of one CPU rank
    script = tmp_path / "train.py"
    script.write_text(UNGUARDED_SCRIPT)
    command = {"file": [sys.executable, str(script)], "-c": [sys.executable, "-c", UNGUARDED_SCRIPT],
               "stdin": [sys.executable, "-"]}[how]
    start = time.perf_counter()
    done = subprocess.run(command, input=UNGUARDED_SCRIPT if how == "stdin" else None, capture_output=True,
                          text=True, cwd=tmp_path, env=env, timeout=120)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fxpipe-step-loss" in done.stdout and "fxpipe:" not in done.stderr, done.stderr[-3000:]
    assert math.isfinite(float(done.stdout.split("fxpipe-step-loss")[1].split()[0]))
    assert elapsed < 40, f"{how}: {elapsed:.1f} s"
    (written,) = cache.glob("calibration-*-cpu.json")  # it measured (in-process), not skipped
    sections = json.loads(written.read_text())["sections"]
    assert set(sections) == {"device"} and sections["device"]["figures"]["float32"] > 0


# Ways Python code starts a process. Only the CLI's launcher (fxpipe calibrate, fxpipe demo) may.
PROCESS_STARTERS = re.compile(r"^\s*(import|from)\s+(multiprocessing|subprocess|torch\.multiprocessing|"
                              r"torch\.distributed\.run|concurrent\.futures)\b|os\.(fork|system|spawn|exec|popen)",
                              re.MULTILINE)
LAUNCHERS = {"fxpipe/runtime/launch.py"}


def test_only_the_cli_launcher_can_start_processes() -> None:
    root = Path(__file__).resolve().parent.parent
    sources = [path for folder in ("fxpipe", "passes", "models") for path in sorted((root / folder).rglob("*.py"))]
    assert len(sources) > 30
    starters = {str(path.relative_to(root)) for path in sources if PROCESS_STARTERS.search(path.read_text())}
    assert starters == LAUNCHERS


def _broken(device: object = None) -> dict[str, float]:
    raise RuntimeError("timer broke on this rank")


def _calibrate_over_the_group(rank: int, world_size: int, store_dir: str, cache_dir: str) -> dict[str, Any]:
    from fxpipe import models
    from fxpipe.api import compile as fxpipe_compile
    from fxpipe.core.cluster import local_cluster, parse_cluster
    from fxpipe.runtime.calibration import calibrate

    os.environ["FXPIPE_CACHE_DIR"] = cache_dir
    join_world(store_dir, "calibrate", rank, world_size)
    result: dict[str, Any] = {}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["measured"] = parse_cluster(f"local:{world_size}", calibrate=True, collective=True).to_json()
            result["cached"] = parse_cluster(f"local:{world_size}", calibrate=True, collective=True).to_json()
        result["warnings"] = [str(item.message) for item in caught]
        if rank == 1:  # one rank's measurement fails: every rank must warn and fall back alike
            calibrate.measure_device = _broken  # type: ignore[assignment]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["failed"] = local_cluster(world_size, calibrate=True, collective=True, refresh=True).to_json()
        result["failed_warnings"] = [str(item.message) for item in caught]
        os.environ["FXPIPE_CALIBRATE"] = "1"  # compile's default cluster, calibrated over this group
        model, example_inputs = models.build("mlp")
        entry = models.get("mlp")
        pipe = fxpipe_compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=8, plan="dp")
        result["loss"] = pipe.step(*entry.make_batch(8, seed=0))
        return result
    finally:
        leave_world()


@pytest.mark.multiprocess
def test_ranks_calibrate_over_their_process_group_and_agree(tmp_path: Path) -> None:
    """Three ranks: ranks 0 and 1 time their link over a two-rank subgroup while rank 2 waits (as in `fxpipe demo`)."""
    cache = tmp_path / "cache"
    results = run_ranks(_calibrate_over_the_group, 3, tmp_path, str(cache))
    first = results[0]
    for key in ("measured", "cached", "failed", "warnings", "loss"):
        assert all(result[key] == first[key] for result in results), key  # every rank, the same figures
    measured = first["measured"]
    assert measured["description"].endswith("over the gloo process group of 3 rank(s): device measured, "
                                            "links measured")
    assert first["warnings"] == []
    assert 0 < measured["intra_host"]["latency_s"] < 0.1 and 1e7 < measured["intra_host"]["bandwidth_bytes_per_s"]
    assert measured["intra_host"] != json.loads(json.dumps(LOCAL_LINK_DEFAULT.__dict__))
    assert 0 < measured["intra_host_collective"]["latency_s"] < 0.1 and measured["message_overhead_s"] > 0
    for kind in ("reduce_scatter_collective", "all_gather_collective"):  # a sharded stage's own links
        assert 0 <= measured[kind]["latency_s"] < 0.1 and measured[kind]["bandwidth_bytes_per_s"] > 1e6, kind
    lockstep = measured["tensor_parallel_collective"]  # collectives between compute: the cluster file carries them
    assert 0 <= lockstep["latency_s"] < 0.1 and lockstep["bandwidth_bytes_per_s"] > 1e5
    assert 0 <= measured["fsdp_call_overhead_s"] < 1  # and FSDP2's host time per collective
    assert all(0 <= value < 1 for value in measured["fsdp_calls"].values())  # per kind and by bytes (the fit)
    assert len(measured["fsdp_calls"]) == 6  # all-gather, reduce-scatter and the collective-free pass: a + b x bytes
    assert measured["device"]["name"] == "CPU(calibrated)"
    cached = first["cached"]
    assert cached["description"].endswith("group of 3 rank(s): device cached, links cached")
    assert {**cached, "description": ""} == {**measured, "description": ""}  # the cache gives back the figures
    (written,) = cache.glob("calibration-*-cpu.json")
    assert set(json.loads(written.read_text())["sections"]) == {"device", "link"}
    link_figures = json.loads(written.read_text())["sections"]["link"]["figures"]  # the last (refreshed) links
    assert lockstep_link(link_figures) == LinkSpec(**first["failed"]["tensor_parallel_collective"])
    assert link_figures["fsdp_call_overhead"] == first["failed"]["fsdp_call_overhead_s"]
    assert first["failed"]["device"]["name"] == "CPU"  # defaults
    assert first["failed"]["description"].endswith("device defaults (measurement failed), links measured")
    for messages in (result["failed_warnings"] for result in results):
        assert any("measuring the devices failed" in m and "rank 1: RuntimeError: timer broke" in m for m in messages)
    assert math.isfinite(first["loss"])


def _where_am_i(rank: int, world_size: int, store_dir: str) -> tuple[str, str | None, bool]:
    return (multiprocessing.get_start_method(allow_none=True) or "", os.environ.get("CUDA_VISIBLE_DEVICES"),
            torch.cuda.is_initialized())


@pytest.mark.multiprocess
def test_ranks_are_spawned_without_cuda_once_the_parent_initialised_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA machine does when an earlier test touched the GPU: forked children would fail there."""
    monkeypatch.delenv("FXPIPE_TEST_START_METHOD", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert mp_utils.start_method() == ("spawn" if torch.cuda.is_initialized() or torch.cuda.is_available()
                                       else "fork")  # a GPU machine spawns even before CUDA is initialised
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert mp_utils.start_method() == "spawn"
    assert run_ranks(_where_am_i, 2, tmp_path) == [("spawn", "", False)] * 2
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # hidden from the children only
    monkeypatch.setenv("FXPIPE_TEST_START_METHOD", "fork")  # the variable overrides the choice either way
    assert mp_utils.start_method() == "fork"
    monkeypatch.setenv("FXPIPE_TEST_START_METHOD", "forkserver")
    with pytest.raises(ValueError, match="use 'fork' or 'spawn'"):
        mp_utils.start_method()


@pytest.mark.multiprocess
def test_fxpipe_calibrate_launches_ranks_and_fills_the_cache_plan_reads(tmp_path: Path) -> None:
    """The CLI is the launcher: `fxpipe calibrate` starts 2 ranks; `fxpipe plan --cluster local:2` then needs none."""
    env = {key: value for key, value in os.environ.items() if key != "FXPIPE_CALIBRATE"}
    env.update(FXPIPE_CACHE_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "fxpipe", "calibrate"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout[done.stdout.index("{"):])
    assert printed["source"] == "over the gloo process group of 2 rank(s): device measured, links measured"
    (written,) = tmp_path.glob("calibration-*-cpu.json")
    assert str(written) == printed["cache"]
    sections = json.loads(written.read_text())["sections"]
    assert sections["link"]["figures"] == printed["links"] and sections["device"]["figures"] == printed["device"]
    plan_json = tmp_path / "plan.json"
    planned = subprocess.run([sys.executable, "-m", "fxpipe", "plan", "mlp", "--cluster", "local:2", "--global-batch",
                              "8", "--json", str(plan_json)], capture_output=True, text=True, env=env, cwd=tmp_path,
                             timeout=120)
    assert planned.returncode == 0 and "fxpipe:" not in planned.stderr, planned.stderr[-3000:]
    cluster = json.loads(plan_json.read_text())["cluster_spec"]
    assert cluster["intra_host"]["latency_s"] == printed["links"]["link_latency"]
