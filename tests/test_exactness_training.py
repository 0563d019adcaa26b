"""Issue #16 "exact means exact" on 3 gloo ranks: per-rank seeds, tied weights, other batches, loss
reductions and deferred BatchNorm statistics, each against one process on the whole batch."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe import models as zoo
from fxpipe.passes import trace
from fxpipe.runtime.numerics.batchnorm import BatchNormWarning
from fxpipe.runtime.sync import ReplicaMismatchError
from fxpipe.runtime.transport.batchcheck import BatchMismatchError
from tests.exactness_oracle import (
    mismatches,
    padded_lm_batches,
    padded_lm_mean,
    padded_lm_sum_count,
    sum_mse,
    summed_lm,
    train_and_compare,
    train_reference,
)
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

WORLD_SIZE = 3
GLOBAL_BATCH = 12
NUM_STEPS = 3
LossFn = Callable[[Any, Any], Any]


class SmallCNN(nn.Module):
    """images (B, 3, 6, 6) -> logits (B, 5): two batch norms, neither fed by the other.

    A batch norm fed by another one sees that one's train-mode output, normalised per slice in a
    pipeline, so its running statistics cannot equal the unsplit model's (docs/exactness.md).
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a bias before batch norm gets no gradient
        self.norm1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(4, momentum=0.3)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(images)))  # (B, 4, 6, 6)
        y = self.norm2(self.conv2(images))  # (B, 4, 6, 6), on the next stage
        return self.head((x + y).flatten(1))  # (B, 5)


def _zoo_model(name: str, seed: int) -> tuple[nn.Module, Any]:
    """The tiny zoo model with weights from ``seed`` and its example inputs."""
    return zoo.build(name, seed=seed, **zoo.get(name).tiny_overrides)


def _zoo_batches(name: str, seed: int) -> list[Any]:
    entry = zoo.get(name)
    return [entry.make_batch(GLOBAL_BATCH, seed + step, **entry.tiny_overrides) for step in range(NUM_STEPS)]


def _padded_batches(seed: int) -> list[Any]:
    return padded_lm_batches(GLOBAL_BATCH, seed, NUM_STEPS)


def _cnn_batches(seed: int) -> list[Any]:
    generator = torch.Generator().manual_seed(seed)
    return [((torch.randn(GLOBAL_BATCH, 3, 6, 6, generator=generator),),
             torch.randint(0, 5, (GLOBAL_BATCH,), generator=generator)) for _ in range(NUM_STEPS)]


def _compile(model: nn.Module, example_inputs: Any, replicas: tuple[int, ...], num_microbatches: int,
             **options: Any) -> Any:
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), replicas, GLOBAL_BATCH, num_microbatches)
    return fxpipe.compile(model, example_inputs, global_batch_size=GLOBAL_BATCH, plan=plan, **options)


def _source_model(pipe: Any, build: Callable[[int], nn.Module]) -> nn.Module:
    """The unsplit model fxpipe should start from: each tensor from the lowest rank holding it."""
    reference = build(0)
    state = reference.state_dict()
    source: dict[str, int] = {}
    for stage, stage_plan in zip(pipe.program.stages, pipe.plan.stages, strict=True):
        for _, original in stage.param_names:
            source[original] = min(source.get(original, stage_plan.devices[0]), stage_plan.devices[0])
    for name in state:
        state[name] = build(source[name]).state_dict()[name]
    reference.load_state_dict(state)
    return reference


