"""Public paths with no test of their own: ``fxpipe plan | simulate | show`` and their exit codes, ``fxpipe.plan``,
``load_model("pkg.mod:factory")``, and on two ranks compile with a plan JSON path and the
``num_microbatches`` / ``warmup_policy`` / ``cluster`` / ``optimizer`` options, ``load_state_dict``,
``export`` + ``load_program`` and ``train()`` / ``eval()``, each against an eager or library reference."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.planfile import load_plan_file
from fxpipe.core.program import tree_leaves
from fxpipe.core.schedule import format_schedule, make_schedule
from fxpipe.passes import trace
from fxpipe.passes.codegen_io import load_program
from fxpipe.planning import load_model
from fxpipe.report import format_plan
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks
from tests.test_codegen import _run_stagewise

ROOT = Path(__file__).resolve().parents[1]
BATCH = 12


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from fxpipe.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_simulate_show_agree_with_the_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(["plan", "mlp", "--cluster", "local:2", "--global-batch", "8", "--json", "p.json"], capsys)
    assert (code, err) == (0, "") and "wrote p.json" in out
    plan, chain, cluster = load_plan_file(tmp_path / "p.json")
    assert chain is not None and cluster is not None and plan.model == "mlp"
    model, example_inputs = zoo.build("mlp", device="meta")
    entry = zoo.get("mlp")  # the CLI costs a zoo model's own loss on its own targets
    direct = fxpipe.plan(model, example_inputs, cluster="local:2", global_batch_size=8, loss_fn=entry.loss_fn,
                         example_targets=entry.make_batch(example_inputs[0].shape[0], 0)[1])  # the Python front door
    assert (direct.layout, direct.num_microbatches, direct.stages) == (plan.layout, plan.num_microbatches, plan.stages)
    expected = fxpipe.simulate(plan, chain, cluster)
    assert plan.predicted is not None and plan.predicted.iteration_time_s == pytest.approx(expected.iteration_time_s)

    code, out, err = _cli(["simulate", "p.json", "--trace", "trace.json"], capsys)
    assert (code, err) == (0, "")
    report = json.loads(out[:out.rindex("}") + 1])
    assert report["layout"] == plan.layout
    assert report["iteration_time_s"] == expected.iteration_time_s
    assert report["peak_memory_bytes"] == list(expected.peak_memory_bytes)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("ph") == "X") >= len(expected.events)

    code, out, err = _cli(["show", "p.json", "--schedule"], capsys)
    assert (code, err) == (0, "")
    schedule = make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches, plan.warmup_policy)
    assert format_plan(plan, chain, cluster) in out and format_schedule(schedule) in out


def test_cli_error_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    _cli(["plan", "mlp", "--cluster", "local:2", "--global-batch", "8", "--json", "p.json"], capsys)
    plan, _, _ = load_plan_file(tmp_path / "p.json")
    plan.save(tmp_path / "bare.json")  # a plan without its cost chain and cluster
    cases = [(["simulate", "missing.json"], "cannot read plan file 'missing.json'"),
             (["show", "bad.json"], "plan file 'bad.json' is not JSON"),
             (["simulate", "bare.json"], "holds no cost chain/cluster"),
             (["plan", "mlp", "--cluster", "local:2", "--global-batch", "8", "--layout", "2:2"], "needs 4 devices"),
             (["plan", "mlp", "--cluster", "nowhere", "--global-batch", "8"], "bad cluster spec 'nowhere'")]
    for argv, message in cases:
        code, out, err = _cli(argv, capsys)
        assert code == 2 and err.startswith(f"fxpipe {argv[0]}: error: {message}") or message in err, (argv, err)
        assert code == 2 and "Traceback" not in err, (argv, err)
    with pytest.raises(SystemExit) as usage:  # argparse: a missing argument is exit code 2 as well
        _cli(["show"], capsys)
    assert usage.value.code == 2
    # the console entry point passes main's code to the shell
    run = subprocess.run([sys.executable, "-m", "fxpipe", "show", "missing.json"], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("fxpipe show: error: cannot read plan file"), run.stderr


def test_load_model_imports_a_factory_from_a_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "userpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def factory(width=4):
            torch.manual_seed(width)
            return nn.Sequential(nn.Linear(width, 3), nn.ReLU()), (torch.randn(2, width),)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    model, example_inputs = load_model("userpkg.nets:factory")
    assert isinstance(model, torch.nn.Sequential) and model[0].in_features == 4
    assert example_inputs[0].shape == (2, 4)
    wide, wide_inputs = load_model("userpkg.nets:factory", width=6)  # keyword overrides reach the factory
    assert wide[0].in_features == 6 and wide_inputs[0].shape == (2, 6)
    torch.manual_seed(4)
    assert torch.equal(model[0].weight, torch.nn.Linear(4, 3).weight)  # really the factory's model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, 6, generator=generator), torch.randint(0, 4, (BATCH,), generator=generator)


def _model(seed: int) -> torch.nn.Module:
    """Dropout makes train and eval mode differ (batch norm, in both modes, is exported in test_export_pt2.py)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(12, 4))


def _eval_reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    ref = copy.deepcopy(model).eval()
    loss = F.cross_entropy(ref(x), y)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in ref.named_parameters() if p.grad is not None}


def _grads_match(pipe: Any, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.allclose(p.grad, expected[n], rtol=1e-4, atol=1e-6) for n, p in pipe.named_parameters())


