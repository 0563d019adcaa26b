"""Virtual stages run (fxpipe.runtime.execution.virtual_driver): 2:1:1 device groups with 2 chunks each on 4 gloo ranks
train exactly as one process under interleaved 1F1B, interleaved zero-bubble and ZB-V (a tied embedding included),
evaluate and predict, save at v=2 and load at v=1 and back, and run compiled chunks."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.virtual import chunk_groups_for
from fxpipe.passes import trace
from fxpipe.runtime.faults.errors import PipelineSetupError
from tests.exactness_oracle import _call, train_and_compare, train_reference
from tests.mp_utils import compute_nodes, join_world, leave_world, run_ranks

WORLD_SIZE = 4
GLOBAL_BATCH = 12
GROUP_DEVICES = ((0, 1), (2,), (3,))  # layout 2:1:1: group 0 has two replicas
MAX_NORM = 0.05  # below every step's gradient norm in these cases: every step clips (asserted)
LM = "gpt-mini"  # ties the embedding to the output head: chunk 0 and the last chunk hold it
MLP_OVERRIDES = {"in_features": 8, "hidden_features": 16, "out_features": 4, "num_layers": 6}
# (name, model, schedule, micro-batches): M=4 is not a multiple of G=3 for the loops; zbv needs the V map
CASES = (
    ("lm interleaved", LM, "interleaved", 4),
    ("lm interleaved_zero_bubble", LM, "interleaved_zero_bubble", 3),
    ("lm zbv", LM, "zbv", 3),
    ("mlp interleaved", "mlp", "interleaved", 6),
    ("mlp zbv", "mlp", "zbv", 2),
)


def _overrides(model: str) -> dict[str, Any]:
    return MLP_OVERRIDES if model == "mlp" else dict(zoo.get(model).tiny_overrides)


def _build(model: str) -> tuple[torch.nn.Module, Any]:
    return zoo.build(model, **_overrides(model))


def _batches(model: str, num_steps: int = 2, seed: int = 500) -> list[Any]:
    entry = zoo.get(model)
    return [entry.make_batch(GLOBAL_BATCH, seed + step, **_overrides(model)) for step in range(num_steps)]


def virtual_plan(model: str | tuple[torch.nn.Module, Any], schedule: str, num_microbatches: int,
                 virtual_stages: int = 2, group_devices: tuple[tuple[int, ...], ...] = GROUP_DEVICES,
                 tensor_parallel: tuple[int, ...] | None = None, overrides: dict[str, Any] | None = None) -> Plan:
    """Chunks cut at equal node counts, on the device groups (2:1:1 unless given; ``tensor_parallel``: each
    group's T) as a loop (a V for zbv); ``model``: a zoo name (``overrides``: its config, the zoo's tiny one
    unless given) or a model and its example inputs."""
    built, example_inputs = model if isinstance(model, tuple) else \
        zoo.build(model, **(_overrides(model) if overrides is None else overrides))
    graph = trace(built, example_inputs if isinstance(example_inputs, tuple | dict) else (example_inputs,))
    names = compute_nodes(graph)
    num_groups = len(group_devices)
    degrees = tensor_parallel or (1,) * num_groups
    groups = chunk_groups_for("v" if schedule == "zbv" else "loop", num_groups, virtual_stages) if virtual_stages > 1 \
        else tuple(range(num_groups))
    # cut before parameter users at equal counts of them: every chunk holds parameters
    nodes = {node.name: node for node in graph.graph.nodes}
    users = [i for i, name in enumerate(names) if nodes[name].op == "call_module"
             and next(graph.get_submodule(str(nodes[name].target)).parameters(), None) is not None]
    bounds = [0, *(users[round(i * len(users) / len(groups))] for i in range(1, len(groups))), len(names)]
    stages = tuple(StagePlan(c, c, c + 1, len(group_devices[g]) // degrees[g], group_devices[g],
                             node_names=tuple(names[bounds[c]:bounds[c + 1]]), tensor_parallel=degrees[g])
                   for c, g in enumerate(groups))
    if virtual_stages == 1:
        return Plan(GLOBAL_BATCH, num_microbatches, stages, schedule=schedule, planner="test-cuts")
    return Plan(GLOBAL_BATCH, num_microbatches, stages, schedule=schedule, planner="test-cuts",
                virtual_stages=virtual_stages, chunk_groups=groups)


def _compile(model: str, plan: Plan, **options: Any) -> Any:
    built, example_inputs = _build(model)
    return fxpipe.compile(built, example_inputs, loss_fn=zoo.get(model).loss_fn, global_batch_size=GLOBAL_BATCH,
                          plan=plan, **options)


def _in_world(store_dir: str, name: str, rank: int, run: Any) -> Any:
    join_world(store_dir, name, rank, WORLD_SIZE)
    try:
        return run()
    finally:
        leave_world()


def _exact_cases(rank: int, store_dir: str) -> dict[str, Any]:
    references = {model: train_reference(_build(model)[0], zoo.get(model).loss_fn, _batches(model),
                                         after_backward=_clipped) for model in (LM, "mlp")}
    results = {}
    for index, (name, model, schedule, num_microbatches) in enumerate(CASES):
        results[name] = _in_world(store_dir, f"exact-{index}", rank,
                                  lambda case=(name, model, schedule, num_microbatches): _exact(*case, references))
    return results


def _clipped(model: Any) -> float:
    """One process's clipping (MAX_NORM is below every step's norm: every step clips)."""
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))


def _exact(name: str, model: str, schedule: str, num_microbatches: int, references: dict[str, Any]) -> dict[str, Any]:
    pipe = _compile(model, virtual_plan(model, schedule, num_microbatches))
    record = train_and_compare(pipe, _batches(model), references[model],
                               after_backward=lambda pipe: float(pipe.clip_grad_norm_(MAX_NORM)))
    record["reference_norms"] = references[model]["after_backward"]
    record["chunks"] = list(pipe.driver.chunks)
    record["reference_losses"] = references[model]["losses"]
    if name == "lm interleaved":  # forward only, with the trained weights: against the trained reference
        record.update(_inference(pipe, references[model]["model"], model))
    return record


def _inference(pipe: Any, reference: torch.nn.Module, model: str) -> dict[str, Any]:
    inputs, targets = _batches(model, 1, seed=900)[0]
    with torch.no_grad():
        expected_out = _call(reference, inputs)
        expected_loss = float(zoo.get(model).loss_fn(expected_out, targets))
    predicted = pipe.predict(inputs)
    return {"evaluated": pipe.evaluate(inputs, targets), "expected_loss": expected_loss,
            "predict_error": float((predicted - expected_out).abs().max()), "predict_shape": tuple(predicted.shape),
            "expected_shape": tuple(expected_out.shape)}


def _checkpoints(rank: int, store_dir: str, directory: str) -> dict[str, Any]:
    """Train 2 steps under zbv (v=2) and save; load into v=1 (early_backward) and into interleaved (v=2, a loop)."""
    model = LM

    def save() -> dict[str, torch.Tensor]:
        pipe = _compile(model, virtual_plan(model, "zbv", 3))
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        for inputs, targets in _batches(model):
            pipe.step(inputs, targets)
            optimizer.step()
            optimizer.zero_grad()
        pipe.save(directory, optimizer=optimizer, step=2)
        return {name: tensor.numpy().copy() for name, tensor in pipe.state_dict().items()}  # queue-safe

    def load(plan: Plan) -> dict[str, torch.Tensor]:
        pipe = _compile(model, plan)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        info = pipe.load(directory, optimizer=optimizer)
        assert info["step"] == 2
        return {name: tensor.numpy().copy() for name, tensor in pipe.state_dict().items()}

    saved = _in_world(store_dir, "ckpt-save", rank, save)
    at_one = _in_world(store_dir, "ckpt-v1", rank, lambda: load(virtual_plan(model, "early_backward", 3, 1)))
    at_two = _in_world(store_dir, "ckpt-v2", rank, lambda: load(virtual_plan(model, "interleaved", 3)))
    return {"saved": saved, "at_one": at_one, "at_two": at_two}


def _compiled(rank: int, store_dir: str) -> dict[str, Any]:
    """Compiled chunks (aot_eager) under interleaved zero-bubble: F, B and W cut from each chunk's joint graph."""
    model = "mlp"
    reference = train_reference(_build(model)[0], zoo.get(model).loss_fn, _batches(model))

    def run() -> dict[str, Any]:
        pipe = _compile(model, virtual_plan(model, "interleaved_zero_bubble", 3),
                        torch_compile={"backend": "aot_eager"})
        record = train_and_compare(pipe, _batches(model), reference)
        record["compiled"] = all(r.compiled is not None for r in pipe.driver.runners.values())
        record["compile_stats"] = [(stats.stage_index, stats.num_frames > 0, stats.num_split_shapes > 0)
                                   for stats in pipe.compile_stats()]
        return record
    return _in_world(store_dir, "compiled", rank, run)