def _train(pipe: Any, batches: list[Any], reference: dict[str, Any]) -> dict[str, Any]:
    record = train_and_compare(pipe, batches, reference)
    if not torch.allclose(torch.tensor(record["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6):
        record["problems"].append(f"losses {record['losses']} != reference {reference['losses']}")
    return record


def _seeded_scenario(rank: int, name: str, replicas: tuple[int, ...], loss_fn: LossFn, batches: list[Any],
                     **options: Any) -> dict[str, Any]:
    """Every rank builds the model from its own seed; fxpipe must start all replicas from one."""
    def build(seed: int) -> nn.Module:
        return _zoo_model(name, seed)[0]

    model, example_inputs = _zoo_model(name, rank)
    pipe = _compile(model, example_inputs, replicas, 2, loss_fn=options.pop("pipe_loss_fn", loss_fn), **options)
    reference = train_reference(_source_model(pipe, build), loss_fn, batches)
    return _train(pipe, batches, reference)


def _expect_error(error_type: type[Exception], action: Callable[[], Any]) -> str:
    try:
        action()
    except error_type as error:
        return str(error)
    return f"no {error_type.__name__} raised"


def _verify_scenario(rank: int) -> str:
    model, example_inputs = _zoo_model("tied-lm", rank)
    return _expect_error(ReplicaMismatchError, lambda: _compile(model, example_inputs, (2, 1), 2,
                                                                loss_fn=zoo.get("tied-lm").loss_fn,
                                                                sync_params="verify"))


def _other_batch_scenario(rank: int) -> tuple[str, str, float]:
    """Rank 1 passes other data on step 1 (caught before the step) and other targets on step 3 (caught
    by the digests folded into the loss allreduce); both raise on every rank, and training goes on."""
    entry = zoo.get("mlp")
    model, example_inputs = _zoo_model("mlp", 0)
    pipe = _compile(model, example_inputs, (2, 1), 2, loss_fn=entry.loss_fn)
    inputs, targets = entry.make_batch(GLOBAL_BATCH, 5, **entry.tiny_overrides)
    other_inputs, _ = entry.make_batch(GLOBAL_BATCH, 7, **entry.tiny_overrides)
    before = _expect_error(BatchMismatchError, lambda: pipe.step(other_inputs if rank == 1 else inputs, targets))
    pipe.step(inputs, targets)
    other_targets = targets.double() if rank == 1 else targets
    folded = _expect_error(BatchMismatchError, lambda: pipe.step(inputs, other_targets))
    return before, folded, pipe.step(inputs, targets)


def _rows_of(rows: tuple[tuple[int, int], ...] | None, tensor: torch.Tensor) -> torch.Tensor | None:
    """What a sampler that loads only ``rows`` gives this rank."""
    return None if rows is None else torch.cat([tensor[start:stop] for start, stop in rows])


def _partial_scenario(rank: int, replicas: tuple[int, ...]) -> dict[str, Any]:
    """Each rank passes only the rows it reads (partial=True); training equals one process on the whole batch."""
    entry = zoo.get("mlp")
    model, example_inputs = _zoo_model("mlp", 0)
    batches = _zoo_batches("mlp", 80)
    reference = train_reference(copy.deepcopy(model), entry.loss_fn, batches)
    pipe = _compile(model, example_inputs, replicas, 2, loss_fn=entry.loss_fn)
    input_rows, target_rows = pipe.input_rows(), pipe.target_rows()

    class PartialPipe:  # train_and_compare calls step(inputs, targets)
        def __getattr__(self, name: str) -> Any:
            return getattr(pipe, name)

        def step(self, inputs: Any, targets: Any) -> float:
            return pipe.step((_rows_of(input_rows, inputs[0]),), _rows_of(target_rows, targets), partial=True)

    record = _train(PartialPipe(), batches, reference)
    return {**record, "rows": (input_rows, target_rows)}


def deferred_statistics_problems(pipe: Any, reference_model: nn.Module, batches: list[Any]) -> list[str]:
    """Train-mode steps (no optimizer step) feed the running statistics; then one eval-mode step: its loss, gradients
    and this rank's tensors against one process that ran the whole batches (``batch_norm="deferred"``)."""
    for inputs, targets in batches:
        pipe.step(inputs, targets)
        reference_model(*inputs)
    for param in pipe.parameters():
        param.grad = None  # the train-mode steps only fed the running statistics
    pipe.eval()
    reference_model.eval()
    inputs, targets = batches[0]
    loss = pipe.step(inputs, targets)
    reference_loss = F.cross_entropy(reference_model(*inputs), targets)
    reference_loss.backward()
    grads = {name: p.grad for name, p in reference_model.named_parameters()}
    own_grads = {n: p.grad for n, p in pipe.named_parameters()}
    problems = mismatches("eval grad", own_grads, grads, rtol=1e-4, atol=1e-6)
    problems += mismatches("buffer", dict(pipe.state_dict()), reference_model.state_dict(), rtol=1e-5, atol=1e-6)
    if abs(loss - reference_loss.item()) > 1e-5 * abs(reference_loss.item()):
        problems.append(f"eval loss {loss} != reference {reference_loss.item()}")
    return problems


def _batch_norm_scenario(rank: int) -> dict[str, Any]:
    """Train-mode steps (no optimizer step) with deferred statistics, then an eval-mode step: equal to one process."""
    torch.manual_seed(3)
    model = SmallCNN()
    reference_model = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = _compile(model, (torch.randn(GLOBAL_BATCH, 3, 6, 6),), (2, 1), 2, loss_fn=F.cross_entropy,
                        batch_norm="deferred")
    problems = [f"compile changed {key}" for key, value in model.state_dict().items() if not torch.equal(value,
                                                                                                         before[key])]
    if sum(isinstance(w.message, BatchNormWarning) for w in caught) != 1:
        problems.append(f"expected one BatchNormWarning, got {[str(w.message) for w in caught]}")
    problems += deferred_statistics_problems(pipe, reference_model, _cnn_batches(11))
    return {"problems": problems}


def _sync_batch_norm_scenario(rank: int) -> dict[str, Any]:
    """batch_norm="sync" with one micro-batch: every batch norm sees the whole batch, so train mode is exact."""
    torch.manual_seed(4)
    model = SmallCNN()
    batches = _cnn_batches(21)
    reference = train_reference(copy.deepcopy(model), F.cross_entropy, batches)
    reference_buffers = dict(reference["model"].named_buffers())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = _compile(model, (torch.randn(GLOBAL_BATCH, 3, 6, 6),), (2, 1), 1, loss_fn=F.cross_entropy,
                        batch_norm="sync")
    record = _train(pipe, batches, reference)
    buffers = {name: value for name, value in pipe.state_dict().items() if name in reference_buffers}
    record["problems"] += mismatches("buffer", buffers, reference_buffers, rtol=1e-5, atol=1e-6)
    record["problems"] += [f"unexpected warning {w.message}" for w in caught if isinstance(w.message, BatchNormWarning)]
    return record


SCENARIOS: dict[str, Callable[[int], Any]] = {
    "seeds tied 2:1": lambda rank: _seeded_scenario(rank, "tied-lm", (2, 1), zoo.get("tied-lm").loss_fn,
                                                    _zoo_batches("tied-lm", 30)),
    "verify": _verify_scenario,
    "other batch": _other_batch_scenario,
    "sum loss 2:1": lambda rank: _seeded_scenario(rank, "mlp", (2, 1), sum_mse, _zoo_batches("mlp", 60),
                                                  loss_reduction="sum"),
    "sum loss 1:2": lambda rank: _seeded_scenario(rank, "tied-lm", (1, 2), summed_lm, _zoo_batches("tied-lm", 70),
                                                  loss_reduction="sum"),
    "padded LM 1:2": lambda rank: _seeded_scenario(rank, "tied-lm", (1, 2), padded_lm_mean, _padded_batches(40),
                                                   pipe_loss_fn=padded_lm_sum_count, loss_reduction="token_mean"),
    "padded LM 2:1": lambda rank: _seeded_scenario(rank, "tied-lm", (2, 1), padded_lm_mean, _padded_batches(50),
                                                   pipe_loss_fn=padded_lm_sum_count, loss_reduction="token_mean"),
    "batch norm deferred": _batch_norm_scenario,
    "batch norm sync 2:1": _sync_batch_norm_scenario,
    "partial 2:1": lambda rank: _partial_scenario(rank, (2, 1)),
    "partial 1:2": lambda rank: _partial_scenario(rank, (1, 2)),
}

EXPECTED_ROWS = {  # (input_rows, target_rows) by rank: global batch 12, 2 micro-batches of 6 rows
    "partial 2:1": [(((0, 3), (6, 9)), None), (((3, 6), (9, 12)), None), (None, ((0, 12),))],
    "partial 1:2": [(((0, 12),), None), (None, ((0, 3), (6, 9))), (None, ((3, 6), (9, 12)))],
}


def _all_scenarios(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    results = {}
    for index, (name, scenario) in enumerate(SCENARIOS.items()):
        join_world(store_dir, f"exactness-{index}", rank, world_size)
        try:
            results[name] = scenario(rank)
        finally:
            leave_world()
    return results


def test_exactness_scenarios_match_one_process(tmp_path: Any) -> None:
    per_rank = run_ranks(_all_scenarios, WORLD_SIZE, tmp_path)
    failures = []
    for name in SCENARIOS:
        results = [ranks[name] for ranks in per_rank]
        if name == "verify":
            if not all("'embedding.weight'" in r or "differs from rank" in r for r in results):
                failures.append(f"verify: {results}")
        elif name == "other batch":
            if not all("ranks [1] passed step() a different global batch" in r[0] for r in results):
                failures.append(f"other batch, before the step: {results}")
            if not all("ranks [1] passed step() inputs/targets of other shapes or dtypes" in r[1] for r in results):
                failures.append(f"other batch, folded into the loss allreduce: {results}")
            if len({r[2] for r in results}) != 1:
                failures.append(f"other batch: ranks report different losses after the errors {results}")
        else:
            problems = [p for r in results for p in r["problems"]]
            if problems:
                failures.append(f"{name}: {problems[:40]}")
            if "losses" in results[0] and len({tuple(r["losses"]) for r in results}) != 1:
                failures.append(f"{name}: ranks report different losses")
            if name in EXPECTED_ROWS and [r["rows"] for r in results] != EXPECTED_ROWS[name]:
                failures.append(f"{name}: rows {[r['rows'] for r in results]} != {EXPECTED_ROWS[name]}")
    assert not failures, "\n".join(failures)
