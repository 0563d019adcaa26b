"""fxpipe.compile and PipelinedModule: the function and decorator forms, names, and errors on every rank."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from fxpipe.runtime.faults.errors import BatchShapeError, CommunicationError, PipelineSetupError
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

ENTRY = zoo.get("mlp")
BATCH = 8


def _mlp(**overrides: Any) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    return zoo.build("mlp", **{**ENTRY.tiny_overrides, **overrides})


def _plan(replicas: tuple[int, ...], **kwargs: Any) -> fxpipe.Plan:
    model, example_inputs = _mlp()
    return plan_from_cuts(trace(model, example_inputs), replicas, BATCH, 2, **kwargs)


def _outcome(action: Any) -> tuple[str, str, float]:
    start = time.perf_counter()
    try:
        action()
    except Exception as error:  # the test inspects which error every rank raised, and when
        return type(error).__name__, str(error), time.perf_counter() - start
    return "ok", "", time.perf_counter() - start


def _single_process_checks(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    """World of one process with no torchrun environment: compile makes the group itself."""
    inputs, targets = ENTRY.make_batch(BATCH, 1, **ENTRY.tiny_overrides)

    @fxpipe.compile(loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan=_plan((1,)), schedule="gpipe")
    def build(seed: int) -> torch.nn.Module:
        return _mlp(seed=seed)[0]

    pipe = build(0, example_inputs=_mlp()[1])
    reference, _ = _mlp()
    expected = ENTRY.loss_fn(reference(*inputs), targets)
    expected.backward()
    loss = pipe.step({pipe.program.model_inputs[0]: inputs[0]}, targets)
    grads_match = all(torch.allclose(p.grad, dict(reference.named_parameters())[n].grad, atol=1e-6)
                      for n, p in pipe.named_parameters())
    missing = _outcome(lambda: fxpipe.compile(_mlp()[0], _mlp()[1], global_batch_size=BATCH, plan=_plan((1,))))
    wrong_batch = _outcome(lambda: fxpipe.compile(_mlp()[0], _mlp()[1], loss_fn=ENTRY.loss_fn,
                                                  global_batch_size=BATCH + 1, plan=_plan((1,))))
    measured = _measured_step(pipe, reference, inputs, targets)
    return {"loss": loss, "expected": expected.item(), "grads_match": grads_match, "schedule": pipe.plan.schedule,
            "measured": measured,
            "names": sorted(pipe.state_dict()), "model_names": sorted(reference.state_dict()),
            "missing_loss": missing, "batch_mismatch": wrong_batch, "name": build.__name__}


def _measured_step(pipe: Any, reference: torch.nn.Module, inputs: Any, targets: Any) -> dict[str, Any]:
    """A measured GPipe step (M=2) holds both half micro-batches at once: the eager whole-batch saved bytes."""
    from fxpipe.core.schedule import lower, make_schedule
    from fxpipe.runtime.autograd.measure import SavedActivationMeter

    pipe.measure = True
    pipe.step(inputs, targets)
    (stats,) = pipe.step_stats()
    meter = SavedActivationMeter.for_parameters(reference.parameters())
    with meter.measure():
        ENTRY.loss_fn(reference(*inputs), targets).backward()
    plan = pipe.plan
    num_actions = len(lower(make_schedule(plan.schedule, plan.num_stages, plan.num_microbatches))[0])
    pipe.measure = "timeline"
    pipe.step(inputs, targets)
    (timeline_only,) = pipe.step_stats()
    try:
        pipe.measure = "memory"
        bad_mode = ""
    except ValueError as error:
        bad_mode = str(error)
    pipe.measure = False
    return {"peak": stats.peak_activation_bytes, "eager_peak": meter.peak_bytes, "num_events": len(stats.events),
            "num_actions": num_actions, "ops": sorted({event.op for event in stats.events}),
            "timeline_only": (timeline_only.peak_activation_bytes, len(timeline_only.events)), "bad_mode": bad_mode}


def test_decorated_factory_trains_one_process_exactly(tmp_path: Any) -> None:
    (result,) = run_ranks(_single_process_checks, 1, tmp_path)
    assert result["loss"] == pytest.approx(result["expected"], rel=1e-6)
    assert result["grads_match"]
    assert result["schedule"] == "gpipe" and result["name"] == "build"
    assert result["names"] == result["model_names"]
    assert result["missing_loss"][0] == "PipelineSetupError" and "loss_fn" in result["missing_loss"][1]
    assert result["batch_mismatch"][0] == "PipelineSetupError" and "global_batch_size" in result["batch_mismatch"][1]
    measured = result["measured"]
    assert measured["eager_peak"] > 0
    assert 0.9 * measured["eager_peak"] <= measured["peak"] <= 1.1 * measured["eager_peak"], measured
    assert measured["num_events"] == measured["num_actions"] and measured["ops"] == ["AR", "B", "F"]
    assert measured["timeline_only"] == (None, measured["num_actions"])
    assert "True, False or 'timeline'" in measured["bad_mode"]


def _error_cases(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    inputs, targets = ENTRY.make_batch(BATCH, 2, **ENTRY.tiny_overrides)
    results: dict[str, Any] = {}

    def in_world(name: str, body: Any) -> None:
        join_world(store_dir, name, rank, world_size)
        try:
            results[name] = body()
        finally:
            leave_world()

    def compile_mlp(replicas: tuple[int, ...], **kwargs: Any) -> Any:
        model, example_inputs = _mlp()
        return fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH,
                              plan=_plan(replicas), **kwargs)

    def bad_batches() -> Any:
        pipe = compile_mlp((1, 1))
        # one replica per stage: a batch needs a row; a batch twice as wide does not fit the weights
        short = _outcome(lambda: pipe.step(inputs[0][:0], targets[:0]))
        wide = _outcome(lambda: pipe.step(torch.cat([inputs[0], inputs[0]], dim=1), targets))
        good = pipe.step(inputs, targets)  # the pipeline still works after rejected batches
        reference, _ = _mlp()
        return short, wide, good, ENTRY.loss_fn(reference(*inputs), targets).item()

    def autocast() -> Any:
        pipe = compile_mlp((1, 1), autocast_dtype=torch.bfloat16)
        reference, _ = _mlp()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = ENTRY.loss_fn(reference(*inputs), targets).item()
        sent = [pipe.driver.dtypes[n] for n, s in pipe.program.producers.items() if s == 0]
        return pipe.step(inputs, targets), expected, sent

    def dead_peer() -> Any:
        pipe = compile_mlp((1, 1), timeout_s=3.0)
        if rank == 1:
            return "left"  # rank 1 dies before the step
        return _outcome(lambda: pipe.step(inputs, targets))

    def stale_receive() -> Any:
        pipe = compile_mlp((1, 1), timeout_s=3.0)
        if rank == 0:  # no gradient comes back: rank 1's step dies after taking activation 0
            return _outcome(lambda: pipe.step(inputs, targets))
        forward = pipe.driver._forward

        def failing_forward(state: Any, m: int) -> None:
            raise RuntimeError("injected failure in forward")

        pipe.driver._forward = failing_forward  # after receiving micro-batch 0, with micro-batch 1 posted
        failed = _outcome(lambda: pipe.step(inputs, targets))
        pipe.driver._forward = forward
        # the failed step left a receive posted ahead (gloo): a second step must refuse, not mix messages
        return failed, _outcome(lambda: pipe.step(inputs, targets))

    def auto_plan() -> Any:  # the case: 'auto' once returned dp on [0] of 2 ranks
        model, example_inputs = _mlp()
        pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan="auto")
        reference, _ = _mlp()
        expected = ENTRY.loss_fn(reference(*inputs), targets).item()
        return pipe.plan.all_devices(), pipe.step(inputs, targets), pipe.plan.notes, expected

    def cluster_too_big() -> Any:
        model, example_inputs = _mlp()
        return _outcome(lambda: fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH,
                                               plan="auto", cluster="local:3"))

    def compiled_twice() -> Any:
        """A model object compiled with sharded stages (FSDP2 shards it in place) is refused by a second compile,
        naming the parameter, instead of failing inside a forward."""
        model, example_inputs = _mlp()
        fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH, plan=_plan((2,)),
                       sharding="parameters")
        return _outcome(lambda: fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn,
                                               global_batch_size=BATCH, plan=_plan((2,))))

    def unfrozen_after_compile() -> Any:
        """A layer frozen at compile and unfrozen later would train each replica alone: refused at the next step."""
        model, example_inputs = _mlp()
        first = next(model.parameters())
        first.requires_grad_(False)
        pipe = fxpipe.compile(model, example_inputs, loss_fn=ENTRY.loss_fn, global_batch_size=BATCH,
                              plan=_plan((1, 1)), timeout_s=10.0, stall_timeout_s=2.0)
        trained = pipe.step(inputs, targets)
        first.requires_grad_(True)
        outcome = _outcome(lambda: pipe.step(inputs, targets))
        pipe.driver.failures.stop()  # its heartbeat must not break a later world's group
        return trained, outcome

    in_world("auto-plan", auto_plan)
    in_world("cluster-size", cluster_too_big)
    in_world("bad-batch", bad_batches)
    in_world("world-mismatch", lambda: _outcome(lambda: compile_mlp((1, 1, 1, 1))))
    in_world("autocast", autocast)
    in_world("compiled-twice", compiled_twice)
    # before the cases that leave a rank's heartbeat running: a failure it records can break a later world's group
    in_world("unfrozen-after-compile", unfrozen_after_compile)
    in_world("dead-peer", dead_peer)
    in_world("stale-receive", stale_receive)
    return results


def test_errors_reach_every_rank_quickly(tmp_path: Any) -> None:
    results = run_ranks(_error_cases, 2, tmp_path)
    for rank, result in enumerate(results):
        short, wide, good, eager = result["bad-batch"]
        assert short[0] == BatchShapeError.__name__ and "a batch of 0 rows is too small" in short[1], (rank, short)
        assert "at least 1 rows" in short[1] and short[2] < 5.0, (rank, short)
        assert wide[0] == BatchShapeError.__name__ and "does not run at input shapes" in wide[1], (rank, wide)
        assert good == pytest.approx(eager, rel=1e-5), (rank, good, eager)  # the one-process eager loss
        devices, auto_loss, notes, auto_eager = result["auto-plan"]
        assert devices == [0, 1] and auto_loss == pytest.approx(auto_eager, rel=1e-5), result["auto-plan"]
        assert all("predicted" in note and "launch 1 rank" in note for note in notes), notes
        too_big = result["cluster-size"]
        assert "'local:3' has 3 devices but the process group has 2 ranks" in too_big[1], (rank, too_big)
        assert too_big[0] == "PipelineSetupError" and too_big[2] < 10.0  # the same error on every rank
        mismatch = result["world-mismatch"]
        assert mismatch[0] == PipelineSetupError.__name__ and "2 ranks" in mismatch[1], (rank, mismatch)
        twice = result["compiled-twice"]
        assert twice[0] == PipelineSetupError.__name__ and "is an FSDP2 shard (DTensor)" in twice[1], (rank, twice)
        assert "build the model again" in twice[1], (rank, twice)
        loss, expected, sent = result["autocast"]
        assert loss == pytest.approx(expected, rel=2e-2) and sent and set(sent) == {torch.bfloat16}
    assert results[1]["dead-peer"] == "left"
    kind, message, elapsed = results[0]["dead-peer"]
    assert kind == CommunicationError.__name__ and "rank 1" in message and elapsed < 20.0, message
    timed_out = results[0]["stale-receive"]
    assert timed_out[0] == CommunicationError.__name__ and "rank 1" in timed_out[1], timed_out
    for rank, result in enumerate(results):
        trained, (kind, message, elapsed) = result["unfrozen-after-compile"]
        assert trained > 0 and elapsed < 20.0, (rank, result["unfrozen-after-compile"])
        assert "TrainableSetChangedError" in (kind if rank == 0 else message), (rank, kind, message)
        assert "unfrozen ['" in message and "rank 0 (stage 0)" in message, (rank, message)
    failed, again = results[1]["stale-receive"]
    assert failed[:2] == ("RuntimeError", "injected failure in forward"), failed
    # refused up front: waiting on the stale receive would end in CommunicationError after timeout_s
    assert again[0] == PipelineSetupError.__name__ and "1 receive(s) still posted" in again[1], again
