"""Tensor-parallel chunks on virtual stages (fxpipe.compile_virtual_tensor_parallel): two device groups with 2 chunks
each on 4 gloo ranks, 1x2:1x2 (4 chunks on two 2-way groups) and the hybrid 2:1x2, train exactly as one process under
interleaved 1F1B, interleaved zero-bubble and ZB-V, compiled, sequence-parallel and next to ZeRO-1 chunks too (gpt-mini's
tied embedding across groups, and on one rank as two shards), hold 1/T of each split weight, evaluate and predict, save checkpoints that load at v=1, T=1, and name a
stalled group member."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from fxpipe import models as zoo
from fxpipe.core.plan import Plan
from fxpipe.runtime.faults.errors import PipelineSetupError
from tests.exactness_oracle import LEARNING_RATE, _call, mismatches, train_reference
from tests.mp_utils import run_ranks
from tests.test_virtual_runtime import (
    LM,
    MAX_NORM,
    WORLD_SIZE,
    _batches,
    _build,
    _clipped,
    _compile,
    _in_world,
    _stall,
    check_stall,
    virtual_plan,
)

PAIRS = ((0, 1), (2, 3))
LAYOUTS = {"1x2:1x2": (2, 2), "2:1x2": (1, 2)}  # each group's T
# (name, model, layout, schedule, micro-batches): M=3 is not a multiple of G=2 for the loops
CASES: tuple[tuple[str, str, str, str, int], ...] = (
    ("lm 1x2:1x2 interleaved", LM, "1x2:1x2", "interleaved", 3),
    ("lm 1x2:1x2 zbv", LM, "1x2:1x2", "zbv", 2),
    ("lm 2:1x2 zbv", LM, "2:1x2", "zbv", 3),
    ("mlp 2:1x2 interleaved_zero_bubble", "mlp", "2:1x2", "interleaved_zero_bubble", 3),
    # group 0's chunks at ZeRO-1 over its 2 replicas next to group 1's tensor-parallel chunks
    ("mlp 2:1x2 zbv zero1", "mlp", "2:1x2", "zbv", 3),
    ("mlp 1x2:1x2 interleaved", "mlp", "1x2:1x2", "interleaved", 4),
    # norms and adds on token shares inside each chunk, whole values between chunks
    ("lm 1x2:1x2 interleaved SP", LM, "1x2:1x2", "interleaved", 3),
    ("mlp 1x2:1x2 interleaved compiled", "mlp", "1x2:1x2", "interleaved", 3),
    # split-backward compiled tensor-parallel chunks run W inside B (compiled_stages._split_stage warns)
    ("mlp 1x2:1x2 interleaved_zero_bubble compiled", "mlp", "1x2:1x2", "interleaved_zero_bubble", 3),
)
COMPILED = {"torch_compile": {"backend": "aot_eager"}}


def tp_plan(model: str, layout: str, schedule: str, num_microbatches: int, virtual_stages: int = 2) -> Plan:
    return virtual_plan(model, schedule, num_microbatches, virtual_stages, PAIRS, LAYOUTS[layout])


def _whole_grads(pipe: Any) -> dict[str, torch.Tensor]:
    """Every gradient whole (a shard gathered over its group: every member walks the same names in order)."""
    return {name: pipe.driver.whole(name, p.grad) for name, p in pipe.named_parameters() if p.grad is not None}


def _held(pipe: Any) -> dict[str, Any]:
    """Per split parameter, the numel this rank holds and the whole numel; and the unsharded chunks' storage."""
    driver = pipe.driver
    split = {name: (p.numel(), int(torch.Size(driver.tp_params[name].full_shape).numel()))
             for name, p in pipe.named_parameters() if name in driver.tp_params and driver.tp_params[name].dim is not None}
    unsharded = [p.device.type for c in driver.chunks for p in driver.program.stages[c].module.parameters()]
    return {"split": split, "unsharded_devices": sorted(set(unsharded)), "degree": driver.tensor_parallel.degree}


