"""Issue 22 item 4, losses fxpipe cannot misread: the probe's verdicts on numbers, then loss_reduction="auto" and
declared reductions on one rank and on 3 gloo ranks (2:1), each against one process on the whole batch."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from fxpipe.runtime.faults.errors import LossReductionError
from fxpipe.runtime.numerics.loss_probe import (
    VERDICTS,
    LossProbe,
    additive_verdict,
    probe_tolerance,
    reduction_verdict,
)
from tests.exactness_oracle import (
    padded_lm_batches,
    padded_lm_mean,
    padded_lm_sum_count,
    sum_mse,
    summed_lm,
    train_and_compare,
    train_reference,
)
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks, run_scenarios

NUM_STEPS = 2
FP32 = probe_tolerance(torch.float32)

# ---- the verdict on plain numbers --------------------------------------------------------------------------


@pytest.mark.parametrize(("union", "part_a", "part_b", "rows_a", "rows_b", "expected"), [
    (2.0, 1.9, 2.1, 3, 3, "mean"),
    (2.0 + 1e-7, 1.0, 3.0, 2, 2, "mean"),  # float32 rounding is no contradiction
    ((1.5 * 2 + 2.5 * 3) / 5, 1.5, 2.5, 2, 3, "mean"),  # uneven parts: rows weigh
    (4.0, 1.9, 2.1, 3, 3, "sum"),
    (3.0, 3.0, 3.0, 1, 1, "mean"),  # one row twice (a mean): the loss stays
    (6.0, 3.0, 3.0, 1, 1, "sum"),  # one row twice (a sum): the loss doubles
    ((1.0 * 1 + 3.0 * 3) / 4, 1.0, 3.0, 1, 1, "neither"),  # a token mean: 1 and 3 tokens in the two rows
    (2.0 * 1.01, 1.9, 2.1, 3, 3, "neither"),  # a mean 1% off
    (0.0, 0.0, 0.0, 3, 3, "inconclusive"),  # all-zero losses say nothing
    (1.0, 1.0, -1.0, 1, 1, "inconclusive"),  # both predictions 0: the hypotheses agree
    (float("nan"), 1.0, 2.0, 3, 3, "inconclusive"),
    (float("inf"), 1.0, 2.0, 3, 3, "inconclusive"),
])
def test_reduction_verdict_on_numbers(union: float, part_a: float, part_b: float, rows_a: int, rows_b: int,
                                      expected: str) -> None:
    assert reduction_verdict(union, part_a, part_b, rows_a, rows_b, FP32) == expected


def test_low_precision_losses_get_a_wider_tolerance() -> None:
    bf16 = probe_tolerance(torch.bfloat16)
    assert FP32 == 1e-5 and probe_tolerance(torch.float64) == 1e-5
    assert 1e-2 < bf16 < 0.05
    # a bf16 mean rounded by 2**-8 relative is still a mean; a sum is still clearly a sum
    assert reduction_verdict(2.0 * (1 + 2**-8), 1.9, 2.1, 3, 3, bf16) == "mean"
    assert reduction_verdict(2.0 * (1 + 2**-8), 1.9, 2.1, 3, 3, FP32) == "neither"
    assert reduction_verdict(4.0 * (1 + 2**-8), 1.9, 2.1, 3, 3, bf16) == "sum"


@pytest.mark.parametrize(("union", "part_a", "part_b", "expected"), [
    ((10.0, 7.0), (4.0, 3.0), (6.0, 4.0), "token_mean"),
    ((10.0 / 7, 7.0), (4.0 / 3, 3.0), (6.0 / 4, 4.0), "neither"),  # (mean, count): the sums do not add up
    ((10.0, 7.0), (4.0, 3.0), (6.0, 3.0), "neither"),  # counts do not add up
    ((0.0, 7.0), (0.0, 3.0), (0.0, 4.0), "inconclusive"),
])
def test_additive_verdict_on_numbers(union: tuple[float, float], part_a: tuple[float, float],
                                     part_b: tuple[float, float], expected: str) -> None:
    assert additive_verdict(union, part_a, part_b, FP32) == expected


def _folded(declared: str, *verdicts: str | None, provisional: int = 0) -> LossProbe:
    """A probe concluded as if ranks with ``verdicts`` had folded theirs into the allreduce."""
    probe = LossProbe(declared, {}, 0)
    sums = [float(sum(v == name for v in verdicts)) for name in VERDICTS] + [float(provisional)]
    probe.conclude(sums)
    return probe


@pytest.mark.parametrize(("declared", "verdicts", "resolved", "message"), [
    ("auto", ("mean", None, "mean"), "mean", None),
    ("auto", ("sum", "sum"), "sum", None),
    ("auto", ("mean", "mean_one_row"), "mean", None),
    ("auto", (None, None), None, None),  # nobody could tell: probe again next step
    ("auto", ("mean", "sum"), None, "disagree"),
    ("auto", ("mean", "neither"), None, "loss_reduction='token_mean'"),
    ("auto", ("mean_one_row",), None, "cannot tell a per-row mean from a token mean"),
    ("auto", ("failed", "mean"), None, "could not evaluate loss_fn"),
    ("mean", ("mean_one_row",), "mean", None),
    ("mean", ("sum",), None, "loss_reduction='mean' but loss_fn is a sum over rows"),
    ("sum", ("mean_one_row",), None, "loss_reduction='sum' but loss_fn is a per-row mean"),
    ("mean", ("neither",), None, "loss_reduction='mean' but loss_fn is neither"),
    ("token_mean", ("token_mean",), "token_mean", None),
    ("token_mean", ("neither",), None, "does not add up over rows"),
])
def test_conclude_settles_or_raises_the_same_on_every_rank(declared: str, verdicts: tuple[str | None, ...],
                                                           resolved: str | None, message: str | None) -> None:
    probe = _folded(declared, *verdicts)
    error = probe.take_error()
    if message is None:
        assert error is None
        assert probe.active == (resolved is None)
        assert probe.resolved == (resolved if declared == "auto" else declared)
    else:
        assert error is not None and message in str(error)
        assert probe.active  # still open: every later step raises again
        assert "gradients were dropped" in str(error)


def test_provisional_slices_must_match_the_verdict() -> None:
    assert _folded("auto", "mean", provisional=2).take_error() is None
    error = _folded("auto", "sum", provisional=2).take_error()
    assert error is not None and "pass loss_reduction='sum'" in str(error)


# ---- the probe on one slice, without a pipeline ----------------------------------------------------------


def _observe(loss_fn: Callable[[Any, Any], Any], declared: str, slices: list[tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[LossProbe, list[str]]:
    """``LossProbe.observe`` on the slices of one step, output value 'y' batched in dim 0; the weighting of each."""
    probe = LossProbe(declared, {"y": 0}, 0)
    parse = "token_mean" if declared == "token_mean" else "mean"

    def evaluate(outputs: Any, targets: Any) -> Any:
        result = loss_fn(outputs["y"], targets)
        return result if parse == "token_mean" else (result, 0.0)

    weights = []
    for output, target in slices:
        loss, count = evaluate({"y": output}, target)
        weights.append(probe.observe(evaluate, {"y": output}, target, output.shape[0], loss, count))
    return probe, weights


def _lm_slice(rows: int, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, 8, 32, generator=generator)
    targets = torch.randint(0, 32, (rows, 8), generator=generator)
    padding = torch.arange(8)[None, :] >= torch.tensor(lengths)[:, None]
    return logits, targets.masked_fill(padding, -100)


def test_observe_finds_each_reduction_before_weighting() -> None:
    logits, targets = _lm_slice(4, [8, 2, 5, 7])
    probe, weights = _observe(summed_lm, "auto", [(logits, targets)])
    assert (probe.local, weights) == ("sum", ["sum"])
    probe, weights = _observe(padded_lm_mean, "auto", [(logits, targets)])
    assert probe.local == "neither" and "a per-row mean gives" in probe.detail
    probe, weights = _observe(padded_lm_sum_count, "token_mean", [(logits, targets)])
    assert (probe.local, weights) == ("token_mean", ["token_mean"])
    # one-row slices: the doubled row tells mean from sum, the next slice finds the token mean
    one_row = [(logits[i:i + 1], targets[i:i + 1]) for i in range(3)]
    probe, weights = _observe(summed_lm, "auto", one_row)
    assert (probe.local, weights) == ("sum", ["sum"] * 3)
    probe, _ = _observe(padded_lm_mean, "auto", one_row)
    assert probe.local == "neither"
    logits, targets = _lm_slice(3, [8, 8, 8])  # no padding: a token mean is a per-row mean
    one_row = [(logits[i:i + 1], targets[i:i + 1]) for i in range(3)]
    probe, weights = _observe(_token_ce, "auto", one_row)
    assert (probe.local, weights) == ("mean", ["mean"] * 3)


def test_observe_waits_on_all_zero_losses_and_reports_a_raising_loss() -> None:
    zeros = torch.zeros(4, 3)
    probe, weights = _observe(F.mse_loss, "auto", [(zeros, zeros), (zeros + 1, zeros)])
    assert (probe.local, probe.num_provisional, weights) == ("mean", 1, ["mean", "mean"])

    def fixed_rows(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.view(4, 3), target.view(4, 3))  # only ever 4 rows

    probe, _ = _observe(fixed_rows, "auto", [(torch.randn(4, 3), torch.randn(4, 3))])
    assert probe.local == "failed" and "RuntimeError" in probe.detail


# ---- pipelines against one process --------------------------------------------------------------------------

GLOBAL_BATCH = 12
LossFn = Callable[[Any, Any], Any]


def _lm_batches(seed: int, batch_size: int = GLOBAL_BATCH) -> list[Any]:
    entry = zoo.get("tied-lm")
    return [entry.make_batch(batch_size, seed + step, **entry.tiny_overrides) for step in range(NUM_STEPS)]


def _mlp_batches(seed: int, batch_size: int = GLOBAL_BATCH) -> list[Any]:
    entry = zoo.get("mlp")
    return [entry.make_batch(batch_size, seed + step, **entry.tiny_overrides) for step in range(NUM_STEPS)]


def _pipe(name: str, replicas: tuple[int, ...], num_microbatches: int, batch_size: int, loss_fn: LossFn,
          **options: Any) -> tuple[Any, torch.nn.Module]:
    """The tiny zoo model (seed 0) pipelined, and an untouched copy for the reference."""
    model, example_inputs = zoo.build(name, batch_size=batch_size, **zoo.get(name).tiny_overrides)
    reference = copy.deepcopy(model)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), replicas, batch_size, num_microbatches)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=loss_fn, global_batch_size=batch_size, plan=plan, **options)
    return pipe, reference


def _trains_exactly(name: str, layout: tuple[tuple[int, ...], int, int], loss_fn: LossFn, batches: list[Any],
                    reference_loss: LossFn | None = None, **options: Any) -> dict[str, Any]:
    pipe, model = _pipe(name, *layout, loss_fn, **options)
    reference = train_reference(model, reference_loss or loss_fn, batches)
    record = train_and_compare(pipe, batches, reference)
    if not torch.allclose(torch.tensor(record["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6):
        record["problems"].append(f"losses {record['losses']} != reference {reference['losses']}")
    return {"problems": record["problems"], "resolved": pipe.loss_reduction}


def _raises(name: str, layout: tuple[tuple[int, ...], int, int], loss_fn: LossFn, batches: list[Any],
            **options: Any) -> dict[str, Any]:
    """The first step raises LossReductionError; this rank's gradients stay as before it (None); so does the next."""
    pipe, _ = _pipe(name, *layout, loss_fn, **options)
    messages = []
    for inputs, targets in batches:
        try:
            pipe.step(inputs, targets)
            messages.append("no LossReductionError")
        except LossReductionError as error:
            messages.append(str(error))
    grads = [n for n, p in pipe.named_parameters() if p.grad is not None]
    return {"messages": messages, "grads_left": grads, "resolved": pipe.loss_reduction}


