"""The caller's own torch.autocast around step/evaluate/predict, and messages checked against what receivers expect.

Before: a pipeline compiled without ``autocast_dtype`` and stepped under ``torch.autocast`` sent bfloat16
activations into float32 receive buffers; gloo filled half of each buffer and the rest was whatever memory held
(losses of 1e35 and nan in 2 to 12 of 12 fresh pipelines). Now the caller's region is honoured as
``autocast_dtype`` is, every message carries a header its receiver checks, and every sender checks its pieces.
One 3-rank world (layout 2:1, 2 micro-batches), one fresh process group per case.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from fxpipe.runtime.faults.errors import MessageLayoutError, PipelineSetupError
from tests.mp_utils import plan_from_cuts, run_ranks, run_scenarios

pytestmark = pytest.mark.multiprocess

ENTRY = zoo.get("gpt-mini")
BATCH = 8
NUM_FRESH_PIPELINES = 20


def _build() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The tiny GPT with weights scaled up, so that its logits are far from uniform and bf16 visibly moves the loss."""
    model, example_inputs = zoo.build("gpt-mini", **ENTRY.tiny_overrides)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0)
    return model, example_inputs


def _compile(**options: Any) -> Any:
    model, example_inputs = _build()
    plan = plan_from_cuts(trace(model, example_inputs), (2, 1), BATCH, 2)
    return fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan=plan,
                          **options)


def _reference(inputs: Any, targets: Any, dtype: torch.dtype | None) -> tuple[float, dict[str, torch.Tensor],
                                                                            torch.Tensor]:
    """One process under the same autocast (None: none): loss, gradients (backward outside the region, as users
    write it), output."""
    model, _ = _build()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        output = model(*inputs)
        loss = ENTRY.loss_fn(output, targets)
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}, output.detach()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def _outcome(action: Any) -> tuple[str, str]:
    try:
        action()
    except Exception as error:  # the test compares what each rank raised
        return type(error).__name__, str(error)
    return "ok", ""


def _cases(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    inputs, targets = ENTRY.make_batch(BATCH, 0, **ENTRY.tiny_overrides)
    expected_loss, expected_grads, expected_output = _reference(inputs, targets, torch.bfloat16)
    fp32_loss = _reference(inputs, targets, None)[0]
    results: dict[str, Any] = {"expected": expected_loss, "fp32": fp32_loss}

    def fresh_pipelines() -> list[tuple[float, float, bool]]:
        runs = []
        for _ in range(NUM_FRESH_PIPELINES):
            pipe = _compile()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = pipe.step(inputs, targets)
            worst = max(_relative_error(p.grad, expected_grads[name]) for name, p in pipe.named_parameters())
            finite = all(bool(torch.isfinite(p.grad).all()) for p in pipe.parameters())
            runs.append((loss, worst, finite))
        return runs

    def forward_only() -> Any:
        pipe = _compile()
        pipe.eval()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            evaluated = pipe.evaluate(inputs, targets)
            predicted = pipe.predict(inputs)
        plain = pipe.evaluate(inputs, targets)  # outside the region again: float32, as compiled
        return evaluated, predicted.dtype, _relative_error(predicted, expected_output), plain

    def other_dtype_than_compiled() -> Any:
        pipe = _compile(autocast_dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.float16):
            refused = _outcome(lambda: pipe.step(inputs, targets))
        return refused, pipe.step(inputs, targets)  # the pipeline is still usable

    def ranks_disagree() -> Any:
        """Only rank 0 opens the region: the batch check (which compares it) raises on every rank before any transfer."""
        pipe = _compile()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=rank == 0):
            return _outcome(lambda: pipe.step(inputs, targets))

    def sender_casts() -> Any:
        """Rank 0's stage produces bfloat16 where the layout says float32: it refuses to send, every rank raises."""
        return _failed_step(_sending_bfloat16_from_rank_0())

    def receiver_checks() -> Any:
        """The same with rank 0's own check off: its message is smaller than rank 2's buffer, and rank 2 raises."""
        pipe = _sending_bfloat16_from_rank_0()
        if rank == 0:
            import fxpipe.runtime.execution.driver as driver_module

            driver_module.check_outgoing = lambda *args: None  # type: ignore[assignment]
        return _failed_step(pipe)

    def _sending_bfloat16_from_rank_0() -> Any:
        pipe = _compile(timeout_s=5.0, stall_timeout_s=2.0)
        if rank == 0:
            forward = pipe.driver.runner.forward
            pipe.driver.runner.forward = lambda m, values: {name: value.to(torch.bfloat16) for name, value
                                                            in forward(m, values).items()}
        return pipe

    def _failed_step(pipe: Any) -> tuple[tuple[str, str], float]:
        start = time.perf_counter()
        outcome = _outcome(lambda: pipe.step(inputs, targets))
        elapsed = time.perf_counter() - start
        pipe.driver.failures.stop()  # its heartbeat thread must not break the next case's group
        return outcome, elapsed

    scenarios = {"fresh": fresh_pipelines, "forward-only": forward_only, "other-dtype": other_dtype_than_compiled,
                 "ranks-disagree": ranks_disagree, "sender-casts": sender_casts, "receiver-checks": receiver_checks}
    return {**results, **run_scenarios(scenarios, rank, world_size, store_dir, "autocast")}


