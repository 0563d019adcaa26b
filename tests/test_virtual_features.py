"""Virtual stages under reduced precision, on 3 gloo ranks (one world) against one process under the same policy.

gpt-mini (4 blocks, its embedding tied to the head) runs as ``2:1`` with two chunks per device group, under
interleaved 1F1B (the tied weight on both groups) and ZB-V (both its uses on group 0's chunks 0 and 3):
- ``bf16``: autocast over fp32 weights (``autocast_dtype=torch.bfloat16``), and the same policy from the caller's own
  ``torch.autocast`` region around ``step`` (the values between chunks are bf16 both ways);
- ``bf16-params``: every chunk computes with bf16 copies of its fp32 masters (``param_dtype=torch.bfloat16``), also
  with group 0's chunks sharded (ZeRO-3: FSDP2's MixedPrecisionPolicy; the tied embedding stays whole, on copies).

Each rank checks that its masters and gradients stay fp32 and which weight dtype its layers compute with (every
F.linear / F.embedding call of the first step). Against one process under the same policy that slices each weight's
batch as the plan does (group 0's chunks 6 slices of 2 rows, group 1's 3 of 4: tests/test_mixed_precision_params.py's
reference):
- the first step's gradients within GRAD_TOLERANCE of each tensor's largest magnitude: the pipeline computes the same
  slices with the same bf16 roundings and adds their fp32 gradients in another order (replicas, micro-batches, the
  tied weight's two uses), which moves a sum by fp32 roundings (measured: 8e-8 on the tied weight, 0 elsewhere);
- the weights after NUM_STEPS SGD steps within TOLERANCE_FACTOR x the spread the same one-process run shows when only
  the slicing changes (every slice halved; measured 5e-3 to 1.3e-2): from the second step on, the fp32-rounding
  differences in the weights flip low-precision roundings in the forward (measured under fp16: 8e-8 in one step's
  gradients became 3e-4 in the next), which re-slicing does too. Measured 6.7e-8 (bf16) and 0 (bf16-params).

fp16 loss scaling (``pipe.grad_scaler()``) runs ``1:1:1`` (every chunk 3 slices of 4 rows, as a plain eager loop
slices them) under fp16 autocast with a first scale that overflows: every rank must skip that step, back off alike,
and then train as torch's own GradScaler over the same eager loop. ``sync_params="verify"`` passes on equal replicas
and names a differing tied weight on every rank. ``step(partial=True)``, each rank passing only the rows
``input_rows()``/``target_rows()`` name, gives the whole-batch step's loss and gradients bit for bit. Batch norm
``"deferred"`` and ``"sync"`` (one micro-batch) give one process's running statistics (and training, for sync).
``pipe.export`` writes every chunk (ZeRO-3 ones gathered) with its trained weights; ``pipe.measure`` records
every chunk's actions.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.plan import Plan
from fxpipe.runtime.parallel.sharded_stage import full_value
from fxpipe.runtime.sync import ReplicaMismatchError
from tests.exactness_oracle import mismatches, train_and_compare, train_reference
from tests.mp_utils import run_ranks
from tests.test_exactness_training import SmallCNN, _cnn_batches, deferred_statistics_problems
from tests.test_export_pt2 import _train_and_export
from tests.test_mixed_precision_params import (
    BF16,
    GLOBAL_BATCH,
    GRAD_TOLERANCE,
    MODEL,
    NUM_MICROBATCHES,
    NUM_STEPS,
    OVERRIDES,
    _batches,
    _largest_difference,
    _world,
    plan_slicing,
    reference,
)
from tests.test_tensor_parallel_precision import _WeightDtypes
from tests.test_virtual_runtime import virtual_plan

WORLD_SIZE = 3
GROUPS = ((0, 1), (2,))  # 2:1: group 0 has two replicas
LEARNING_RATE = 0.1  # SGD: the weights move by the summed gradients, so they compare the gradients linearly
TOLERANCE_FACTOR = 4.0  # as tests/test_tensor_parallel_precision.py's weights
# (case, schedule, param_dtype, the caller's own autocast region instead of autocast_dtype, group 0's ZeRO level:
# FSDP2's MixedPrecisionPolicy on its chunks, the tied embedding left whole on the runtime's copies)
CASES = (("bf16 interleaved", "interleaved", None, False, "none"),
         ("bf16 caller autocast zbv", "zbv", None, True, "none"),
         ("bf16-params interleaved", "interleaved", BF16, False, "none"),
         ("bf16-params zbv", "zbv", BF16, False, "none"),
         ("bf16-params ZeRO-3 interleaved", "interleaved", BF16, False, "parameters"))
FP16 = torch.float16
EXPORTED = "tied-lm"  # as tests/test_export_pt2.py exports
BN_GROUPS = ((0,), (1, 2))  # 1:2: group 1's two replicas run norm1 (both schedules) and norm2 (zbv)
# step(partial=True), fp32: rows each rank reads on 2:1 with M = 3 (12 rows: 4 per micro-batch, 2 per replica of group
# 0); interleaved puts the last chunk (the targets) on group 1, ZB-V on group 0, both read the inputs on group 0
HALVES = ((0, 2), (4, 6), (8, 10)), ((2, 4), (6, 8), (10, 12))
PARTIAL = {"interleaved": [(HALVES[0], None), (HALVES[1], None), (None, ((0, 12),))],
           "zbv": [(HALVES[0], HALVES[0]), (HALVES[1], HALVES[1]), (None, None)]}
OVERFLOW_SCALE, BACKOFF = 2.0**40, 2.0**-30  # the first step overflows in fp16 on every loss; then 2**10 does not


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LEARNING_RATE)


def _plan(schedule: str, groups: tuple[tuple[int, ...], ...] = GROUPS) -> Plan:
    return virtual_plan(MODEL, schedule, NUM_MICROBATCHES, 2, groups, overrides=OVERRIDES)


def _compile(plan: Plan, **options: Any) -> Any:
    model, example_inputs = zoo.build(MODEL, **OVERRIDES)
    return fxpipe.compile(model, example_inputs, loss_fn=zoo.get(MODEL).loss_fn, global_batch_size=GLOBAL_BATCH,
                          plan=plan, **options)


def _train(schedule: str, param_dtype: torch.dtype | None, caller: bool, sharding: str) -> dict[str, Any]:
    plan = _plan(schedule)
    plan = plan.with_updates(stages=tuple(replace(stage, sharding=sharding if stage.replicas > 1 else "none")
                                          for stage in plan.stages))
    pipe = _compile(plan, autocast_dtype=None if caller else BF16, param_dtype=param_dtype)
    optimizer = _sgd(pipe.parameters())
    weights = _WeightDtypes()
    masters: set[str] = set()
    losses = []
    for step, (inputs, targets) in enumerate(_batches()):
        with torch.autocast("cpu", dtype=BF16, enabled=caller), weights if step == 0 else contextlib.nullcontext():
            losses.append(pipe.step(inputs, targets))
        masters |= {f"{p.dtype}/{p.grad.dtype}" for p in pipe.parameters()}
        if step == 0:
            first = {name: full_value(p.grad).numpy().copy() for name, p in pipe.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    names = {name for name, _ in pipe.named_parameters()}
    state = pipe.state_dict()
    return {"params": {name: state[name].float().numpy() for name in names}, "masters": sorted(masters),
            "computed": sorted(weights.seen), "losses": losses, "group": pipe.driver.group_index, "grads": first}


def _scaled(rank: int) -> dict[str, Any]:
    """1:1:1 under fp16 autocast with pipe.grad_scaler(): the first step overflows and is skipped on every rank."""
    pipe = _compile(_plan("interleaved", ((0,), (1,), (2,))), autocast_dtype=FP16)
    optimizer = _sgd(pipe.parameters())
    scaler = pipe.grad_scaler(init_scale=OVERFLOW_SCALE, backoff_factor=BACKOFF)
    before = {name: p.detach().clone() for name, p in pipe.named_parameters()}
    scales, losses, unchanged = [], [], None
    for step, (inputs, targets) in enumerate(_batches()):
        losses.append(pipe.step(inputs, targets))
        scaler.unscale_(optimizer)
        if step == 1:  # the first step applied
            grads = {name: p.grad.numpy().copy() for name, p in pipe.named_parameters()}
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        optimizer.zero_grad()
        if unchanged is None:
            unchanged = all(torch.equal(p, before[name]) for name, p in pipe.named_parameters())
    state = pipe.state_dict()
    return {"params": {name: state[name].float().numpy() for name, _ in pipe.named_parameters()}, "scales": scales,
            "losses": losses, "first_skipped": unchanged, "has_scaler": pipe.scaler is scaler, "grads": grads}


def _verify(rank: int) -> dict[str, str]:
    """sync_params='verify': equal replicas pass; rank 1's tied embedding changed fails on every rank."""
    _compile(_plan("interleaved"), sync_params="verify")
    model, example_inputs = zoo.build(MODEL, **OVERRIDES)
    if rank == 1:
        with torch.no_grad():
            model.wte.weight.add_(1.0)
    try:
        fxpipe.compile(model, example_inputs, loss_fn=zoo.get(MODEL).loss_fn, global_batch_size=GLOBAL_BATCH,
                       plan=_plan("interleaved"), sync_params="verify")
        return {"differing": "no error"}
    except ReplicaMismatchError as error:
        return {"differing": str(error)}