def _scenarios(layout: tuple[tuple[int, ...], int, int]) -> dict[str, Callable[[], dict[str, Any]]]:
    """Each scenario on ``layout`` = (replicas, micro-batches, global batch)."""
    batch_size = layout[2]
    padded = padded_lm_batches(batch_size, 40, NUM_STEPS)
    return {
        "sum undeclared": lambda: _trains_exactly("tied-lm", layout, summed_lm, _lm_batches(70, batch_size)),
        "mean undeclared": lambda: _trains_exactly("mlp", layout, zoo.get("mlp").loss_fn, _mlp_batches(60, batch_size)),
        "padded LM undeclared": lambda: _raises("tied-lm", layout, padded_lm_mean, padded),
        "mean declared, sum loss": lambda: _raises("mlp", layout, sum_mse, _mlp_batches(60, batch_size),
                                                   loss_reduction="mean"),
        "token_mean declared": lambda: _trains_exactly("tied-lm", layout, padded_lm_sum_count, padded, padded_lm_mean,
                                                       loss_reduction="token_mean"),
    }


EXPECTED = {"sum undeclared": "sum", "mean undeclared": "mean", "token_mean declared": "token_mean",
            # errors: what each message says, and pipe.loss_reduction after them (None: 'auto' found nothing)
            "padded LM undeclared": (("loss_reduction='token_mean'", "(sum, count)", "neither a per-row mean"), None),
            "mean declared, sum loss": (("loss_reduction='mean' but loss_fn is a sum over rows",), "mean")}


