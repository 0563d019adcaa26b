"""Recomputed stages train exactly: same dropout masks as kept activations, same gradients as one process (gloo)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.recompute import force_recompute
from fxpipe.passes import trace
from tests.exactness_oracle import train_and_compare, train_reference
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 12
NUM_MICROBATCHES = 3  # stage 0 holds two micro-batches in flight: recomputation saves memory there


class DropoutMLP(nn.Module):
    """Four linear layers with dropout between them (p=0 for the comparison with one process)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(6, 16), nn.GELU(), nn.Dropout(p),
            nn.Linear(16, 16), nn.GELU(), nn.Dropout(p),
            nn.Linear(16, 16), nn.GELU(), nn.Dropout(p),
            nn.Linear(16, 3),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, 6) -> (batch, 3)
        return self.layers(x)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _batch(seed: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(GLOBAL_BATCH, 6, generator=generator),), torch.randn(GLOBAL_BATCH, 3, generator=generator)


def _compile(p: float, recompute: str, rank: int, store_dir: str, name: str) -> Any:
    torch.manual_seed(0)
    model = DropoutMLP(p)
    example = (torch.randn(GLOBAL_BATCH, 6),)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example), (1, 1), GLOBAL_BATCH, NUM_MICROBATCHES)
    join_world(store_dir, name, rank, 2)
    return fxpipe.compile(model, example, loss_fn=_loss, global_batch_size=GLOBAL_BATCH,
                          plan=force_recompute(plan, recompute))


def _dropout_step(p: float, recompute: str, seed: int, rank: int, store_dir: str, name: str) -> dict[str, Any]:
    """One measured step with dropout drawn from ``seed`` on every rank; gradients and the activation peak."""
    try:
        pipe = _compile(p, recompute, rank, store_dir, name)
        pipe.measure = True
        inputs, targets = _batch(7)
        torch.manual_seed(seed)
        loss = pipe.step(inputs, targets)
        peak = pipe.step_stats()[rank].peak_activation_bytes
        flags = [stage.recompute for stage in pipe.plan.stages]
        return {"loss": loss, "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()}, "peak": peak,
                "flags": flags}
    finally:
        leave_world()


def _all_checks(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    """Every check on this rank, as plain data (tensors do not cross the result queue)."""
    keep = _dropout_step(0.3, "never", 1, rank, store_dir, "keep")
    recompute = _dropout_step(0.3, "always", 1, rank, store_dir, "recompute")
    other_seed = _dropout_step(0.3, "never", 2, rank, store_dir, "other-seed")
    mismatches = []
    for name, grad in keep["grads"].items():
        try:
            torch.testing.assert_close(recompute["grads"][name], grad, rtol=1e-6, atol=0.0)
        except AssertionError as error:
            mismatches.append(f"{name}: {str(error).splitlines()[:3]}")
    batches = [_batch(100 + step) for step in range(2)]
    torch.manual_seed(0)
    reference = train_reference(DropoutMLP(0.0), _loss, batches)
    try:
        pipe = _compile(0.0, "recompute,keep", rank, store_dir, "oracle")
        oracle = train_and_compare(pipe, batches, reference)
        oracle_flags = [stage.recompute for stage in pipe.plan.stages]
    finally:
        leave_world()
    return {
        "zoo_problems": _zoo_models_recomputed(rank, store_dir),
        "flags": (keep["flags"], recompute["flags"], oracle_flags),
        "losses": (keep["loss"], recompute["loss"]),
        "mismatches": mismatches,
        "seed_matters": any(not torch.allclose(other_seed["grads"][name], grad)
                            for name, grad in keep["grads"].items()),
        "peaks": (keep["peak"], recompute["peak"]),  # printed by the assertions below
        "oracle_problems": oracle["problems"],
    }


def _zoo_models_recomputed(rank: int, store_dir: str) -> list[str]:
    """Skip connections across the cut (skipnet) and tied weights (tied-lm), every stage recomputing."""
    problems = []
    for name in ("skipnet", "tied-lm"):
        entry = zoo.get(name)
        batches = [entry.make_batch(GLOBAL_BATCH, 100 + step, **entry.tiny_overrides) for step in range(2)]
        reference = train_reference(zoo.build(name, **entry.tiny_overrides)[0], entry.loss_fn, batches)
        model, example = zoo.build(name, **entry.tiny_overrides)
        plan = plan_from_cuts(trace(copy.deepcopy(model), example), (1, 1), GLOBAL_BATCH, NUM_MICROBATCHES)
        join_world(store_dir, f"zoo-{name}", rank, 2)
        try:
            pipe = fxpipe.compile(model, example, loss_fn=entry.loss_fn, global_batch_size=GLOBAL_BATCH,
                                  plan=force_recompute(plan, "always"))
            problems += [f"{name}: {p}" for p in train_and_compare(pipe, batches, reference)["problems"]]
        finally:
            leave_world()
    return problems


def test_recompute_is_exact_with_dropout_and_against_one_process(tmp_path: Any) -> None:
    per_rank = run_ranks(_all_checks, 2, tmp_path)
    for rank, result in enumerate(per_rank):
        assert result["flags"] == ([False, False], [True, True], [True, False]), rank
        # restored RNG state: the recomputed forward draws the masks the first forward drew
        assert result["losses"][0] == result["losses"][1], (rank, result["losses"])
        assert result["mismatches"] == [], (rank, result["mismatches"])
        # dropout is live: another seed gives other gradients, so the equality above is not vacuous
        assert result["seed_matters"], rank
        # only inputs are kept between forward and backward, plus the one micro-batch rebuilt in each
        # backward: less than keeping two micro-batches (rank 0, S - s = 2 in flight) and at least one's
        keep_peak, recompute_peak = result["peaks"]
        in_flight = 2 - rank
        assert keep_peak / in_flight <= recompute_peak, (rank, result["peaks"])
        assert recompute_peak < keep_peak or in_flight == 1, (rank, result["peaks"])
        # per-stage setting "recompute,keep": gradients and AdamW parameters against one process
        assert result["oracle_problems"] == [], (rank, result["oracle_problems"])
        assert result["zoo_problems"] == [], (rank, result["zoo_problems"])