def _partial(schedule: str) -> dict[str, Any]:
    """One step on the global batch, then the same step with each rank passing only its rows (fp32)."""
    from fxpipe.runtime.transport.rows import gather_rows

    pipe = _compile(_plan(schedule))
    (inputs, targets), = _batches()[:1]
    whole = pipe.step(inputs, targets)
    expected = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    for param in pipe.parameters():
        param.grad = None
    rows, target_rows = pipe.input_rows(), pipe.target_rows()
    loss = pipe.step(tuple(gather_rows(x, rows) for x in inputs), gather_rows(targets, target_rows), partial=True)
    same = all(torch.equal(p.grad, expected[name]) for name, p in pipe.named_parameters())
    return {"rows": (rows, target_rows), "losses": (whole, loss), "same_grads": same}


def _batch_norm(mode: str) -> dict[str, Any]:
    """SmallCNN (two batch norms, neither fed by the other) on 1:2 with two chunks per group (norm1 on group 1's two
    replicas; under interleaved norm2 on group 0, under zbv on group 1 too).

    "deferred" (interleaved, M = 2): train-mode steps feed the running statistics only, committed once per step over
    every slice: they equal one process's whole-batch statistics, and so does an eval-mode step's loss and gradients.
    "sync" (zbv, M = 1): each batch norm normalises over both replicas' rows, the whole batch, so training is exact.
    """
    torch.manual_seed(3)
    model = SmallCNN()
    reference_model = copy.deepcopy(model)
    example = (torch.randn(GLOBAL_BATCH, 3, 6, 6),)
    schedule, num_microbatches = ("interleaved", 2) if mode == "deferred" else ("zbv", 1)
    plan = virtual_plan((copy.deepcopy(model), example), schedule, num_microbatches, 2, BN_GROUPS)
    pipe = fxpipe.compile(model, example, loss_fn=F.cross_entropy, global_batch_size=GLOBAL_BATCH, plan=plan,
                          batch_norm=mode)
    batches = _cnn_batches(11)
    buffers = {name for name, _ in reference_model.named_buffers()}
    if mode == "sync":
        reference = train_reference(reference_model, F.cross_entropy, batches)
        record = train_and_compare(pipe, batches, reference)
        record["problems"] += mismatches("buffer", {n: v for n, v in pipe.state_dict().items() if n in buffers},
                                         dict(reference["model"].named_buffers()), rtol=1e-5, atol=1e-6)
        return {"problems": record["problems"]}
    return {"problems": deferred_statistics_problems(pipe, reference_model, batches)}


