"""compile(virtual_stages='auto') hands the runtime the planner's virtual plan, tensor-parallel chunks included (with
or without sequence parallelism: the runtime runs both), and a forced v as planned."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fxpipe import compile_plan
from fxpipe.compile_options import CompileOptions
from fxpipe.core.plan import Plan, StagePlan


def _tensor_parallel_virtual_plan() -> Plan:
    """Four chunks on two 2-way tensor-parallel groups laid out as a loop."""
    stages = tuple(StagePlan(c, c, c + 1, 1, ((0, 1), (2, 3))[c % 2], tensor_parallel=2) for c in range(4))
    return Plan(8, 2, stages, schedule="interleaved", planner="dapple", virtual_stages=2, chunk_groups=(0, 1, 0, 1))


def _plain_plan() -> Plan:
    return Plan(8, 2, (StagePlan(0, 0, 2, 2, (0, 1)), StagePlan(1, 2, 4, 2, (2, 3))), planner="dapple")


def _planner(monkeypatch: pytest.MonkeyPatch, virtual_choice: Plan) -> list[Any]:
    """Stub the costing and the planner: the first call returns ``virtual_choice``, a call with
    virtual_stages left at 1 the plain plan; returns the virtual_stages of every call."""
    import fxpipe.planning
    import fxpipe.runtime.calibration.topology as topology

    calls: list[Any] = []

    def plan_chain(*_args: Any, virtual_stages: Any = 1, **_kwargs: Any) -> Plan:
        calls.append(virtual_stages)
        return virtual_choice if virtual_stages != 1 else _plain_plan()

    monkeypatch.setattr(fxpipe.planning, "costed_model", lambda *a, **k: SimpleNamespace(chain=None))
    monkeypatch.setattr(fxpipe.planning, "plan_chain", plan_chain)
    monkeypatch.setattr(topology, "check_cluster_size", lambda *a: None)
    monkeypatch.setattr(topology, "placed_plan", lambda plan, *a: plan)
    return calls


def _run(virtual_stages: Any, sequence_parallel: bool = False) -> Plan:
    options = CompileOptions(loss_fn=None, global_batch_size=8, virtual_stages=virtual_stages,
                             sequence_parallel=sequence_parallel)
    costs = SimpleNamespace(source="analytic", measured=None, graph_module=None)
    return compile_plan._run_planner(options, None, (), None, None, costs)  # type: ignore[arg-type]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_auto_keeps_tensor_parallel_chunks(monkeypatch: pytest.MonkeyPatch, sequence_parallel: bool) -> None:
    chosen = _tensor_parallel_virtual_plan()
    calls = _planner(monkeypatch, chosen)
    assert _run("auto", sequence_parallel) is chosen  # the runtime runs them (tests/test_virtual_tensor_parallel.py)
    assert calls == ["auto"]


def test_auto_keeps_a_virtual_plan_the_runtime_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    runnable = Plan(8, 2, tuple(StagePlan(c, c, c + 1, 2, ((0, 1), (2, 3))[c % 2]) for c in range(4)),
                    schedule="interleaved", planner="dapple", virtual_stages=2, chunk_groups=(0, 1, 0, 1))
    calls = _planner(monkeypatch, runnable)
    assert _run("auto") is runnable
    assert calls == ["auto"]


def test_a_forced_virtual_stage_count_is_not_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    forced = _tensor_parallel_virtual_plan()
    calls = _planner(monkeypatch, forced)
    assert _run(2, sequence_parallel=True) is forced
    assert calls == [2]