def _exact(name: str, model: str, layout: str, schedule: str, num_microbatches: int, reference: dict[str, Any],
           inference: bool) -> dict[str, Any]:
    options: dict[str, Any] = COMPILED if "compiled" in name else {"sequence_parallel": True} if "SP" in name else {}
    plan = tp_plan(model, layout, schedule, num_microbatches)
    if "zero1" in name:
        plan = plan.with_updates(stages=tuple(replace(s, sharding="optimizer") if s.replicas > 1 else s
                                              for s in plan.stages))
    pipe = _compile(model, plan, **options)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE)
    losses, norms, problems = [], [], []
    for step, (inputs, targets) in enumerate(_batches(model)):
        losses.append(pipe.step(inputs, targets))
        norms.append(float(pipe.clip_grad_norm_(MAX_NORM)))  # each shard once, whole parameters once per group
        tolerance = {"rtol": 1e-4, "atol": 1e-6} if step == 0 else {"rtol": 1e-3, "atol": 1e-6, "atol_of_largest": 1e-3}
        problems += mismatches(f"step {step} grad", _whole_grads(pipe), reference["grads_per_step"][step], **tolerance)
        optimizer.step()
        optimizer.zero_grad()
    state = pipe.state_dict()  # whole tensors under the original names
    problems += mismatches("param", {n: t for n, t in state.items() if n in reference["params"]}, reference["params"],
                           rtol=0.0, atol=1e-4)
    record = {"partial": sorted(n for n, p in pipe.driver.tp_params.items() if p.partial), "sharded": sorted(n for n, p in pipe.named_parameters() if isinstance(p, DTensor)), "losses": losses, "norms": norms, "problems": problems, "chunks": list(pipe.driver.chunks),
              "compiled": [c for c, runner in pipe.driver.runners.items() if runner.compiled is not None],
              "w_in_b": sorted({runner.compiled.stats.w_in_b_reason for runner in pipe.driver.runners.values()
                                if runner.compiled is not None and runner.compiled.stats.w_in_b_reason}),
              "state_shapes": {n: tuple(t.shape) for n, t in state.items()}, **_held(pipe)}
    if inference:  # forward only, with the trained weights: against the trained reference
        inputs, targets = _batches(model, 1, seed=900)[0]
        with torch.no_grad():
            expected = _call(reference["model"], inputs)
        predicted = pipe.predict(inputs)
        record.update(evaluated=pipe.evaluate(inputs, targets),
                      expected_loss=float(zoo.get(model).loss_fn(expected, targets)),
                      predict_error=float((predicted - expected).abs().max()))
    return record


def _exact_cases(rank: int, store_dir: str) -> dict[str, Any]:
    references = {model: train_reference(_build(model)[0], zoo.get(model).loss_fn, _batches(model),
                                         after_backward=_clipped) for model in (LM, "mlp")}
    results = {}
    for index, (name, model, layout, schedule, num_microbatches) in enumerate(CASES):
        case = (name, model, layout, schedule, num_microbatches)
        results[name] = _in_world(store_dir, f"exact-{index}", rank,
                                  lambda case=case, first=index == 0: _exact(*case, references[case[1]], first))
        results[name]["reference_norms"] = references[model]["after_backward"]
        results[name]["reference_losses"] = references[model]["losses"]
        results[name]["reference_shapes"] = {n: tuple(t.shape) for n, t in references[model]["params"].items()}
    return results


def _checkpoints(rank: int, store_dir: str, directory: str) -> dict[str, Any]:
    """Train 2 steps at 1x2:1x2 under zbv (v=2, T=2) and save; load at 2:1:1 with v=1 (T=1) and at 2:1x2
    (v=2, interleaved), then train one more step on each: the same weights as the saving run's next step."""
    def train(pipe: Any, optimizer: Any, batches: list[Any]) -> None:
        for inputs, targets in batches:
            pipe.step(inputs, targets)
            optimizer.step()
            optimizer.zero_grad()

    def arrays(pipe: Any) -> dict[str, Any]:
        return {name: t.numpy().copy() for name, t in pipe.state_dict().items()}  # queue-safe

    def save() -> dict[str, Any]:
        pipe = _compile("mlp", tp_plan("mlp", "1x2:1x2", "zbv", 2))
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE)
        train(pipe, optimizer, _batches("mlp"))
        pipe.save(directory, optimizer=optimizer, step=2)
        saved = arrays(pipe)
        train(pipe, optimizer, _batches("mlp", 1, seed=700))
        return {"saved": saved, "trained": arrays(pipe)}

    def load(plan: Plan) -> dict[str, Any]:
        pipe = _compile("mlp", plan)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE)
        assert pipe.load(directory, optimizer=optimizer)["step"] == 2
        loaded = arrays(pipe)
        train(pipe, optimizer, _batches("mlp", 1, seed=700))
        return {"loaded": loaded, "trained": arrays(pipe)}

    return {"saved": _in_world(store_dir, "ckpt-save", rank, save),
            "v1": _in_world(store_dir, "ckpt-v1", rank, lambda: load(virtual_plan("mlp", "early_backward", 2, 1))),
            "hybrid": _in_world(store_dir, "ckpt-hybrid", rank,
                                lambda: load(tp_plan("mlp", "2:1x2", "interleaved", 2)))}


def _refusal(rank: int, store_dir: str) -> str:
    """gpt-mini's tied embedding on a T=1 group (chunk 0) and a T=2 one (the last chunk of the loop): refused."""
    def run() -> str:
        with pytest.raises(PipelineSetupError) as error:
            _compile(LM, tp_plan(LM, "2:1x2", "interleaved", 3))
        return str(error.value)
    return _in_world(store_dir, "refusal", rank, run)


