"""Tensor-parallel members hold only their shards, the last stage's loss runs on vocabulary shards, and a stalled
group member is named: one world of 4 gloo ranks, exact against one process (issue 33's runtime gaps)."""

from __future__ import annotations

import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import fxpipe
from tests.exactness_oracle import mismatches
from tests.mp_utils import before_each_forward, rank_context, start_ranks
from tests.test_sharded_stages import _exported_matches, _world
from tests.test_tensor_parallel_runtime import (
    MODELS,
    NUM_STEPS,
    _batches,
    _compile,
    _inference,
    _plan,
    _reference,
    _share_problems,
    _train,
    _whole_weights,
)

WORLD_SIZE = 4
# (name, model, layout: (replicas, T) per stage); every case trains exactly, holds 1/T, predicts and exports
CASES = (
    ("attention 1x2:2", "attention", ((1, 2), (2, 1))),
    ("vocab 2:1x2", "vocab", ((2, 1), (1, 2))),
    ("gpt2 1x2:1x2", "gpt2", ((1, 2), (1, 2))),
)
STALLED_RANK = 1  # member 1 of stage 0's group on 1x2:2
STALL_S, TIMEOUT_S, FAULT_STEP = 3.0, 8.0, 1


def held_bytes(pipe: Any) -> int:
    """Bytes of the parameter storages this rank holds for its stage: its shards, and whatever the program's stage
    module, the traced model (the user's layers) and the runner still reach (meta placeholders hold none)."""
    stage = pipe.program.stages[pipe.stage_index]
    tensors = [param for _, param in pipe.driver.runner.module.named_parameters(remove_duplicate=False)]
    tensors += [param for _, param in stage.module.named_parameters(remove_duplicate=False)]
    tensors += [pipe.graph_module.get_parameter(original) for _, original in stage.param_names
                if original in dict(pipe.graph_module.named_parameters(remove_duplicate=False))]
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes()
                for tensor in tensors if not tensor.is_meta}
    return sum(storages.values())


def expected_bytes(pipe: Any) -> tuple[int, int]:
    """(replicated bytes + split bytes / T, the whole stage's bytes), from the whole tensors' shapes."""
    degree, described = pipe.driver.tensor_parallel.degree, pipe.driver.tp_params
    whole = {name: tensor.numel() * tensor.element_size() for name, tensor in _whole_weights(pipe).items()}
    split = sum(size for name, size in whole.items() if described[name].dim is not None)
    return sum(whole.values()) - split + split // degree, sum(whole.values())


