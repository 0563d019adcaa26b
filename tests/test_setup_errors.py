"""Setup errors are collective: a failure on any rank during compile raises on every rank within seconds."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.runtime.faults.errors import PipelineSetupError, RemoteSetupError
from fxpipe.runtime.faults.guard import describe_failures, release_group, setup_group, setup_phase
from tests.mp_utils import join_world, leave_world, run_ranks

ENTRY = zoo.get("mlp")
BATCH = 6  # three ranks of two rows each under plain data parallelism
TIMELY_S = 15.0


class TensorDefault(torch.nn.Module):
    """The issue's model: a tensor default argument that the cost pass cannot run at another batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor = torch.zeros(BATCH, 4)) -> torch.Tensor:  # noqa: B008
        return self.linear(x) + y


def _mean_squared(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _outcome(action: Any) -> tuple[str, str, float]:
    start = time.perf_counter()
    try:
        action()
    except Exception as error:  # the test compares what every rank raised, and how fast
        return type(error).__name__, str(error), time.perf_counter() - start
    return "ok", "", time.perf_counter() - start


def test_setup_phase_without_a_group_is_a_plain_block() -> None:
    with pytest.raises(KeyError) as caught, setup_phase("anything"):
        raise KeyError("local")
    assert not getattr(caught.value, "__notes__", None)
    with setup_phase("anything"):
        pass
    text = describe_failures("planning", [(2, "ValueError", "bad"), (3, "TypeError", "worse")])
    assert text == "rank 2 failed in planning: ValueError: bad (ranks [3] failed too)"
    assert issubclass(RemoteSetupError, PipelineSetupError) and issubclass(RemoteSetupError, ValueError)


def _setup_failures(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    """One world, kept alive across failures (as in a notebook): failures, then a good compile."""
    join_world(store_dir, "setup-errors", rank, world_size, timeout_s=60.0)
    results: dict[str, Any] = {}
    try:
        inputs = torch.randn(BATCH, 4)
        results["cost-pass"] = _outcome(lambda: fxpipe.compile(
            TensorDefault(), (inputs,), loss_fn=_mean_squared, global_batch_size=BATCH, plan="auto"))

        # a user error (ValueError) on the last rank, then a failure of the machine (RuntimeError) on rank 1
        results["trace"] = _compile_with_failing_trace(rank == world_size - 1, ValueError("injected trace failure"))
        results["machine"] = _compile_with_failing_trace(rank == 1, RuntimeError("disk on fire"))
        results["auto"] = _auto_plan_trains_exactly(rank)
    finally:
        leave_world()
    results["slow"] = _slow_phase(rank, world_size, store_dir)
    return results


def _compile_with_failing_trace(fails_here: bool, error: Exception) -> tuple[str, str, float]:
    """Compile the mlp with ``fxpipe.passes.trace`` raising ``error`` on this rank when ``fails_here``."""
    import fxpipe.passes as passes

    original_trace = passes.trace

    def failing_trace(*args: Any, **kwargs: Any) -> Any:
        raise error

    if fails_here:
        passes.trace = failing_trace
    try:
        model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
        return _outcome(lambda: fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH,
                                               plan="auto"))
    finally:
        passes.trace = original_trace


def _slow_phase(rank: int, world_size: int, store_dir: str) -> tuple[str, str, float]:
    """A phase longer than the group's communication timeout (planning a large model) is not a failure."""
    join_world(store_dir, "short-timeout", rank, world_size, timeout_s=1.0)
    try:
        group = setup_group()

        def slow_on_rank_0() -> None:
            with setup_phase("planning", group):
                if rank == 0:
                    time.sleep(2.5)

        try:
            return _outcome(slow_on_rank_0)
        finally:
            release_group(group)
    finally:
        leave_world()


def _auto_plan_trains_exactly(rank: int) -> dict[str, Any]:
    """After the failures the same group still works: plan='auto' gives every rank a role, gradients exact."""
    from tests.multinode_worker import exact_step

    model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan="auto")
    return {"devices": pipe.plan.all_devices(), "notes": pipe.plan.notes, **exact_step(pipe, BATCH)}


@pytest.mark.multiprocess
def test_setup_errors_reach_every_rank(tmp_path: Any) -> None:
    results = run_ranks(_setup_failures, 3, tmp_path, timeout_s=120.0)
    cause = "Attempting to broadcast a dimension"  # the cost pass's own error, raised on rank 0 only
    for rank, result in enumerate(results):
        kind, message, elapsed = result["cost-pass"]
        assert cause in message and elapsed < TIMELY_S, (rank, result["cost-pass"])
        # a user error (a ValueError) of one rank is raised on every rank as itself: same type, same message
        assert kind == "CostAnnotationError", message  # the cost pass names the node that broke
        assert result["cost-pass"][:2] == results[0]["cost-pass"][:2], (rank, result["cost-pass"])
        kind, message, elapsed = result["trace"]
        assert "injected trace failure" in message and elapsed < TIMELY_S, (rank, result["trace"])
        assert (kind, message) == ("ValueError", "injected trace failure"), (rank, result["trace"])
        kind, message, elapsed = result["machine"]
        assert elapsed < TIMELY_S and "disk on fire" in message, (rank, result["machine"])
        if rank == 1:  # a failure of the machine (not a ValueError/TypeError) stays the rank's own
            assert kind == "RuntimeError", (rank, result["machine"])
        else:
            assert kind == "RemoteSetupError" and message.startswith("rank 1 failed in tracing: RuntimeError"), message
        kind, message, elapsed = result["slow"]
        assert kind == "ok" and 2.0 < elapsed < TIMELY_S, (rank, result["slow"])
        auto = result["auto"]
        assert auto["devices"] == [0, 1, 2], auto  # every launched rank has a role
        assert auto["exact"] and auto["num_params"] > 0, auto
        assert auto["loss"] == pytest.approx(auto["expected"], rel=1e-5)
        assert auto["notes"] == results[0]["auto"]["notes"]


def _alone_in_a_world_of_two(rank: int, world_size: int, store_dir: str, port: int) -> tuple[str, str, float]:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="2")
    model, example_inputs = zoo.build("mlp", **ENTRY.tiny_overrides)
    return _outcome(lambda: fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH,
                                           plan="auto", timeout_s=2.0))


@pytest.mark.multiprocess
def test_a_rank_that_never_joins_is_named_not_just_timed_out(tmp_path: Any) -> None:
    """The other rank failed before fxpipe.compile (it never joins): rank 0 says so after timeout_s."""
    from tests.mp_utils import reserved_port

    with reserved_port() as port:
        (outcome,) = run_ranks(_alone_in_a_world_of_two, 1, tmp_path, port)
    kind, message, elapsed = outcome
    assert kind == "CommunicationError" and "not all 2 ranks joined the process group within 2 s" in message, outcome
    assert elapsed < TIMELY_S, outcome
