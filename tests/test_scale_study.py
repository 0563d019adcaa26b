"""The scale study's rows at a tiny size: the virtual_stages="auto" plan, the published v forced, recompute choices."""

from __future__ import annotations

from dataclasses import replace

from benchmarks import scale_study

SHAPE = scale_study.Shape(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=96)
# a published layout with virtual stages, as Megatron-Bridge's TP4 PP8 VP5 in benchmarks/issue33_rows.py
CASE = scale_study.Case("tiny", SHAPE, 16, "1x4:h100", 32, "1:1:1:1", "-", "test", virtual_stages=2)


def test_row_plans_with_virtual_stages_and_forces_the_published_v() -> None:
    (row,) = scale_study.study([CASE])
    assert row.planned is not None and row.virtual is not None and row.forced is not None, row.why
    assert row.forced.layout == "1:1:1:1" and row.forced.virtual_stages == 2
    assert " v=2 " in scale_study.describe(row.forced)[0]  # the published v and its schedule are shown
    assert scale_study.describe(row.virtual, show_v=True)[0].count(" v=") == 1
    assert row.virtual_s > 0 and row.virtual_cpu_s > 0
    assert row.virtual.predicted is not None and row.planned.predicted is not None
    # "auto" keeps v = 1 unless a virtual plan is faster, so it is never slower than the plain plan
    assert row.virtual.predicted.iteration_time_s <= row.planned.predicted.iteration_time_s * (1 + 1e-9)
    assert scale_study.fxpipe_plan(row) is row.virtual
    assert float(scale_study.ratio(row)) <= 1.0 + 1e-9
    text = scale_study.table([row])
    assert "| tiny " in text and "v=2" in text and "v=auto" in text
    assert "v=auto over v=1" in scale_study.summary([row])[0]

    # recompute choices are counted per block over every stage (chunk) of the plan
    plan = row.forced
    num_blocks = sum(stage.stop_block - stage.first_block for stage in plan.stages)
    assert num_blocks > 1 and scale_study.recompute_choices(plan) in (f"keep {num_blocks}", f"block {num_blocks}")
    first = plan.stages[0]
    width = first.stop_block - first.first_block
    mixed = ("attention",) + ("keep",) * (width - 1)
    stages = (replace(first, recompute=False, block_recompute=mixed, block_node_counts=()), *plan.stages[1:])
    rest = [choice for stage in plan.stages[1:] for choice in ["block" if stage.recompute else "keep"]
            * (stage.stop_block - stage.first_block)]
    expected = {"keep": rest.count("keep") + width - 1, "block": rest.count("block"), "attention": 1}
    assert scale_study.recompute_choices(plan.with_updates(stages=stages)) == ", ".join(
        f"{choice} {count}" for choice, count in expected.items() if count)
    assert scale_study.recompute_choices(None) == "-"