def test_the_callers_autocast_is_honoured_and_a_wrong_dtype_raises_on_every_rank(tmp_path: Any) -> None:
    results = run_ranks(_cases, 3, tmp_path, timeout_s=400.0)
    expected, fp32 = results[0]["expected"], results[0]["fp32"]
    # bf16 really changes the loss here, so agreeing with the bf16 reference is not agreeing with fp32
    assert abs(expected - fp32) > 5e-5 * abs(fp32), (expected, fp32)  # 1.2e-4 here
    for rank, result in enumerate(results):
        runs = result["fresh"]
        assert len(runs) == NUM_FRESH_PIPELINES
        for index, (loss, worst_grad_error, finite) in enumerate(runs):
            # the loss is the bf16 one (bf16 moves it by 1.2e-4 here, the pipeline is within 1e-5 of it); the
            # gradients carry bf16 noise: each micro-batch's rows go through bf16 matmuls of other shapes and the
            # weight gradients add up in another order; corruption was 1e35 or nan
            assert finite and loss == pytest.approx(expected, rel=1e-5), (rank, index, loss, expected)
            assert worst_grad_error < 1e-2, (rank, index, worst_grad_error)  # 0.23-0.27% here
        assert len({loss for loss, _, _ in runs}) == 1, runs  # the same numbers in every fresh pipeline

        evaluated, predicted_dtype, output_error, plain = result["forward-only"]
        assert evaluated == pytest.approx(expected, rel=1e-5) and plain == pytest.approx(fp32, rel=1e-5)
        assert predicted_dtype == torch.bfloat16 and output_error < 2e-2, (predicted_dtype, output_error)

        (kind, message), loss = result["other-dtype"]
        assert kind == PipelineSetupError.__name__ and "autocast_dtype=torch.bfloat16" in message, message
        assert loss == pytest.approx(expected, rel=1e-5)

        kind, message = result["ranks-disagree"]
        assert kind == "BatchMismatchError" and "under another torch.autocast" in message, (rank, kind, message)

    # the sender refuses: rank 0 names the value, its stage and both dtypes; the others raise naming rank 0
    (kind, message), elapsed = results[0]["sender-casts"]
    assert kind == MessageLayoutError.__name__ and "rank 0 (stage 0)" in message, message
    assert "torch.bfloat16" in message and "expects torch.float32" in message, message
    for rank in (1, 2):
        (kind, message), elapsed = results[rank]["sender-casts"]
        assert kind != "ok" and "rank 0" in message and "MessageLayoutError" in message, (rank, kind, message)
        assert elapsed < 30.0
    # the receiver checks: rank 2 names the value, the sending stage and both dtypes
    (kind, message), _ = results[2]["receiver-checks"]
    assert kind == MessageLayoutError.__name__, (kind, message)
    assert "from rank 0 (stage 0)" in message and "expected torch.float32" in message, message
    assert "received torch.bfloat16" in message, message
    for rank in (0, 1):
        (kind, message), elapsed = results[rank]["receiver-checks"]
        assert kind != "ok" and "rank 2" in message and "MessageLayoutError" in message, (rank, kind, message)
        assert elapsed < 30.0