def _run_scenarios(rank: int, world_size: int, store_dir: str, layout: tuple[tuple[int, ...], int, int],
                   only: tuple[str, ...]) -> dict[str, Any]:
    scenarios = {name: scenario for name, scenario in _scenarios(layout).items() if not only or name in only}
    return run_scenarios(scenarios, rank, world_size, store_dir, "probe")


def _check(per_rank: list[dict[str, Any]]) -> None:
    failures = []
    for name, results in ((name, [ranks[name] for ranks in per_rank]) for name in per_rank[0]):
        expected = EXPECTED[name]
        for rank, result in enumerate(results):
            if isinstance(expected, str):
                if result["problems"] or result["resolved"] != expected:
                    failures.append(f"{name}, rank {rank}: {result['resolved']}, {result['problems'][:3]}")
            elif not all(all(part in message for part in expected[0]) for message in result["messages"]) or \
                    result["grads_left"] or result["resolved"] != expected[1]:
                failures.append(f"{name}, rank {rank}: {result}")
    assert not failures, "\n".join(failures)


@pytest.mark.multiprocess
def test_one_rank_auto_trains_exactly_or_raises(tmp_path: Any) -> None:
    _check(run_ranks(_run_scenarios, 1, tmp_path, ((1,), 2, GLOBAL_BATCH), ()))


