"""torch_compile: compiled stages train as eager ones on every schedule, the batch dim compiles once, inductor's
numerics within float32 rounding, and the options, notes and fallbacks (docs/compile.md)."""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.core.plan import Prediction
from fxpipe.core.recompute import force_recompute
from fxpipe.passes import trace
from fxpipe.runtime.compile.stage_compile import (
    MEASURED_COSTS_NOTE,
    WAIT_NOTE,
    ZERO_BUBBLE_NOTE,
    CompiledStage,
    CompileStats,
    format_compile_stats,
    parse_torch_compile,
    with_compile_notes,
)
from fxpipe.runtime.compiled_stages import CompileFallbackWarning
from fxpipe.runtime.faults.errors import PipelineSetupError
from fxpipe.runtime.numerics.batchnorm import BatchNormWarning
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

NUM_MICROBATCHES = 4
# the plan's 12 rows: slices of 3; then 14 rows: 4, 4, 3, 3 and 10 rows: 3, 3, 2, 2
BATCH_SIZES = (12, 14, 10)
SCHEDULES = (("early_backward", "never"), ("gpipe", "never"), ("early_backward", "always"), ("zero_bubble", "never"))


class CompileNet(nn.Module):
    """An in-place ReLU, layer norm, batch norm in train mode (a buffer written in forward) and a row sum."""

    def __init__(self, batch_norm: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.inp = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.mid = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16) if batch_norm else nn.Identity()
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 6) -> (batch, 3)
        h = torch.relu_(self.inp(self.drop(x)))
        h = self.norm(h)
        h = self.bn(self.mid(h)).tanh()
        return self.out(h + 0.1 * h.sum(-1, keepdim=True))


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _batch(rows: int, seed: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 6, generator=generator),), torch.randn(rows, 3, generator=generator)


def _pipe(schedule: str, recompute: str, torch_compile: Any, rank: int, store_dir: str, name: str,
          batch_norm: bool = True, batch_norm_mode: str = "microbatch", dropout: float = 0.0) -> Any:
    torch.manual_seed(0)
    model = CompileNet(batch_norm, dropout)
    example = _batch(BATCH_SIZES[0], 0)[0]
    plan = plan_from_cuts(trace(copy.deepcopy(model), example), (1, 1), BATCH_SIZES[0], NUM_MICROBATCHES,
                          schedule=schedule)
    join_world(store_dir, name, rank, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BatchNormWarning)  # batch norm over micro-batches: the same in both pipes
        return fxpipe.compile(model, example, loss_fn=_loss, global_batch_size=BATCH_SIZES[0],
                              plan=force_recompute(plan, recompute), torch_compile=torch_compile, costs="analytic",
                              batch_norm=batch_norm_mode)