def _run(rank: int, world_size: int, store_dir: str, directory: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return {"exact": _exact_cases(rank, store_dir), "checkpoints": _checkpoints(rank, store_dir, directory),
            "refusal": _refusal(rank, store_dir),
            # rank 3 (member 1 of group 1, ZB-V's middle chunks) stops: its partner waits in a tensor-parallel collective
            "stall": _stall(rank, store_dir, tp_plan("mlp", "1x2:1x2", "zbv", 2))}


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = tmp_path_factory.mktemp("virtual-tp")
    return run_ranks(_run, WORLD_SIZE, store, str(store / "ckpt"), timeout_s=900.0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [name for name, *_ in CASES])
def test_tensor_parallel_chunks_train_exactly_as_one_process(per_rank: list[dict[str, Any]], case: str) -> None:
    for rank, results in enumerate(per_rank):
        record = results["exact"][case]
        assert not record["problems"], (rank, record["problems"][:3])
        assert record["losses"] == pytest.approx(record["reference_losses"], rel=1e-5), rank
        # clipped by the whole model's norm (each shard once, the tied weight once), as one process clips
        assert min(record["reference_norms"]) > MAX_NORM, record["reference_norms"]
        assert record["norms"] == pytest.approx(record["reference_norms"], rel=1e-5), rank
        shapes = {n: shape for n, shape in record["state_shapes"].items() if n in record["reference_shapes"]}
        assert shapes and shapes == {n: record["reference_shapes"][n] for n in shapes}, rank  # whole, not shards
    chunks = [results["exact"][case]["chunks"] for results in per_rank]
    assert chunks == ([[0, 3], [0, 3], [1, 2], [1, 2]] if "zbv" in case else [[0, 2], [0, 2], [1, 3], [1, 3]])


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [name for name, *_ in CASES])
def test_each_member_holds_a_t_th_of_every_split_weight(per_rank: list[dict[str, Any]], case: str) -> None:
    layout = next(layout for name, _, layout, *_ in CASES if name == case)
    for rank, results in enumerate(per_rank):
        record = results["exact"][case]
        degree = LAYOUTS[layout][rank // 2]
        assert record["degree"] == degree, rank
        if degree == 1:
            assert not record["split"], rank
            continue
        # the pass splits linear pairs: ZB-V's middle chunks of the 6-layer MLP hold one linear layer each
        assert bool(record["split"]) == (case != "mlp 2:1x2 zbv zero1"), rank
        for name, (held, whole) in record["split"].items():
            assert held * degree == whole, (rank, name, held, whole)
        assert record["unsharded_devices"] == ["meta"], rank  # the whole chunks' storage was dropped


@pytest.mark.multiprocess
def test_evaluate_and_predict_match_the_trained_model(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(per_rank):
        record = results["exact"][CASES[0][0]]
        assert record["evaluated"] == pytest.approx(record["expected_loss"], rel=1e-5), rank
        assert record["predict_error"] < 1e-4, rank


@pytest.mark.multiprocess
def test_a_checkpoint_saved_at_t2_v2_loads_at_t1_v1(per_rank: list[dict[str, Any]]) -> None:
    saved: dict[str, Any] = {}
    trained: dict[str, Any] = {}
    for results in per_rank:
        saved.update(results["checkpoints"]["saved"]["saved"])
        trained.update(results["checkpoints"]["saved"]["trained"])
    for rank, results in enumerate(per_rank):
        for kind in ("v1", "hybrid"):
            record = results["checkpoints"][kind]
            assert record["loaded"], (rank, kind)
            for name, tensor in record["loaded"].items():
                assert (tensor == saved[name]).all(), (rank, kind, name)
            for name, tensor in record["trained"].items():  # the optimizer state came along: the same next step
                torch.testing.assert_close(torch.from_numpy(tensor), torch.from_numpy(trained[name]),
                                           rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_a_weight_tied_across_groups_of_different_t_is_refused(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(per_rank):
        assert "tensor-parallel degrees differ" in results["refusal"], (rank, results["refusal"])


@pytest.mark.multiprocess
def test_compiled_tensor_parallel_chunks_train_exactly(per_rank: list[dict[str, Any]]) -> None:
    compiled = [name for name, *_ in CASES if "compiled" in name]
    for rank, results in enumerate(per_rank):
        for name in compiled:  # exact: test_tensor_parallel_chunks_train_exactly_as_one_process
            assert results["exact"][name]["compiled"] == results["exact"][name]["chunks"], (rank, name)
        assert not results["exact"][compiled[0]]["w_in_b"], rank
        # split backward: the compiled TP chunks cut into F, B and W too (runtime/parallel/traced_collectives)
        assert not results["exact"][compiled[1]]["w_in_b"], rank


@pytest.mark.multiprocess
def test_a_stalled_group_member_is_named_by_every_other_rank(per_rank: list[dict[str, Any]]) -> None:
    check_stall(per_rank)


@pytest.mark.multiprocess
def test_zero1_chunks_run_next_to_tensor_parallel_ones(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(per_rank):
        sharded = results["exact"]["mlp 2:1x2 zbv zero1"]["sharded"]
        assert bool(sharded) == (rank < 2), (rank, sharded)  # group 0's weights are FSDP2 shards, group 1's TP shards


@pytest.mark.multiprocess
def test_sequence_parallel_chunks_sum_their_partial_gradients_over_the_group(per_rank: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(per_rank):  # exact: test_tensor_parallel_chunks_train_exactly_as_one_process
        assert results["exact"]["lm 1x2:1x2 interleaved SP"]["partial"], rank  # the norms' weights
        assert not results["exact"]["lm 1x2:1x2 interleaved"]["partial"], rank
