"""Value shapes at new input shapes from a symbolic run's formulas (issue #32 item 4): exactly the fake run's, or the
fake run itself where the formulas do not cover the shape; the shape cache's LRU bound."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fxpipe import models as zoo
from fxpipe.core.plan import Plan
from fxpipe.core.program import SplitProgram
from fxpipe.passes import trace
from fxpipe.passes.codegen import split_for_plan
from fxpipe.runtime.execution import stage_routes
from fxpipe.runtime.execution.stage_routes import ShapedSteps
from fxpipe.runtime.faults.errors import BatchShapeError
from fxpipe.runtime.transport.batch_layout import make_layout
from fxpipe.runtime.transport.fake_run import fake_layouts
from fxpipe.runtime.transport.shape_templates import MAX_TEMPLATES, ShapeTemplates
from tests.mp_utils import plan_from_cuts

torch.set_num_threads(1)
CPU = torch.device("cpu")
GLOBAL_BATCH = 8
# (rows, length) of each batch: new lengths at the training batch, the short last batch (rows 5 and 3: micro-batches
# of 3 and 2 rows), single-row micro-batches (a size-1 dim: symbolic runs specialise it), a bigger evaluation batch
BATCHES = [(GLOBAL_BATCH, length) for length in (9, 13, 17, 30, 31)] + [
    (5, 12), (3, 21), (2, 7), (2, 19), (GLOBAL_BATCH, 12), (24, 15), (24, 28), (GLOBAL_BATCH, 6)]


class Halves(nn.Module):
    """Token model whose values are not affine in the length: a stride-2 conv halves it (``(T - 1) // 2 + 1``), and
    ``[:, :, :12]`` keeps at most 12 positions (a guard ``T' <= 12`` or ``T' > 12``: the formulas of a run on one
    side do not cover the other, so the fake run answers there)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 8)
        self.conv = nn.Conv1d(8, 8, kernel_size=3, stride=2, padding=1)
        self.head = nn.Linear(8, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.embed(idx).transpose(1, 2))  # (B, 8, ceil(T / 2))
        h = torch.relu(h[:, :, :12]).transpose(1, 2)  # (B, min(ceil(T / 2), 12), 8)
        return self.head(h)


def _program(model: nn.Module, example: Any, replicas: tuple[int, ...] = (2, 1)) -> tuple[Plan, SplitProgram]:
    gm = trace(model, example)
    plan = plan_from_cuts(gm, replicas, GLOBAL_BATCH, 2)
    return plan, split_for_plan(gm, plan)


def _gpt() -> tuple[Plan, SplitProgram]:
    model, example = zoo.build("gpt-mini", n_layer=2, n_embd=16, n_head=2, block_size=32, vocab_size=40)
    return _program(model, example)


def _llama() -> tuple[Plan, SplitProgram]:
    hf_examples = pytest.importorskip("fxpipe.hf_examples")
    pytest.importorskip("transformers")
    model, example = hf_examples.llama(num_layers=2, batch_size=GLOBAL_BATCH, seq_len=16)
    plan, program = _program(model, example, (1, 2))
    assert trace(model, example).meta["fxpipe.frontend"] == "export"
    return plan, program


def _halves() -> tuple[Plan, SplitProgram]:
    return _program(Halves(), (torch.zeros(GLOBAL_BATCH, 20, dtype=torch.long),))


def _inputs(program: SplitProgram, rows: int, length: int) -> tuple[torch.Tensor, ...]:
    """Model inputs of ``rows`` x ``length`` tokens (the mask, where the model takes one, all ones)."""
    return tuple(torch.ones(rows, length, dtype=program.values[name].dtype) for name in program.model_inputs)


@pytest.mark.parametrize("build", [_gpt, _llama, _halves], ids=["gpt-mini", "hf-llama-export", "halves"])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_formulas_give_exactly_the_fake_runs_shapes_and_dtypes(build: Any, autocast_dtype: torch.dtype | None) -> None:
    plan, program = build()
    from fxpipe.runtime.transport.batch_layout import infer_value_dtypes

    dtypes = infer_value_dtypes(program, CPU, autocast_dtype)
    templates = ShapeTemplates(program, CPU, autocast_dtype)
    for rows, length in BATCHES:
        inputs = _inputs(program, rows, length)
        fast = make_layout(program, plan, inputs, rows, CPU, autocast_dtype, dtypes, templates)
        full = make_layout(program, plan, inputs, rows, CPU, autocast_dtype, dtypes)
        assert (fast.shapes, fast.dtypes, fast.microbatch_ranges) == (full.shapes, full.dtypes, full.microbatch_ranges), \
            (rows, length)
    assert templates.counts["template"] >= len(BATCHES) // 2  # most new shapes came from formulas, no run
    assert templates.counts["fake"] == 0 or build is _halves
    if build is _halves:  # lengths past 24 (more than 12 conv positions) lie outside the first runs' guards
        assert templates.counts["symbolic"] >= 2


