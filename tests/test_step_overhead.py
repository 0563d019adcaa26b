"""World-of-one step: exact accumulation without the gradient stash, and no fixed per-step collectives or syncs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from tests.mp_utils import plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

ENTRY = zoo.get("mlp")
BATCH = 8


def _mlp() -> tuple[torch.nn.Module, tuple[Any, ...]]:
    return zoo.build("mlp", **ENTRY.tiny_overrides)


def _sum_and_count(output: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """token_mean form of the zoo's mean squared error: (sum over elements, number of elements)."""
    return ((output - targets) ** 2).sum(), torch.tensor(targets.numel())


def _counts(step: Any) -> dict[str, int]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    events = Counter(event.name for event in prof.events())
    return {"syncs": events["aten::_local_scalar_dense"],
            "collectives": sum(n for name, n in events.items() if name.startswith("c10d::")),
            "muls": events["aten::mul"]}


def _two_steps(pipe: Any, reference: torch.nn.Module, batches: list[Any]) -> dict[str, Any]:
    """Two steps without zeroing gradients on both sides: losses and accumulated gradients."""
    losses = []
    for inputs, targets in batches:
        loss = pipe.step(inputs, targets)
        expected = ENTRY.loss_fn(reference(*inputs), targets)
        expected.backward()
        losses.append((loss, expected.item()))
    reference_grads = dict(reference.named_parameters())
    worst = max(float(((p.grad - reference_grads[n].grad).abs() / (reference_grads[n].grad.abs() + 1e-6)).max())
                for n, p in pipe.named_parameters())
    return {"losses": losses, "worst_grad_rel": worst}


def _world_of_one(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    batches = [ENTRY.make_batch(BATCH, seed, **ENTRY.tiny_overrides) for seed in (1, 2)]
    gpipe_plan = plan_from_cuts(trace(*_mlp()), (1,), BATCH, 2, schedule="gpipe")
    result: dict[str, Any] = {}
    for name, options in (("dp_m1", {"plan": "dp", "num_microbatches": 1}),
                          ("gpipe_m2", {"plan": gpipe_plan}),
                          ("token_mean_m2", {"plan": gpipe_plan, "loss_reduction": "token_mean"})):
        token_mean = options.get("loss_reduction") == "token_mean"
        pipe = fxpipe.compile(*_mlp(), loss_fn=_sum_and_count if token_mean else ENTRY.loss_fn,
                              global_batch_size=BATCH, **options)
        result[name] = _two_steps(pipe, _mlp()[0], batches)
        result[name]["counts"] = _counts(lambda pipe=pipe: pipe.step(*batches[0]))
        result[name]["stashes"] = pipe.driver._stashes
        pipe.close()
    return result


def test_world_of_one_accumulates_exactly_with_one_sync_and_no_collective(tmp_path: Any) -> None:
    (result,) = run_ranks(_world_of_one, 1, tmp_path)
    for name, case in result.items():
        for loss, expected in case["losses"]:
            assert loss == pytest.approx(expected, rel=1e-6), name
        assert case["worst_grad_rel"] < 1e-4, name
        # a world of one reduces nothing: no loss or gradient collective, and the loss is read once per step
        assert case["counts"]["collectives"] == 0, name
        assert case["counts"]["syncs"] <= 1, name
    # M=1 on one replica: no loss weighting op (the zoo's MSE itself has no aten::mul)
    assert result["dp_m1"]["counts"]["muls"] == 0
    assert not result["dp_m1"]["stashes"] and not result["gpipe_m2"]["stashes"]
    assert result["token_mean_m2"]["stashes"]  # this step's gradients are divided by its count alone
