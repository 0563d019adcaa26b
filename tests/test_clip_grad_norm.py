"""pipe.clip_grad_norm_: the whole model's norm with each parameter counted once (units), and on 3 gloo ranks the
unsplit model's norm, clipped gradients and weights after clipped AdamW steps, and torch's non-finite handling."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from fxpipe.runtime.clipping import (
    NormTypeError,
    check_finite,
    check_norm_type,
    counted_gradients,
    counts_parameter,
    local_share,
    reduce_op,
    scale_gradients,
    total_norm,
)
from tests.exactness_oracle import train_and_compare, train_reference
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

CPU = torch.device("cpu")
INF = math.inf

# ---- the counting rule and the norm from shares (one process) ------------------------------------------------


def test_each_parameter_counts_on_one_rank_only() -> None:
    owners = {"embedding.weight": (0, 2)}  # tied: held by stages 0 and 2
    # (name, stage, replica) -> counted
    table = {("embedding.weight", 0, 0): True, ("embedding.weight", 0, 1): False,
             ("embedding.weight", 2, 0): False, ("embedding.weight", 2, 1): False,
             ("blocks.0.weight", 1, 0): True, ("blocks.0.weight", 1, 1): False, ("blocks.0.weight", 1, 2): False,
             ("head.bias", 2, 0): True}
    assert {key: counts_parameter(*key, owners) for key in table} == table


def test_counted_gradients_skip_missing_grads_and_uncounted_copies() -> None:
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    a.grad, c.grad = torch.ones(2), torch.full((2,), 2.0)  # b has no gradient
    named = [("a", a), ("b", b), ("c", c)]
    ties = (("c", (0, 1)),)
    assert [g.tolist() for g in counted_gradients(named, 0, 0, ties)] == [[1.0, 1.0], [2.0, 2.0]]
    assert [g.tolist() for g in counted_gradients(named, 1, 0, ties)] == [[1.0, 1.0]]  # c counts on stage 0
    assert counted_gradients(named, 0, 1, ties) == []  # a second replica counts nothing


@pytest.mark.parametrize("norm_type", [0.0, -1.0, -INF, math.nan, "nan"])
def test_norm_types_that_do_not_split_over_ranks_are_refused(norm_type: Any) -> None:
    with pytest.raises(NormTypeError, match="norm_type=.*positive p"):
        check_norm_type(norm_type)
    assert check_norm_type("inf") == INF and check_norm_type(2) == 2.0


def _job_total(rank_grads: list[list[torch.Tensor]], norm_type: float) -> torch.Tensor:
    """The total as the collective computes it, with the allreduce done here over per-"rank" shares."""
    shares = torch.stack([local_share(grads, norm_type, CPU) for grads in rank_grads])
    reduced = shares.amax(0) if reduce_op(norm_type) == "max" else shares.sum(0)
    return total_norm(reduced, norm_type)


def _grads(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def _torch_clip(grads: list[torch.Tensor], max_norm: float, norm_type: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    return total, [p.grad for p in params if p.grad is not None]


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, INF])
def test_shares_over_ranks_give_torchs_norm_and_clipped_gradients(norm_type: float) -> None:
    grads = _grads((4, 3), (5,), (2, 2, 2), (7,))
    expected, clipped = _torch_clip(grads, 0.1, norm_type)
    total = _job_total([grads[:1], [], grads[1:3], grads[3:]], norm_type)  # one rank counts nothing
    assert total.dtype == expected.dtype
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0.0)
    ours = [g.clone() for g in grads]
    scale_gradients([_with_grad(g) for g in ours], 0.1, total)
    torch.testing.assert_close(ours, clipped, rtol=1e-6, atol=0.0)


def _with_grad(grad: torch.Tensor) -> nn.Parameter:
    param = nn.Parameter(torch.zeros_like(grad))
    param.grad = grad
    return param


def test_total_takes_the_promoted_dtype_of_the_gradient_norms() -> None:
    bf16, fp16 = _grads((6,), dtype=torch.bfloat16), _grads((3,), dtype=torch.float16, seed=1)
    for rank_grads in ([bf16, []], [bf16, fp16]):
        expected, _ = _torch_clip([g for grads in rank_grads for g in grads], 1.0, 2.0)
        total = _job_total(rank_grads, 2.0)
        assert total.dtype == expected.dtype  # bfloat16 alone, float32 for bfloat16 with float16
        torch.testing.assert_close(total, expected, rtol=1e-2, atol=0.0)
    empty = _job_total([[], []], 2.0)
    assert empty.dtype == torch.float32 and empty.item() == 0.0  # torch: tensor(0.) without gradients


@pytest.mark.parametrize(("bad", "norm_type"), [(INF, 2.0), (INF, INF), (math.nan, 2.0), (math.nan, INF)])
def test_non_finite_totals_behave_as_torch(bad: float, norm_type: float) -> None:
    grads = _grads((3,), (4,))
    grads[1][2] = bad
    expected, clipped = _torch_clip(grads, 1.0, norm_type)
    total = _job_total([grads[:1], grads[1:], []], norm_type)
    assert (total.isnan().item(), total.isinf().item()) == (expected.isnan().item(), expected.isinf().item())
    with pytest.raises(RuntimeError, match=r"is non-finite \((inf|nan)\), so it cannot be clipped.*error_if_nonfinite=False"):
        check_finite(total, norm_type)
    ours = [g.clone() for g in grads]
    scale_gradients([_with_grad(g) for g in ours], 1.0, total)
    torch.testing.assert_close(ours, clipped, equal_nan=True)


# ---- 3 gloo ranks: hybrid layouts, tied weights, against the unsplit model -----------------------------------

WORLD_SIZE = 3
GLOBAL_BATCH = 12
NUM_STEPS = 3
MAX_NORM = 0.05  # below every step's 2-norm of these models, so every step clips (asserted)
MODELS = ("tied-lm", "gpt-mini")  # both tie the embedding to the output head
LAYOUTS = ((2, 1), (1, 2))


def _clip_norms(clip: Any) -> list[float]:
    """Norms of one step: inf and 3 without effect (a huge max_norm scales by exactly 1), then 2 clipping."""
    return [float(clip(1e9, INF)), float(clip(1e9, 3.0)), float(clip(MAX_NORM, 2.0))]


def _reference_norms(model: nn.Module) -> list[float]:
    return _clip_norms(lambda max_norm, norm_type: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm,
                                                                                  norm_type))


def _non_finite(pipe: Any, batch: Any, bad: float, norm_type: float) -> dict[str, Any]:
    """A step, then ``bad`` in one counted gradient of the last stage's first replica; both error modes."""
    pipe.step(*batch)
    tied = {name for name, _ in pipe.program.tie_groups}
    if pipe.rank == pipe.plan.stages[-1].devices[0]:
        param = next(p for name, p in pipe.named_parameters() if name not in tied)
        param.grad.view(-1)[0] = bad
    try:
        pipe.clip_grad_norm_(1.0, norm_type, error_if_nonfinite=True)
        raised = ""
    except RuntimeError as error:
        raised = str(error)
    total = pipe.clip_grad_norm_(1.0, norm_type)
    for param in pipe.parameters():
        param.grad = None
    return {"raised": raised, "total": total.item()}