def test_uncovered_shapes_fall_back_to_the_fake_run_and_its_errors() -> None:
    _, program = _halves()
    templates = ShapeTemplates(program, CPU, None)
    name = program.model_inputs[0]
    for length in (10, 11, 14, 40, 41, 22, 60):  # both sides of the 12-position cut, several times
        sliced = {name: ((4, length), torch.long)}
        assert templates.layouts(sliced) == fake_layouts(program, CPU, None, sliced), length
    assert templates.counts["symbolic"] >= 2 and templates.counts["template"] >= 3
    _, gpt = _gpt()
    templates = ShapeTemplates(gpt, CPU, None)
    templates.layouts({gpt.model_inputs[0]: ((4, 20), torch.long)})
    with pytest.raises(RuntimeError, match="broadcast"):  # past the position table (32): the model's own error
        templates.layouts({gpt.model_inputs[0]: ((4, 40), torch.long)})
    plan, gpt = _gpt()
    with pytest.raises(BatchShapeError, match="does not run at input shapes"):
        make_layout(gpt, plan, _inputs(gpt, 8, 40), 8, CPU, None, {}, ShapeTemplates(gpt, CPU, None))


def test_templates_are_bounded_and_keep_the_recently_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.transport import shape_templates

    _, program = _halves()
    name = program.model_inputs[0]
    short, long = {name: ((4, 10), torch.long)}, {name: ((4, 40), torch.long)}  # either side of the 12-position cut
    monkeypatch.setattr(shape_templates, "MAX_TEMPLATES", 1)
    templates = ShapeTemplates(program, CPU, None)
    for sliced in (short, long, short):
        templates.layouts(sliced)
        assert len(templates.templates) == 1
    assert templates.counts == {"template": 0, "symbolic": 3, "fake": 0}  # the short one's run was dropped
    monkeypatch.setattr(shape_templates, "MAX_TEMPLATES", 2)
    templates = ShapeTemplates(program, CPU, None)
    for sliced in (short, long, short, long):
        templates.layouts(sliced)
    assert templates.counts == {"template": 2, "symbolic": 2, "fake": 0} and len(templates.templates) == 2
    assert MAX_TEMPLATES >= 2


def test_shaped_steps_keep_at_most_the_bound_least_recently_used_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_routes, "MAX_CACHED_SHAPES", 5)
    plan, program = _gpt()
    steps = ShapedSteps(program, plan, 0, 0, CPU, None, {name: spec.dtype for name, spec in program.values.items()}, 0)
    first = _inputs(program, GLOBAL_BATCH, 3)
    steps.add(first, None)
    for length in range(4, 30):  # many new lengths; the first one is used again after each
        steps.add(_inputs(program, GLOBAL_BATCH, length), None)
        assert steps.known(first, None) is not None, length  # recently used: never the one dropped
        assert len(steps.by_signature) <= 5
    assert steps.known(_inputs(program, GLOBAL_BATCH, 4), None) is None  # long unused: dropped
    assert steps.templates.counts["template"] >= 20  # one symbolic run answered the rest


def test_a_model_without_a_usable_symbolic_run_gets_the_plain_fake_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.runtime.transport import shape_templates

    _, program = _gpt()
    name = program.model_inputs[0]
    sizes = [{name: ((4, length), torch.long)} for length in (5, 9, 13)]
    monkeypatch.setattr(shape_templates, "trace_template", lambda *args: None)  # e.g. a data-dependent size
    templates = ShapeTemplates(program, CPU, None)
    assert [templates.layouts(s) for s in sizes] == [fake_layouts(program, CPU, None, s) for s in sizes]
    assert templates.counts == {"template": 0, "symbolic": 0, "fake": 3} and templates.symbolic

    def fails(*args: Any) -> None:
        raise RuntimeError("no symbolic support in some operator")

    monkeypatch.setattr(shape_templates, "trace_template", fails)
    templates = ShapeTemplates(program, CPU, None)
    assert [templates.layouts(s) for s in sizes] == [fake_layouts(program, CPU, None, s) for s in sizes]
    assert templates.counts == {"template": 0, "symbolic": 0, "fake": 3} and not templates.symbolic