STALLED = 3  # the rank that stops itself (group 2: ZB-V's middle chunks 2 and 3)
STALL_S, TIMEOUT_S = 3.0, 8.0  # stall_timeout_s and the receive timeout of the stall scenario


def _stall(rank: int, store_dir: str, plan: Plan | None = None) -> dict[str, Any]:
    """Rank STALLED stops (SIGSTOP) before the second step; the others must exit that step naming it, within the
    stall limit and a few seconds; rank 0 then resumes it (SIGCONT), and it fails too, naming the root cause."""
    def run() -> dict[str, Any]:
        pipe = _compile("mlp", plan or virtual_plan("mlp", "zbv", 2), timeout_s=TIMEOUT_S, stall_timeout_s=STALL_S)
        pids: list[Any] = [None] * WORLD_SIZE
        dist.all_gather_object(pids, os.getpid())
        batches = _batches("mlp", 2)
        pipe.step(*batches[0])
        started = time.time()
        if rank == STALLED:
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            pipe.step(*batches[1])
            message = "no error"
        except Exception as error:  # what the test checks
            message = f"{type(error).__name__}: {error}"
        delay = time.time() - started
        try:  # refused locally: the failed step's receives may still be posted
            pipe.step(*batches[1])
            again = "no error"
        except PipelineSetupError as error:
            again = str(error)
        if rank == 0:
            os.kill(pids[STALLED], signal.SIGCONT)
        time.sleep(STALL_S + 2.0)  # stay in the world: a rank leaving early closes its connections under the others
        return {"message": message, "delay": delay, "again": again}
    return _in_world(store_dir, "stall", rank, run)