def _run_all(rank: int, world_size: int, store_dir: str) -> list[dict[str, Any]]:
    records = []
    for model_name in MODELS:
        entry = zoo.get(model_name)
        batches = [entry.make_batch(GLOBAL_BATCH, 200 + step, **entry.tiny_overrides) for step in range(NUM_STEPS)]
        # one process: each step's norms, step 1's clipped gradients, parameters after clipped AdamW steps
        reference = train_reference(zoo.build(entry.name, **entry.tiny_overrides)[0], entry.loss_fn, batches,
                                    after_backward=_reference_norms)
        for replicas in LAYOUTS:
            model, example_inputs = zoo.build(entry.name, **entry.tiny_overrides)
            plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), replicas, GLOBAL_BATCH, 3)
            join_world(store_dir, f"{model_name}-{replicas}", rank, world_size)
            try:
                pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=GLOBAL_BATCH,
                                      plan=plan)
                record = train_and_compare(pipe, batches, reference,
                                           after_backward=lambda piped: _clip_norms(piped.clip_grad_norm_))
                record["inf"] = _non_finite(pipe, batches[0], INF, 2.0)
                record["nan"] = _non_finite(pipe, batches[0], math.nan, INF)
                record["ties"] = len(pipe.program.tie_groups)
            finally:
                leave_world()
            records.append({"config": f"{model_name} {replicas}", "reference": reference["after_backward"],
                            "norms": record["after_backward"], "problems": record["problems"], "inf": record["inf"],
                            "nan": record["nan"], "ties": record["ties"]})
    return records


@pytest.mark.multiprocess
def test_whole_model_norm_and_clipped_training_on_hybrid_layouts(tmp_path: Any) -> None:
    per_rank = run_ranks(_run_all, WORLD_SIZE, tmp_path)
    failures = []
    for records in zip(*per_rank, strict=True):
        config, reference = records[0]["config"], records[0]["reference"]
        assert records[0]["ties"] >= 1, f"{config}: the split should tie the embedding across stages"
        assert all(step[2] > MAX_NORM for step in reference), f"{config}: no clipping at {reference}"
        if any(r["norms"] != records[0]["norms"] for r in records):
            failures.append(f"{config}: ranks return different norms {[r['norms'] for r in records]}")
        if not torch.allclose(torch.tensor(records[0]["norms"]), torch.tensor(reference), rtol=1e-5, atol=0.0):
            failures.append(f"{config}: norms {records[0]['norms']} != unsplit model's {reference}")
        failures += [f"{config} rank {rank}: {p}" for rank, r in enumerate(records) for p in r["problems"][:3]]
        for rank, r in enumerate(records):
            if "non-finite" not in r["inf"]["raised"] or "non-finite" not in r["nan"]["raised"]:
                failures.append(f"{config} rank {rank}: error_if_nonfinite=True did not raise: {r['inf']} {r['nan']}")
            if r["inf"]["total"] != INF or not math.isnan(r["nan"]["total"]):
                failures.append(f"{config} rank {rank}: totals {r['inf']} {r['nan']}, want inf and nan as torch")
    assert not failures, "\n".join(failures)
