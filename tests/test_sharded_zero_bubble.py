"""Sharded stage replicas under zero-bubble's split backward (B now, W later) on 4 gloo ranks: FSDP2 reduces
after W, not in B's hooks (fxpipe.runtime.parallel.sharded_stage.ShardedStage.after_weights). ZeRO-1 and ZeRO-2 train
exactly as one process (tied weights, clipping, AdamW, a compiled stage running W inside B), with the
reduce-scatters per step the levels promise: a W whose gradients missed them fails both checks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.schedule import Op
from fxpipe.runtime.execution.actions import stage_actions
from fxpipe.runtime.faults.errors import PipelineSetupError
from tests.exactness_oracle import train_reference
from tests.mp_utils import run_ranks
from tests.test_sharded_stages import (
    GLOBAL_BATCH,
    MODEL,
    NUM_MICROBATCHES,
    UNTIED,
    WORLD_SIZE,
    _batches,
    _clipped,
    _compile,
    _count_fsdp_collectives,
    _exported_matches,
    _train,
    _world,
)

# (name, model, replicas per stage, sharding, torch_compile): 2:2 splits W on the last stage (stage 0 has no
# differentiable input: its whole backward is in B); 1:3 shards the last stage three ways; the compiled stages
# cannot be cut under FSDP2 and run their whole backward in B (CompileFallbackWarning), reduced after the last W
CASES = (
    ("optimizer 2:2", MODEL, (2, 2), "optimizer", False),
    ("gradients 1:3", MODEL, (1, 3), "gradients", False),
    ("gradients 2:2 compiled", UNTIED, (2, 2), "gradients", {"backend": "aot_eager"}),
)


def _collectives(plan: Any, stage_index: int, whole_in_b: bool) -> tuple[int, int]:
    """FSDP2's (all-gathers, reduce-scatters) per step on a sharded rank: one all-gather; ZeRO-1 one reduce-scatter
    after the last W, ZeRO-2 one after every micro-batch's W, except a W that finds nothing to reduce (a stage whose
    B runs the whole backward, with no B since the last W reduced: FSDP2 skips an empty reduction)."""
    if plan.stages[stage_index].sharding == "none":
        return (0, 0)
    if plan.stages[stage_index].sharding == "optimizer":
        return (1, 1)
    actions = stage_actions(plan.schedule, plan.num_stages, plan.num_microbatches, plan.warmup_policy, stage_index)
    count, pending = 0, False
    for action in actions.actions:
        pending = pending or action.op is Op.BACKWARD
        if action.op is Op.WEIGHT:
            count += pending or not whole_in_b
            pending = False
    assert count <= NUM_MICROBATCHES
    return (1, count)


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    references = {model: train_reference(zoo.build(model, **zoo.get(model).tiny_overrides)[0], zoo.get(model).loss_fn,
                                         _batches(model=model), after_backward=_clipped) for model in (MODEL, UNTIED)}
    _count_fsdp_collectives()
    results: dict[str, Any] = {}
    for index, (name, model, replicas, level, compiled) in enumerate(CASES):
        with _world(store_dir, f"zb-{index}", rank, world_size):
            pipe = _compile(replicas, level, "zero_bubble", "never", model_name=model, torch_compile=compiled)
            record = _train(pipe, references[model], model)
            record["problems"] += _exported_matches(pipe, references[model])
            record["reference_norms"] = references[model]["after_backward"]
            record["stage"] = pipe.stage_index
            record["schedule"] = pipe.plan.schedule
            # stage 0 has no differentiable input and a compiled sharded stage is not cut: B runs the whole backward
            record["expected"] = _collectives(pipe.plan, pipe.stage_index, bool(compiled) or pipe.stage_index == 0)
            record.pop("optimizer")
            results[name] = record
    with _world(store_dir, "zb-planned", rank, world_size):  # the planner's path: a layout, its cuts, the level
        model, example_inputs = zoo.build(MODEL, **zoo.get(MODEL).tiny_overrides)
        pipe = fxpipe.compile(model, example_inputs, loss_fn=zoo.get(MODEL).loss_fn, global_batch_size=GLOBAL_BATCH,
                              plan="2:2", costs="analytic", cluster="local:4", num_microbatches=NUM_MICROBATCHES,
                              schedule="zero_bubble", sharding="gradients")
        record = _train(pipe, references[MODEL], MODEL)
        results["planned"] = {"problems": record["problems"], "levels": record["levels"],
                              "schedule": pipe.plan.schedule}
    return results


@pytest.mark.multiprocess
def test_zero_bubble_trains_sharded_stages_exactly_and_reduces_after_w(tmp_path: Path) -> None:
    failures = []
    for rank, results in enumerate(run_ranks(_run, WORLD_SIZE, tmp_path)):
        for name, _, replicas, level, _ in CASES:
            record = results[name]
            failures += [f"{name} rank {rank}: {p}" for p in record["problems"][:3]]
            norms, reference = torch.tensor(record["norms"]), torch.tensor(record["reference_norms"])
            if not (bool((reference > 0.05).all()) and torch.allclose(norms, reference, rtol=1e-5, atol=0.0)):
                failures.append(f"{name} rank {rank}: clipped norms {record['norms']} vs {record['reference_norms']}")
            sharded = replicas[record["stage"]] > 1
            if record["sharded"] != sharded or record["schedule"] != "zero_bubble":
                failures.append(f"{name} rank {rank}: stage {record['stage']} sharded={record['sharded']} "
                                f"under {record['schedule']}")
            if record["levels"] != [level if count > 1 else "none" for count in replicas]:
                failures.append(f"{name} rank {rank}: the plan records levels {record['levels']}")
            expected = record["expected"]
            if record["collectives"] != expected or (sharded and level == "gradients" and record["stage"] > 0
                                                     and expected != (1, NUM_MICROBATCHES)):
                failures.append(f"{name} rank {rank}: (all-gathers, reduce-scatters) per step {record['collectives']}, "
                                f"want {expected}")
        planned = results["planned"]
        failures += [f"planned rank {rank}: {p}" for p in planned["problems"][:3]]
        if planned["levels"] != ["gradients", "gradients"] or planned["schedule"] != "zero_bubble":
            failures.append(f"planned rank {rank}: levels {planned['levels']} under {planned['schedule']}")
    assert not failures, "\n".join(failures)


def test_zero3_under_zero_bubble_is_refused_naming_the_stage_and_the_alternatives() -> None:
    from fxpipe.compile_options import CompileOptions
    from fxpipe.compile_plan import apply_overrides
    from tests.test_sharded_stages import _plan

    zero3 = CompileOptions(loss_fn=None, global_batch_size=None, sharding=("none", "parameters"))
    with pytest.raises(PipelineSetupError, match=r"stages \[1\].*'parameters'.*sharding='gradients'"):
        apply_overrides(_plan((1, 2), schedule="zero_bubble"), zero3)
    for level in ("optimizer", "gradients"):
        options = CompileOptions(loss_fn=None, global_batch_size=None, sharding=level)
        assert [s.sharding for s in apply_overrides(_plan((2, 1), "zero_bubble"), options).stages] == [level, "none"]


def test_running_fsdp2s_post_backward_names_the_torch_version_when_its_private_state_is_missing() -> None:
    from fxpipe.runtime.parallel.sharded_stage import run_post_backward

    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)}: FSDP2's state .* lacks .*post_backward"):
        run_post_backward(torch.nn.Linear(2, 2))  # type: ignore[arg-type]  # not fully_shard-ed: no FSDP2 state