def _file_plan_checks(rank: int, plan_path: str, export_dir: str) -> dict[str, Any]:
    """Plan JSON path + overrides; eval()/train(); load_state_dict; export and reload."""
    x, y = _batch()
    model = _model(0)
    pipe = fxpipe.compile(model, (x,), loss_fn=F.cross_entropy, global_batch_size=BATCH, plan=plan_path,
                          num_microbatches=4, warmup_policy="B")
    out: dict[str, Any] = {"plan": (pipe.plan.num_microbatches, pipe.plan.warmup_policy, pipe.plan.layout)}
    expected_loss, expected_grads = _eval_reference(_model(0), x, y)
    assert pipe.eval() is pipe
    out["eval_loss"], out["eval_expected"] = pipe.step((x,), y), expected_loss
    out["eval_grads"] = _grads_match(pipe, expected_grads)
    for parameter in pipe.parameters():
        parameter.grad = None
    out["eval_again"] = pipe.step((x,), y)  # eval mode: no dropout, the same loss again
    assert pipe.train() is pipe
    out["train_losses"] = [pipe.step((x,), y) for _ in range(2)]  # dropout on: each step draws new masks
    for parameter in pipe.parameters():
        parameter.grad = None

    other = _model(5).state_dict()
    pipe.load_state_dict(other)
    out["loaded"] = all(torch.equal(tensor, other[name]) for name, tensor in pipe.state_dict().items())
    held = sorted(pipe.state_dict())[-1]  # a tensor this rank's stage holds
    try:
        pipe.load_state_dict({name: t for name, t in other.items() if name != held})
        out["missing"] = (held, "")
    except KeyError as error:
        out["missing"] = (held, str(error))
    pipe.eval()
    loaded_loss, loaded_grads = _eval_reference(_model(5), x, y)
    out["loaded_loss"], out["loaded_expected"] = pipe.step((x,), y), loaded_loss
    out["loaded_grads"] = _grads_match(pipe, loaded_grads)

    pipe.export(export_dir)
    dist.barrier()
    program = load_program(export_dir)
    values, _ = _run_stagewise(program, (x,))
    (leaf,) = tree_leaves(program.output_tree)
    eager = copy.deepcopy(_model(5)).eval()(x)
    out["export_max_diff"] = float((values[leaf] - eager).abs().max())
    out["stages"] = program.num_stages
    return out


def _auto_plan_checks(rank: int, cluster: Cluster) -> dict[str, Any]:
    """plan="auto" with a given cluster and optimizer: rank 0 plans exactly what fxpipe.plan plans."""
    x, y = _batch()
    pipe = fxpipe.compile(_model(0), (x,), loss_fn=F.cross_entropy, global_batch_size=BATCH, cluster=cluster,
                          optimizer="sgd")
    sgd = fxpipe.plan(_model(0), (x,), cluster=cluster, global_batch_size=BATCH, optimizer="sgd", all_devices=True,
                      loss_fn=F.cross_entropy)  # compile costs its loss_fn: the same loss
    adam = fxpipe.plan(_model(0), (x,), cluster=cluster, global_batch_size=BATCH, all_devices=True,
                       loss_fn=F.cross_entropy)

    def memory(plan: Any) -> list[int]:
        return [stage.peak_memory_bytes for stage in plan.stages]

    return {"cluster": pipe.plan.cluster, "layout": (pipe.plan.layout, sgd.layout),
            "memory": (memory(pipe.plan), memory(sgd), memory(adam))}


def _ranks(rank: int, world_size: int, store_dir: str, plan_path: str, cluster: Cluster) -> dict[str, Any]:
    results = {}
    for name, body in (("file", lambda: _file_plan_checks(rank, plan_path, str(Path(store_dir) / "export"))),
                       ("auto", lambda: _auto_plan_checks(rank, cluster))):
        join_world(store_dir, name, rank, world_size)
        try:
            results[name] = body()
        finally:
            leave_world()
    return results


@pytest.mark.multiprocess
def test_compile_options_state_dict_export_and_modes_on_two_ranks(tmp_path: Path) -> None:
    x, _ = _batch()
    plan = plan_from_cuts(trace(_model(0), (x,)), (1, 1), BATCH, 2)
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    # weights dwarf compute on a slow link: the planner must pick a two-stage pipeline, not DP
    device = DeviceSpec("cpu-test", 2**33, (("float32", 1e9),), 1e10)
    cluster = Cluster("pub-1x2", 1, 2, device, LinkSpec(1e6), LinkSpec(1e6))
    results = run_ranks(_ranks, 2, tmp_path, str(plan_path), cluster)
    for rank, result in enumerate(results):
        file = result["file"]
        assert file["plan"] == (4, "B", "1:1"), (rank, file["plan"])  # the overrides replaced the file's M=2, A
        assert file["eval_loss"] == pytest.approx(file["eval_expected"], rel=1e-5) and file["eval_grads"], rank
        assert file["eval_again"] == file["eval_loss"], rank
        assert len({file["eval_loss"], *file["train_losses"]}) == 3, (rank, file["train_losses"])
        held, message = file["missing"]
        assert file["loaded"] and f"lacks ['{held}'] held by stage {rank}" in message, (rank, file["missing"])
        assert file["loaded_loss"] == pytest.approx(file["loaded_expected"], rel=1e-5) and file["loaded_grads"]
        assert file["stages"] == 2 and file["export_max_diff"] < 1e-5, file["export_max_diff"]
        auto = result["auto"]
        assert auto["cluster"] == "pub-1x2" and auto["layout"][0] == auto["layout"][1] != "dp", auto
        compiled, sgd, adam = auto["memory"]
        assert compiled == sgd and sgd != adam, auto["memory"]  # optimizer="sgd" reached the memory model