def recorded_gathers(pipe: Any) -> list[tuple[int, ...]]:
    """Record the shape of every all-gather this member's group runs from now on (a list that grows)."""
    comm, shapes = pipe.driver.tp_communicator, []
    original = comm.all_gather

    def all_gather(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        result = original(tensor, dim)
        shapes.append(tuple(result.shape))
        return result

    comm.all_gather = all_gather
    return shapes


def _case(pipe: Any, model: str, reference: dict[str, Any]) -> dict[str, Any]:
    degree = pipe.driver.tensor_parallel.degree
    gathered = recorded_gathers(pipe) if degree > 1 else []
    record = _train(pipe, model, reference)
    vocab = MODELS[model][1]
    whole_logits = [shape for shape in gathered if shape[-1] == vocab]  # while training: never on a parallel loss
    problems = record["problems"] + _share_problems(pipe)
    problems += _inference(pipe, model, reference)  # predict gathers the split logits, evaluate takes them whole
    problems += _exported_matches(pipe, reference)  # the unsharded stage built from gathered weights
    expected, whole = expected_bytes(pipe) if degree > 1 else (0, 0)
    return {"problems": problems, "stage": pipe.stage_index, "degree": degree, "held": held_bytes(pipe),
            "expected": expected, "whole": whole, "whole logits": whole_logits, "notes": pipe.driver.tp_notes,
            "is_last": pipe.driver.is_last, "optimizer": record["optimizer"]}


def _ranks(rank: int, world_size: int, store_dir: str, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        references = {model: _reference(model) for model in {case[1] for case in CASES}}
        outcome = {}
        for index, (name, model, layout) in enumerate(CASES):
            with _world(store_dir, f"case-{index}", rank, world_size):
                pipe = _compile(model, _plan(model, layout))
                outcome[name] = _case(pipe, model, references[model])
                if index == 0:  # a checkpoint of released members: whole tensors, loaded back at T = 2
                    pipe.save(f"{store_dir}/checkpoint", optimizer=outcome[name]["optimizer"], step=NUM_STEPS)
                    pipe.load(f"{store_dir}/checkpoint")
                    outcome[name]["problems"] += mismatches("reloaded", _whole_weights(pipe),
                                                            references[model]["params"], rtol=0.0, atol=1e-4)
                outcome[name].pop("optimizer")
        results.put((rank, "cases", outcome))
        results.put((rank, "stall", _stall(rank, world_size, store_dir)))
    except Exception as error:  # the parent reports it
        results.put((rank, "error", f"{error!r}\n{traceback.format_exc()}"))


def _stall(rank: int, world_size: int, store_dir: str) -> tuple[str, float]:
    """attention 1x2:2: member STALLED_RANK stops (SIGSTOP) at its forward of step FAULT_STEP; what each other rank
    raised, and when."""
    with _world(store_dir, "stall", rank, world_size):
        module, example = MODELS["attention"][0]()
        pipe = fxpipe.compile(module, example, loss_fn=MODELS["attention"][2], global_batch_size=8,
                              plan=_plan("attention", ((1, 2), (2, 1))), loss_reduction="mean", check_rows=False,
                              timeout_s=TIMEOUT_S, stall_timeout_s=STALL_S)
        step_box = [0]
        if rank == STALLED_RANK:
            def stop() -> None:
                if step_box[0] == FAULT_STEP:
                    Path(store_dir, "fault").write_text(repr(time.monotonic()))
                    os.kill(os.getpid(), signal.SIGSTOP)

            before_each_forward(pipe.driver.runner, stop)
        try:
            for step, (inputs, targets) in enumerate(_batches("attention")):
                step_box[0] = step
                pipe.step(inputs, targets)
            return "finished without noticing the stall", time.monotonic()
        except Exception as error:
            return f"{type(error).__name__}: {error}", time.monotonic()


def _spawn(tmp_path: Path) -> tuple[dict[int, Any], dict[int, tuple[str, float]]]:
    """Every rank's case records, and every survivor's stall message with its delay after the stop."""
    context = rank_context()
    results = context.Queue()
    processes = [context.Process(target=_ranks, args=(rank, WORLD_SIZE, str(tmp_path), results))
                 for rank in range(WORLD_SIZE)]
    start_ranks(context, processes)
    cases: dict[int, Any] = {}
    stalls: dict[int, tuple[str, float]] = {}
    try:
        while len(cases) < WORLD_SIZE or len(stalls) < WORLD_SIZE - 1:
            rank, kind, payload = results.get(timeout=300)
            assert kind != "error", f"rank {rank}: {payload}"
            (cases if kind == "cases" else stalls)[rank] = payload
    finally:
        for process in processes:
            if process.is_alive():
                process.join(timeout=30 if process.pid != processes[STALLED_RANK].pid else 0)
            if process.is_alive():
                process.kill()  # the stopped member (SIGKILL ends a stopped process too)
                process.join()
    fault_at = float((tmp_path / "fault").read_text())
    return cases, {rank: (message, at - fault_at) for rank, (message, at) in stalls.items()}


@pytest.mark.multiprocess
def test_members_hold_their_shards_compute_the_loss_on_vocabulary_shards_and_name_a_stalled_member(
        tmp_path: Path) -> None:
    cases, stalls = _spawn(tmp_path)
    failures = [f"{name} rank {rank}: {problem}" for rank, records in cases.items()
                for name, record in records.items() for problem in record["problems"][:3]]
    assert not failures, "\n".join(failures)
    for name, *_ in CASES:
        for rank, records in sorted(cases.items()):
            record = records[name]
            if record["degree"] == 1:
                continue
            # measured: the storages this rank holds for its stage are its shards and the replicated parameters
            assert record["held"] == record["expected"] < record["whole"], (name, rank, record)
            if record["is_last"]:  # the vocabulary head's logits stay split through the loss
                assert any("vocabulary-parallel cross-entropy" in note for note in record["notes"]), record["notes"]
                assert not record["whole logits"], (name, rank, record["whole logits"])
    print({name: [(records[name]["held"], records[name]["expected"], records[name]["whole"])
                  for _, records in sorted(cases.items())] for name, *_ in CASES})
    for rank, (message, delay) in stalls.items():
        assert message.startswith("CommunicationError"), (rank, message)
        assert f"rank {STALLED_RANK} stalled: no heartbeat for" in message, (rank, message)
        assert delay < STALL_S + 10.0, (rank, delay, message)
    print("detection after the stop:", {rank: round(delay, 1) for rank, (_, delay) in sorted(stalls.items())})
