"""Hugging Face transformers models (tiny configs, built offline) compile, plan and train exactly on 4 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxpipe
from fxpipe.plan import Plan
from fxpipe.planning import plan_model
from tests.mp_utils import join_world, leave_world, run_ranks

transformers = pytest.importorskip("transformers")
hf_examples = pytest.importorskip("fxpipe.hf_examples")

pytestmark = pytest.mark.multiprocess

WORLD_SIZE = 4
GLOBAL_BATCH = 8
NUM_STEPS = 3
LEARNING_RATE = 1e-2
# Attention key biases get exactly zero gradient in exact arithmetic (softmax ignores a shift), so their
# gradients are rounding noise that Adam would scale up to full lr steps; a larger eps keeps noise small.
ADAM_EPS = 1e-5
LAYOUTS = ("2:1:1", "1:3", "2:2", "1:1:1:1", "auto")


def _batches(name: str) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    return [hf_examples.make_batch(name, GLOBAL_BATCH, 100 + step) for step in range(NUM_STEPS)]


def _reference(name: str, batches: list[Any]) -> dict[str, Any]:
    """One process, whole batch: step-1 gradients, losses, parameters after NUM_STEPS AdamW steps."""
    model, _ = hf_examples.HF_FACTORIES[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    losses, grads = [], {}
    for step, (inputs, targets) in enumerate(batches):
        loss = hf_examples.hf_loss(model(**inputs), targets)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {key: p.grad.clone() for key, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "grads": grads, "params": {key: p.detach().clone() for key, p in model.named_parameters()}}


def _mismatches(kind: str, actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, rtol: float,
                atol: float) -> list[str]:
    problems = []
    for key, tensor in actual.items():
        try:
            torch.testing.assert_close(tensor, expected[key], rtol=rtol, atol=atol)
        except AssertionError as error:
            problems.append(f"{kind} {key}: {str(error).splitlines()[0:3]}")
    return problems


def _train(name: str, plan: str | Plan, batches: list[Any], reference: dict[str, Any]) -> dict[str, Any]:
    model, example_inputs = hf_examples.HF_FACTORIES[name]()
    pipe = fxpipe.compile(model, example_inputs, loss_fn=hf_examples.hf_loss, global_batch_size=GLOBAL_BATCH,
                          plan=plan)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=LEARNING_RATE, eps=ADAM_EPS)
    losses, problems = [], []
    for step, (inputs, targets) in enumerate(batches):
        losses.append(pipe.step(inputs, targets))
        if step == 0:
            grads = {key: p.grad for key, p in pipe.named_parameters()}
            problems += _mismatches("grad", grads, reference["grads"], rtol=1e-4, atol=1e-6)
        optimizer.step()
        optimizer.zero_grad()
    params = {key: p.detach() for key, p in pipe.named_parameters()}
    problems += _mismatches("param", params, reference["params"], rtol=0.0, atol=1e-4)
    return {"plan": pipe.plan.layout, "losses": losses, "problems": problems, "names": sorted(params)}


def _auto_plan(name: str, world_size: int) -> Plan:
    """What compile(plan="auto") plans on this world; it may use fewer ranks than the world has."""
    model, example_inputs = hf_examples.HF_FACTORIES[name]()
    return plan_model(model, example_inputs, cluster=f"local:{world_size}", global_batch_size=GLOBAL_BATCH)


def _train_all_layouts(rank: int, world_size: int, store_dir: str, name: str) -> list[dict[str, Any] | None]:
    batches = _batches(name)
    reference = _reference(name, batches)
    records: list[dict[str, Any] | None] = []
    for index, layout in enumerate(LAYOUTS):
        plan: str | Plan = _auto_plan(name, world_size) if layout == "auto" else layout
        num_ranks = world_size if isinstance(plan, str) else plan.world_size
        if rank >= num_ranks:
            records.append(None)  # this plan uses fewer ranks; this one sits it out
            continue
        join_world(store_dir, f"{name}-{index}", rank, num_ranks)
        try:
            record = _train(name, plan, batches, reference)
        finally:
            leave_world()
        records.append({**record, "reference_losses": reference["losses"], "all_names": sorted(reference["params"])})
    return records


@pytest.mark.parametrize("name", ["gpt2", "bert-mlm", "llama", "vit"])
def test_hf_model_trains_like_one_process_under_every_layout(name: str, tmp_path: Any) -> None:
    per_rank = run_ranks(_train_all_layouts, WORLD_SIZE, tmp_path, name, timeout_s=300.0)
    failures = []
    for index, layout in enumerate(LAYOUTS):
        records = [records[index] for records in per_rank if records[index] is not None]
        problems = [p for r in records for p in r["problems"]]
        if problems:
            failures.append(f"{layout}: {problems[:4]}")
        if len({tuple(r["losses"]) for r in records}) != 1:
            failures.append(f"{layout}: ranks report different losses")
        if not torch.allclose(torch.tensor(records[0]["losses"]), torch.tensor(records[0]["reference_losses"]),
                              rtol=1e-5, atol=1e-6):
            failures.append(f"{layout}: losses {records[0]['losses']} != {records[0]['reference_losses']}")
        covered = sorted({n for r in records for n in r["names"]})
        if covered != records[0]["all_names"]:
            failures.append(f"{layout}: ranks cover {covered} != model's {records[0]['all_names']}")
    assert not failures, "\n".join(failures)