@pytest.mark.multiprocess
def test_one_rank_one_row_slices(tmp_path: Any) -> None:
    """Slices of one row: the doubled row tells mean from sum, the next slice a token mean (4 micro-batches of 1)."""
    _check(run_ranks(_run_scenarios, 1, tmp_path, ((1,), 4, 4), ("sum undeclared", "mean undeclared",
                                                                  "padded LM undeclared")))


@pytest.mark.multiprocess
def test_three_ranks_2_1_auto_trains_exactly_or_raises_on_every_rank(tmp_path: Any) -> None:
    _check(run_ranks(_run_scenarios, 3, tmp_path, ((2, 1), 2, GLOBAL_BATCH), ()))


def _one_row_each(rank: int, world_size: int, store_dir: str) -> list[str]:
    """Two last-stage replicas with one row each and one micro-batch: a token mean cannot show; auto refuses."""
    join_world(store_dir, "one-row", rank, world_size)
    try:
        result = _raises("tied-lm", ((2,), 1, 2), _token_ce, _lm_batches(5, 2))
    finally:
        leave_world()
    return result["messages"]


def _token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.multiprocess
def test_one_row_per_replica_is_refused_under_auto(tmp_path: Any) -> None:
    for messages in run_ranks(_one_row_each, 2, tmp_path):
        assert all("cannot tell a per-row mean from a token mean" in message for message in messages), messages