def _export(store_dir: str) -> dict[str, Any] | None:
    """tied-lm, 2 SGD steps on 2:1 interleaved (group 0's chunks ZeRO-3, the tied weight on both groups), then
    ``pipe.export``: rank 0 loads the chunks' .pt2 files, chains them and compares with the trained model."""
    entry = zoo.get(EXPORTED)
    plan = virtual_plan(EXPORTED, "interleaved", NUM_MICROBATCHES, 2, GROUPS)
    plan = plan.with_updates(stages=tuple(replace(stage, sharding="parameters" if stage.replicas > 1 else "none")
                                          for stage in plan.stages))
    model, example_inputs = zoo.build(EXPORTED, seed=0, **entry.tiny_overrides)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=GLOBAL_BATCH, plan=plan)
    inputs, targets = entry.make_batch(GLOBAL_BATCH, 3, **entry.tiny_overrides)
    return _train_and_export(pipe, tuple(inputs), targets,
                             lambda: zoo.build(EXPORTED, seed=0, **entry.tiny_overrides)[0], store_dir, "exported")


def _measured(rank: int) -> dict[str, Any]:
    """pipe.measure = True on 2:1 interleaved (fp32): every rank's StepStats, each compute action under its chunk."""
    pipe = _compile(_plan("interleaved"))
    pipe.measure = True
    (inputs, targets), = _batches()[:1]
    pipe.step(inputs, targets)
    stats = pipe.step_stats()
    return {"ranks": [s.rank for s in stats], "peaks": [s.peak_activation_bytes for s in stats],
            "events": sorted((e.stage_index, e.op, e.microbatch_index) for e in stats[rank].events),
            "chunks": list(pipe.chunks), "measure": pipe.measure}