def _train(pipe: Any, batch_sizes: tuple[int, ...]) -> dict[str, Any]:
    """Steps at ``batch_sizes`` with SGD; each step's loss and gradients, the buffers, the compile stats before
    the first step (after setup's compile) and after the last."""
    optimizer = torch.optim.SGD(pipe.parameters(), lr=1e-2)  # Adam would turn rounding in near-zero gradients into ±lr
    losses, grads = [], []
    stats = [pipe.compile_stats()[pipe.rank]]  # compiled at setup already, its grads and buffers put back
    for step, rows in enumerate(batch_sizes):
        losses.append(pipe.step(*_batch(rows, 100 + step)))
        grads.append({name: p.grad.clone() for name, p in pipe.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        if step == len(batch_sizes) - 1:
            stats.append(pipe.compile_stats()[pipe.rank])
    buffers = {name: b.clone() for name, b in pipe.module.named_buffers()}
    return {"losses": losses, "grads": grads, "buffers": buffers, "stats": stats, "notes": pipe.plan.notes}


def _differences(eager: dict[str, Any], compiled: dict[str, Any], rtol: float, atol: float) -> list[str]:
    problems = []
    pairs = [(f"step {step} grad", e, c) for step, (e, c) in enumerate(zip(eager["grads"], compiled["grads"],
                                                                            strict=True))]
    for kind, expected, actual in [*pairs, ("buffer", eager["buffers"], compiled["buffers"])]:
        for name, tensor in expected.items():
            try:
                torch.testing.assert_close(actual[name], tensor, rtol=rtol, atol=atol)
            except AssertionError as error:
                problems.append(f"{kind} {name}: {str(error).splitlines()[:6]}")
    return problems


def _schedule_matrix(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for index, (schedule, recompute) in enumerate(SCHEDULES):
        key = f"{schedule}/{recompute}"
        runs = {}
        for compiled in (False, True):
            setting = {"backend": "aot_eager"} if compiled else False
            pipe = _pipe(schedule, recompute, setting, rank, store_dir, f"matrix-{index}-{compiled}")
            try:
                runs[compiled] = _train(pipe, BATCH_SIZES)
            finally:
                leave_world()
        results[key] = {"problems": _differences(runs[False], runs[True], rtol=0.0, atol=0.0),
                        "losses": (runs[False]["losses"], runs[True]["losses"]),
                        "stats": runs[True]["stats"], "eager_stats": runs[False]["stats"],
                        "notes": runs[True]["notes"]}
    # one-row slices (batch norm in train mode refuses them, so without it): dynamo specialises size 1
    pipe = _pipe("early_backward", "never", {"backend": "aot_eager"}, rank, store_dir, "one-row", batch_norm=False)
    try:
        pipe.step(*_batch(BATCH_SIZES[0], 1))
        pipe.step(*_batch(5, 2))  # slices of 2 (the dynamic graph), 1, 1, 1 (one more)
        results["one_row_stats"] = pipe.compile_stats()[rank]
    finally:
        leave_world()
    with warnings.catch_warnings(record=True) as caught:  # deferred batch norm: that stage stays eager, said so
        warnings.simplefilter("always", CompileFallbackWarning)
        pipe = _pipe("early_backward", "never", {"backend": "aot_eager"}, rank, store_dir, "deferred",
                     batch_norm_mode="deferred")
    try:
        pipe.step(*_batch(BATCH_SIZES[0], 1))
        results["deferred"] = ([str(w.message) for w in caught if w.category is CompileFallbackWarning],
                               pipe.compile_stats())
    finally:
        leave_world()
    return results


@pytest.mark.multiprocess
@pytest.mark.slow  # ~25 s: eight pipes on two ranks, each compiled stage traced by dynamo
def test_compiled_stages_train_as_eager_on_every_schedule_without_recompiling(tmp_path: Any) -> None:
    """aot_eager (dynamo's graph capture and AOTAutograd's backward, no code generation) against eager stages:
    the same ATen kernels in the same order, so bitwise equal losses, gradients and batch norm buffers."""
    per_rank = run_ranks(_schedule_matrix, 2, tmp_path, timeout_s=240.0)
    for rank, results in enumerate(per_rank):
        for schedule, recompute in SCHEDULES:
            result = results[f"{schedule}/{recompute}"]
            assert result["problems"] == [], (rank, schedule, recompute, result["problems"])
            eager_losses, compiled_losses = result["losses"]
            assert compiled_losses == eager_losses, (rank, schedule)
            assert [s.num_frames for s in result["eager_stats"]] == [0, 0]  # eager stages compile nothing
            assert (ZERO_BUBBLE_NOTE in result["notes"]) == (schedule == "zero_bubble")
            assert WAIT_NOTE.format(timeout_s=60.0) in result["notes"]
            first, last = result["stats"]
            if schedule == "zero_bubble":  # F, B and W cut from the joint graph, traced once per row count: the
                # plan's (3) at setup, 4 and 2 in the steps of 14 and 10 rows
                # stage 0's B has no op (no input gradient: it passes the output gradients on to W) and runs
                # uncompiled, and its W runs inside B as eager's does; stage 1's 4 W passes a step run after B
                frames_per_shape = 2 if rank == 0 else 3
                assert (first.num_frames, first.num_split_shapes) == (frames_per_shape, 1), (rank, first)
                assert (last.num_frames, last.num_split_shapes) == (3 * frames_per_shape, 3), (rank, last)
                # (and one at setup, whose gradients were put back)
                assert last.num_weight_passes == (0 if rank == 0 else 1 + 4 * len(BATCH_SIZES)), (rank, last)
                assert last.w_in_b_reason is None, (rank, last)
                continue
            # the whole stage in one frame, compiled at setup (dynamic batch from the start), its backward with it;
            # steps at other row counts compile nothing more
            assert first.num_frames == 1, (rank, schedule, first)
            assert (last.num_frames, last.num_backward_graphs) == (1, first.num_backward_graphs), (rank, schedule, last)
            assert first.compile_s > 0 and last.eager_reason is None
        warned, (stage0, stage1) = results["deferred"]
        assert stage0.eager_reason is not None and "batch_norm='deferred'" in stage0.eager_reason, stage0
        assert warned == ([f"stage 0 runs eager: {stage0.eager_reason}"] if rank == 0 else []), (rank, warned)
        assert (stage0.num_frames, stage1.num_frames, stage1.eager_reason) == (0, 1, None), (stage0, stage1)
        one_row = results["one_row_stats"]
        assert one_row.num_frames == 2, (rank, one_row)


def _inductor_check(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    runs = {}
    for compiled in (False, True):
        setting = {"options": {"compile_threads": 1}} if compiled else False  # no pool of compile workers to start
        pipe = _pipe("early_backward", "never", setting, rank, store_dir, f"inductor-{compiled}")
        try:
            runs[compiled] = _train(pipe, BATCH_SIZES[:2])
        finally:
            leave_world()
    # inductor fuses layer norm, batch norm and the row sum into loops of its own, which sum in another order
    # than ATen's kernels (matmuls stay ATen's): float32 rounding of ~1e-7 relative per op, a few ops deep and
    # grown by the normalisations' divisions; 1e-5 relative (atol 1e-6 for entries near 0) holds that, while a
    # wrong gradient (a missed term, a scale) is off by far more than 1e-5
    return {"problems": _differences(runs[False], runs[True], rtol=1e-5, atol=1e-6),
            "losses": (runs[False]["losses"], runs[True]["losses"]), "stats": runs[True]["stats"]}


@pytest.mark.multiprocess
@pytest.mark.slow  # ~30-60 s cold: inductor generates and compiles C++ for each rank's forward and backward
def test_inductor_stages_match_eager_within_float32_rounding(tmp_path: Any) -> None:
    per_rank = run_ranks(_inductor_check, 2, tmp_path, timeout_s=300.0)
    for rank, result in enumerate(per_rank):
        assert result["problems"] == [], (rank, result["problems"])
        eager_losses, compiled_losses = result["losses"]
        assert compiled_losses == pytest.approx(eager_losses, rel=1e-5), rank
        assert result["stats"][-1].num_frames == 1, (rank, result["stats"])


def test_torch_compile_setting_is_checked() -> None:
    assert parse_torch_compile(False) is None
    assert parse_torch_compile(True) == {}
    assert parse_torch_compile({"backend": "aot_eager", "dynamic": None}) == {"backend": "aot_eager", "dynamic": None}
    with pytest.raises(PipelineSetupError, match=r"\['bakend'\], which torch.compile does not take"):
        parse_torch_compile({"bakend": "aot_eager"})
    with pytest.raises(PipelineSetupError, match="pass False"):
        parse_torch_compile("inductor")  # type: ignore[arg-type]


def test_plan_notes_say_what_compiling_changes() -> None:
    example = _batch(BATCH_SIZES[0], 0)[0]
    plan = plan_from_cuts(trace(CompileNet(), example), (1, 1), 8, 2, schedule="zero_bubble")
    assert with_compile_notes(plan, None, 60.0) == plan  # eager stages: nothing to note
    wait = WAIT_NOTE.format(timeout_s=60.0)
    assert "timeout_s=60 s" in wait
    assert with_compile_notes(plan, {}, 60.0).notes == (wait, ZERO_BUBBLE_NOTE)
    measured = replace(plan, schedule="early_backward", predicted=Prediction(1.0, 8.0, cost_source="measured"))
    assert with_compile_notes(measured, {"backend": "aot_eager"}, 60.0).notes == (wait, MEASURED_COSTS_NOTE)
    analytic = replace(measured, predicted=Prediction(1.0, 8.0, cost_source="analytic"))
    assert with_compile_notes(analytic, {}, 600.0).notes == (WAIT_NOTE.format(timeout_s=600.0),)


def test_compile_stats_print_one_line_per_stage() -> None:
    stats = [CompileStats(0, 1, 1, 2.25), CompileStats(1, 2, 1, 3.5), CompileStats(1, 1, 1, 1.0),
             CompileStats(2, eager_reason="batch_norm='deferred' keeps statistics outside the graph"),
             CompileStats(3, 9, 0, 4.0, num_split_shapes=3, num_weight_passes=12),
             CompileStats(4, 1, 1, 1.0, w_in_b_reason="its graph draws random numbers")]
    assert format_compile_stats(stats).splitlines() == [
        "torch.compile stage 0: 1 forward frames and 1 backward graphs compiled in 2.2 s",
        "torch.compile stage 1: 2 forward frames and 1 backward graphs compiled in 3.5 s",
        "torch.compile stage 2: eager (batch_norm='deferred' keeps statistics outside the graph)",
        "torch.compile stage 3: 9 forward frames and 0 backward graphs compiled in 4.0 s, split into F/B/W for 3 "
        "row counts",
        "torch.compile stage 4: 1 forward frames and 1 backward graphs compiled in 1.0 s, W inside B (its graph "
        "draws random numbers)",
    ]


def test_train_cli_torch_compile_option() -> None:
    import argparse

    from fxpipe.train_cli import add_train_arguments, timeout_option, torch_compile_option

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    assert torch_compile_option(parser.parse_args(["gpt-mini"])) is False
    assert torch_compile_option(parser.parse_args(["gpt-mini", "--torch-compile"])) is True
    assert torch_compile_option(parser.parse_args(["gpt-mini", "--torch-compile", "aot_eager"])) == {
        "backend": "aot_eager"}
    assert timeout_option(parser.parse_args(["gpt-mini"])) == 60.0
    assert timeout_option(parser.parse_args(["gpt-mini", "--torch-compile"])) == 600.0
    assert timeout_option(parser.parse_args(["gpt-mini", "--torch-compile", "--timeout", "90"])) == 90.0


class _TwoOutputStage(nn.Module):
    """A stage as fxpipe splits them: a tuple of outputs, one of which (a row count) is not a tensor."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = CompileNet()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        out = self.net(self.drop(x))
        return out, torch.relu(x) * 2.0, x.shape[0]


def test_compiled_split_defers_weight_gradients_and_matches_eager_bitwise() -> None:
    """F, B and W cut from the joint graph (aot_eager): B gives the input gradient and no parameter gradient, W
    gives them all; each bitwise equal to eager autograd, and batch norm's buffers move once per micro-batch."""
    from fxpipe.runtime.compile.compiled_split import SplitCompiledStage

    torch.manual_seed(0)
    stage, reference = _TwoOutputStage(), _TwoOutputStage()
    reference.load_state_dict(stage.state_dict())
    part = CompiledStage(stage, [0], {"backend": "aot_eager"}, 0)
    split = SplitCompiledStage(stage, part.compile_part, lambda reason: pytest.fail(reason))
    slices = [torch.randn(rows, 6) for rows in (3, 3, 2)]  # two row counts: two cuts
    grads = [(torch.randn(rows, 3), torch.randn(rows, 6)) for rows in (3, 3, 2)]
    expected_inputs = []
    for x, (g_out, g_relu) in zip(slices, grads, strict=True):
        leaf = x.clone().requires_grad_(True)
        out, relu, _ = reference(leaf)
        torch.autograd.backward([out, relu], [g_out, g_relu])
        expected_inputs.append(leaf.grad)
    ran = [split.forward([x], [True], [False]) for x in slices]
    assert all(item is not None for item in ran)
    works = []
    for item, (g_out, g_relu), expected in zip(ran, grads, expected_inputs, strict=True):
        assert item is not None
        outputs, saved = item
        assert saved.graphs.differentiable_outputs == (0, 1) and outputs[2] == slices[len(works)].shape[0]
        (input_grad,), work = split.backward_input(saved, [g_out, g_relu])
        assert torch.equal(input_grad, expected)
        works.append(work)
    assert all(p.grad is None for p in stage.parameters())  # B left every parameter gradient to W
    for work in works:
        split.backward_weight(work, None)
    assert split.num_shapes == 2 and split.num_weight_passes == 3
    for (name, param), expected_param in zip(stage.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(param.grad, expected_param.grad), name
    for (name, buffer), expected_buffer in zip(stage.named_buffers(), reference.buffers(), strict=True):
        assert torch.equal(buffer, expected_buffer), name


def test_compiled_split_falls_back_on_random_ops() -> None:
    """Dropout draws in F what W, run later, could not redraw: the stage says so and runs whole."""
    from fxpipe.runtime.compile.compiled_split import SplitCompiledStage

    reasons: list[str] = []
    stage = _TwoOutputStage(dropout=0.1)
    part = CompiledStage(stage, [0], {"backend": "aot_eager"}, 0)
    split = SplitCompiledStage(stage, part.compile_part, reasons.append)
    buffers = [b.clone() for b in stage.buffers()]
    assert split.forward([torch.randn(3, 6)], [True], [False]) is None
    assert split.forward([torch.randn(3, 6)], [True], [False]) is None  # said once
    assert len(reasons) == 1 and "draws random numbers" in reasons[0] and "bernoulli" in reasons[0], reasons
    assert all(torch.equal(a, b) for a, b in zip(buffers, stage.buffers(), strict=True))  # tracing wrote nothing


def _setup_compile_check(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    """Pipes with dropout: what fxpipe.compile leaves behind, eager against compiled (which runs the stages at setup)."""
    results: dict[str, Any] = {}
    for schedule in ("early_backward", "zero_bubble"):
        left = {}
        for compiled in (False, True):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CompileFallbackWarning)
                pipe = _pipe(schedule, "never", {"backend": "aot_eager"} if compiled else False, rank, store_dir,
                             f"setup-{schedule}-{compiled}", dropout=0.25)
            try:
                left[compiled] = (torch.get_rng_state(), {n: b.clone() for n, b in pipe.module.named_buffers()},
                                  [p.grad for p in pipe.parameters()])
                before = pipe.compile_stats()[rank].num_frames if compiled else 0
                pipe.step(*_batch(BATCH_SIZES[0], 1))
                stats = pipe.compile_stats()[rank] if compiled else None
            finally:
                leave_world()
        rng, buffers, grads = left[True]
        results[schedule] = {"rng_equal": torch.equal(rng, left[False][0]), "grads": grads,
                             "buffers_equal": all(torch.equal(b, left[False][1][n]) for n, b in buffers.items()),
                             "stats": stats, "frames_before_step": before, "warned": [str(w.message) for w in caught
                                                        if w.category is CompileFallbackWarning]}
    return results


@pytest.mark.multiprocess
def test_setup_compiles_the_stages_and_puts_back_what_it_touched(tmp_path: Any) -> None:
    """fxpipe.compile runs each compiled stage forward and backward at setup (so the first step compiles nothing): the
    random number generator (dropout drew from it), batch norm's buffers and the gradients are as an eager pipe leaves
    them. Under zero-bubble the dropout stage cannot be cut into F, B and W: it runs W inside B, warned once."""
    per_rank = run_ranks(_setup_compile_check, 2, tmp_path, timeout_s=240.0)
    for rank, results in enumerate(per_rank):
        for schedule, result in results.items():
            assert result["rng_equal"] and result["buffers_equal"], (rank, schedule)
            assert all(grad is None for grad in result["grads"]), (rank, schedule)
            # every frame at setup, none in the step: the stage whole (1), or cut into F, B and W (3)
            frames = 3 if schedule == "zero_bubble" and rank == 1 else 1
            assert (result["frames_before_step"], result["stats"].num_frames) == (frames, frames), (rank, result)
        split = results["zero_bubble"]
        dropped = rank == 0  # the dropout layer sits in stage 0 (it fell back during setup's run)
        assert (split["stats"].w_in_b_reason is not None) == dropped, (rank, split["stats"])
        if dropped:
            assert "draws random numbers" in split["stats"].w_in_b_reason
            assert split["warned"] == [f"stage 0 runs its whole backward in B (zero-bubble's W does no work): "
                                       f"{split['stats'].w_in_b_reason}"], split["warned"]
        else:
            assert split["warned"] == [] and split["stats"].num_split_shapes == 1, (rank, split)