def _run(rank: int, world_size: int, store_dir: str, directory: str) -> dict[str, Any]:
    return {"exact": _exact_cases(rank, store_dir), "checkpoints": _checkpoints(rank, store_dir, directory),
            "compiled": _compiled(rank, store_dir), "stall": _stall(rank, store_dir)}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = tmp_path_factory.mktemp("virtual-runtime")
    return run_ranks(_run, WORLD_SIZE, store, str(store / "ckpt"), timeout_s=600.0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [name for name, *_ in CASES])
def test_every_schedule_trains_exactly_as_one_process(per_rank: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(per_rank):
        record = results["exact"][case]
        assert not record["problems"], (rank, record["problems"][:3])
        assert record["losses"] == pytest.approx(record["reference_losses"], rel=1e-5), rank
        # clipped by the whole model's norm (the tied weight once), as one process clips
        assert min(record["reference_norms"]) > MAX_NORM, record["reference_norms"]
        assert record["after_backward"] == pytest.approx(record["reference_norms"], rel=1e-5), rank
    chunks = [results["exact"][case]["chunks"] for results in per_rank]
    if "zbv" in case:  # a V: group 0 holds the first and the last chunk (the tied embedding on one rank)
        assert chunks == [[0, 5], [0, 5], [1, 4], [2, 3]]
    else:
        assert chunks == [[0, 3], [0, 3], [1, 4], [2, 5]]


@pytest.mark.multiprocess
def test_evaluate_and_predict_match_the_trained_model(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(per_rank):
        record = results["exact"]["lm interleaved"]
        assert record["evaluated"] == pytest.approx(record["expected_loss"], rel=1e-5), rank
        assert record["predict_shape"] == record["expected_shape"], rank
        assert record["predict_error"] < 1e-4, rank


@pytest.mark.multiprocess
def test_checkpoints_load_between_values_of_v(per_rank: list[dict[str, Any]]) -> None:
    saved: dict[str, Any] = {}
    for results in per_rank:
        saved.update(results["checkpoints"]["saved"])
    for rank, results in enumerate(per_rank):
        for loaded in ("at_one", "at_two"):
            state = results["checkpoints"][loaded]
            assert state, (rank, loaded)
            for name, tensor in state.items():
                assert (tensor == saved[name]).all(), (rank, loaded, name)


@pytest.mark.multiprocess
def test_compiled_chunks_train_exactly(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(per_rank):
        record = results["compiled"]
        assert record["compiled"], rank
        # pipe.compile_stats(): one per chunk of every rank (groups 0, 0, 1, 2 hold chunks 0 and 3, 1 and 4, 2 and
        # 5), each compiled and cut into F, B and W
        assert record["compile_stats"] == [(chunk, True, True) for chunk in (0, 3, 0, 3, 1, 4, 2, 5)], rank
        assert not record["problems"], (rank, record["problems"][:3])


@pytest.mark.multiprocess
def test_a_stalled_rank_is_named_by_every_other_rank(per_rank: list[dict[str, Any]]) -> None:
    check_stall(per_rank)


def check_stall(per_rank: list[dict[str, Any]]) -> None:
    """Every rank's ``_stall`` record: the stalled rank named by every other within the limit, later steps refused."""
    for rank, results in enumerate(per_rank):
        message, delay = results["stall"]["message"], results["stall"]["delay"]
        assert "an earlier step failed (CommunicationError" in results["stall"]["again"], results["stall"]["again"]
        if rank == STALLED:
            assert message.startswith("CommunicationError"), message
            continue
        assert message.startswith("CommunicationError"), (rank, message)
        assert f"rank {STALLED} stalled: no heartbeat for" in message, (rank, message)
        assert delay < STALL_S + 6.0, (rank, delay, message)