def _in_world(store_dir: str, name: str, rank: int, run: Any) -> Any:
    with _world(store_dir, name, rank, WORLD_SIZE):
        return run()


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for index, (name, *case) in enumerate(CASES):
        results[name] = _in_world(store_dir, f"precision-{index}", rank, lambda case=case: _train(*case))
    results["scaled"] = _in_world(store_dir, "scaled", rank, lambda: _scaled(rank))
    results["verify"] = _in_world(store_dir, "verify", rank, lambda: _verify(rank))
    results["measured"] = _in_world(store_dir, "measured", rank, lambda: _measured(rank))
    results["export"] = _in_world(store_dir, "export", rank, lambda: _export(store_dir))
    for mode in ("deferred", "sync"):
        results[f"batch norm {mode}"] = _in_world(store_dir, f"bn-{mode}", rank, lambda mode=mode: _batch_norm(mode))
    for schedule in PARTIAL:
        results[f"partial {schedule}"] = _in_world(store_dir, f"partial-{schedule}", rank,
                                                   lambda schedule=schedule: _partial(schedule))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_run, WORLD_SIZE, tmp_path_factory.mktemp("virtual_precision"))


def _slicing(ranks: list[dict[str, Any]], case: str) -> dict[str, int]:
    """Each use path's slices as the plan cuts them: group 0's parameters 6 slices, group 1's 3."""
    by_group: dict[int, set[str]] = {}
    for results in ranks:
        by_group.setdefault(results[case]["group"], set()).update(results[case]["params"])
    return plan_slicing(by_group)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [case for case, *_ in CASES])
def test_virtual_chunks_train_as_one_process_under_bf16(ranks: list[dict[str, Any]], case: str) -> None:
    param_dtype = next(dtype for name, _, dtype, *_ in CASES if name == case)
    slicing = _slicing(ranks, case)
    expected = reference(slicing, param_dtype, _sgd)
    resliced = reference({path: 2 * n for path, n in slicing.items()}, param_dtype, _sgd)
    spread = _largest_difference(resliced["params"], expected["params"])
    want = ["torch.bfloat16"] if param_dtype is not None else ["torch.float32"]
    params: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for rank, results in enumerate(ranks):
        record = results[case]
        assert record["masters"] == ["torch.float32/torch.float32"], f"rank {rank}: {record['masters']}"
        assert record["computed"] == want, f"rank {rank}: layers computed with {record['computed']} weights"
        assert record["losses"] == pytest.approx(expected["losses"], rel=2.0**-8), f"rank {rank}"
        params.update({name: torch.from_numpy(value) for name, value in record["params"].items()})
        grads.update({name: torch.from_numpy(value) for name, value in record["grads"].items()})
    _assert_close(case, (grads, params), expected, spread)


def _assert_close(case: str, found: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
                  expected: dict[str, Any], spread: float) -> None:
    """A step's gradients within GRAD_TOLERANCE of one process's, the last weights within TOLERANCE_FACTOR x the
    re-slicing ``spread`` (the module docstring says why)."""
    grads, params = found
    assert set(params) == set(expected["params"]) == set(grads)
    grad_difference = _largest_difference(grads, expected["grads"])
    difference = _largest_difference(params, expected["params"])
    print(f"{case}: gradients {grad_difference:.3g}, weights {difference:.3g}, re-slicing spread {spread:.3g}")
    assert grad_difference <= GRAD_TOLERANCE, f"{case}: gradients differ from one process by {grad_difference:.3g}"
    assert difference <= TOLERANCE_FACTOR * spread, f"{case}: weights differ from one process by {difference:.3g}"


def _eager_scaled(num_slices: int) -> dict[str, Any]:
    """One process: fp16 autocast, each step's batch in ``num_slices`` slices (loss weighted by rows), torch's
    GradScaler with the same arguments, SGD."""
    torch.manual_seed(0)
    model = zoo.build(MODEL, **OVERRIDES)[0]
    loss_fn = zoo.get(MODEL).loss_fn
    optimizer = _sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=OVERFLOW_SCALE, backoff_factor=BACKOFF)
    scales, losses = [], []
    rows = GLOBAL_BATCH // num_slices
    for step, (inputs, targets) in enumerate(_batches()):
        total = 0.0
        for start in range(0, GLOBAL_BATCH, rows):
            with torch.autocast("cpu", dtype=FP16):
                loss = loss_fn(model(*(x[start:start + rows] for x in inputs)), targets[start:start + rows])
                loss = loss.float() * (rows / GLOBAL_BATCH)
            scaler.scale(loss).backward()
            total += float(loss.detach())
        scaler.unscale_(optimizer)
        if step == 1:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(total)
        optimizer.zero_grad()
    return {"params": {name: p.detach().clone() for name, p in model.named_parameters()}, "scales": scales,
            "losses": losses, "grads": grads}


@pytest.mark.multiprocess
def test_virtual_grad_scaler_skips_overflow_on_every_rank_and_trains_as_one_process(
        ranks: list[dict[str, Any]]) -> None:
    expected, resliced = _eager_scaled(NUM_MICROBATCHES), _eager_scaled(2 * NUM_MICROBATCHES)
    assert expected["scales"] == [OVERFLOW_SCALE * BACKOFF] * NUM_STEPS  # the reference did overflow once
    spread = _largest_difference(resliced["params"], expected["params"])
    params: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    for rank, results in enumerate(ranks):
        record = results["scaled"]
        assert record["has_scaler"] and record["first_skipped"], f"rank {rank}: {record}"
        assert record["scales"] == expected["scales"], f"rank {rank}"
        assert record["losses"] == pytest.approx(expected["losses"], rel=2.0**-8), f"rank {rank}"
        params.update({name: torch.from_numpy(value) for name, value in record["params"].items()})
        grads.update({name: torch.from_numpy(value) for name, value in record["grads"].items()})
    _assert_close("fp16 scaled", (grads, params), expected, spread)


@pytest.mark.multiprocess
def test_virtual_sync_verify_names_a_differing_tied_weight_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(ranks):
        message = results["verify"]["differing"]
        assert "'wte.weight'" in message and "ranks [1]" in message, f"rank {rank}: {message}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", list(PARTIAL))
def test_virtual_partial_step_gives_the_whole_batch_step(ranks: list[dict[str, Any]], schedule: str) -> None:
    """Each rank passing only input_rows()/target_rows() gives the same loss and bit-identical gradients."""
    for rank, results in enumerate(ranks):
        record = results[f"partial {schedule}"]
        assert record["rows"] == PARTIAL[schedule][rank], f"rank {rank}"
        whole, partial = record["losses"]
        assert whole == partial and record["same_grads"], f"rank {rank}: {record}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["deferred", "sync"])
def test_virtual_batch_norm_statistics_as_one_process(ranks: list[dict[str, Any]], mode: str) -> None:
    problems = [f"rank {rank}: {problem}" for rank, results in enumerate(ranks)
                for problem in results[f"batch norm {mode}"]["problems"]]
    assert not problems, "\n".join(problems)


@pytest.mark.multiprocess
def test_virtual_export_writes_every_chunk_with_its_trained_weights(ranks: list[dict[str, Any]]) -> None:
    """Rank 0's chained .pt2 chunks against the trained model on another batch (as tests/test_export_pt2.py)."""
    assert all(results["export"] is None for results in ranks[1:])
    check = ranks[0]["export"]
    assert check["trained_moved"], "the export holds the initial weights"
    assert check["exported"]["num_stages"] == 4  # two chunks per group
    assert check["exported"]["output_diff"] < 1e-5, check


@pytest.mark.multiprocess
def test_virtual_measure_records_every_chunk_action(ranks: list[dict[str, Any]]) -> None:
    """Each rank's timeline holds F and B of every micro-batch of each of its chunks, under the chunk's index, and a
    positive saved-activation peak (measure=True)."""
    for rank, results in enumerate(ranks):
        record = results["measured"]
        assert record["measure"] is True and record["ranks"] == list(range(WORLD_SIZE)), f"rank {rank}: {record}"
        assert all(peak is not None and peak > 0 for peak in record["peaks"]), f"rank {rank}: {record['peaks']}"
        expected = sorted((chunk, op, m) for chunk in record["chunks"] for op in ("F", "B")
                          for m in range(NUM_MICROBATCHES))
        assert record["events"] == expected, f"rank {rank}"
