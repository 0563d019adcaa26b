"""Multi-rank exact training: every plan and schedule gives one-process gradients and parameters (gloo, CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.plan import Plan
from fxpipe.passes import trace
from tests.exactness_oracle import coverage_problems, train_and_compare, train_reference
from tests.mp_utils import join_world, leave_world, plan_from_cuts, run_ranks

pytestmark = pytest.mark.multiprocess

WORLD_SIZE = 4
GLOBAL_BATCH = 12
NUM_STEPS = 3


@dataclass(frozen=True)
class Config:
    replicas: tuple[int, ...]
    schedule: str = "early_backward"
    warmup_policy: str = "A"
    num_microbatches: int = 3

    def __str__(self) -> str:
        return f"{':'.join(map(str, self.replicas))}/{self.schedule}-{self.warmup_policy}/M={self.num_microbatches}"


LAYOUTS = [(1, 1), (1, 1, 1, 1), (3, 1), (1, 3), (2, 2), (2, 1, 1), (4,)]
CONFIGS = [Config(layout) for layout in LAYOUTS] + [
    Config(layout, "gpipe", num_microbatches=2) for layout in [(1, 1, 1, 1), (3, 1), (2, 1, 1)]
] + [Config(layout, "early_backward", "B", num_microbatches=4) for layout in [(1, 1, 1, 1), (1, 3), (2, 2)]] + [
    # split backward (B then W): every exact-training layout plus 2:1 and 1:2, both warm-up policies
    Config(layout, "zero_bubble", policy, num_microbatches)
    for layout, policy, num_microbatches in [*((layout, "A", 3) for layout in LAYOUTS), ((2, 1), "A", 4),
                                             ((1, 2), "B", 4), ((1, 1, 1, 1), "B", 4)]
]


MODEL_NAMES = ("mlp", "skipnet", "tied-lm")


def _batches(entry: zoo.ModelEntry) -> list[Any]:
    return [entry.make_batch(GLOBAL_BATCH, 100 + step, **entry.tiny_overrides) for step in range(NUM_STEPS)]


def _reference(entry: zoo.ModelEntry) -> dict[str, Any]:
    """One process, whole batch; the model itself left out (the ranks need only its numbers)."""
    trained = train_reference(zoo.build(entry.name, **entry.tiny_overrides)[0], entry.loss_fn, _batches(entry))
    return {key: value for key, value in trained.items() if key != "model"}


def _plans(entry: zoo.ModelEntry) -> list[Plan]:
    """Every CONFIG's plan, cut from one trace of the model (the ranks' own traces give the same node names)."""
    model, example_inputs = zoo.build(entry.name, **entry.tiny_overrides)
    traced = trace(model, example_inputs)
    return [plan_from_cuts(traced, config.replicas, GLOBAL_BATCH, config.num_microbatches, schedule=config.schedule,
                           warmup_policy=config.warmup_policy) for config in CONFIGS]


def _run_config(entry: zoo.ModelEntry, plan: Plan, batches: list[Any], reference: dict[str, Any]) -> dict[str, Any]:
    model, example_inputs = zoo.build(entry.name, **entry.tiny_overrides)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=GLOBAL_BATCH, plan=plan)
    return {**train_and_compare(pipe, batches, reference), "stage": pipe.stage_index}


def _train_all_models(rank: int, world_size: int, store_dir: str,
                      work: dict[str, tuple[list[Plan], dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Every model's CONFIGs, one fresh group each, in this one world of ranks; records by model."""
    return {model_name: _train_all_configs(rank, store_dir, model_name, plans, reference)
            for model_name, (plans, reference) in work.items()}


def _train_all_configs(rank: int, store_dir: str, model_name: str, plans: list[Plan],
                       reference: dict[str, Any]) -> list[dict[str, Any]]:
    entry = zoo.get(model_name)
    batches = _batches(entry)
    records = []
    for index, (config, plan) in enumerate(zip(CONFIGS, plans, strict=True)):
        if rank >= sum(config.replicas):
            continue  # this plan uses fewer ranks; this one sits it out
        join_world(store_dir, f"{model_name}-{index}", rank, sum(config.replicas))
        try:
            record = _run_config(entry, plan, batches, reference)
        finally:
            leave_world()
        records.append({"config": str(config), "reference_losses": reference["losses"],
                        "all_names": sorted(reference["params"]), **record})
    return records


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[dict[str, Any]]]]:
    """One world of WORLD_SIZE ranks trains every model's CONFIGs; plans and references made once, here."""
    work = {name: (_plans(zoo.get(name)), _reference(zoo.get(name))) for name in MODEL_NAMES}
    return run_ranks(_train_all_models, WORLD_SIZE, tmp_path_factory.mktemp("exact"), work, timeout_s=450.0)


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_every_plan_trains_like_one_process(model_name: str, per_rank: list[dict[str, list[dict[str, Any]]]]) -> None:
    by_config: dict[str, list[dict[str, Any]]] = {}
    for records in per_rank:
        for record in records[model_name]:
            by_config.setdefault(record["config"], []).append(record)
    assert len(by_config) == len(CONFIGS)
    failures = []
    for name, records in by_config.items():
        problems = [p for r in records for p in r["problems"]]
        losses = {tuple(r["losses"]) for r in records}
        if problems:
            failures.append(f"{model_name} {name}: {problems[:4]}")
        if len(losses) != 1:
            failures.append(f"{model_name} {name}: ranks report different losses {losses}")
        if not torch.allclose(torch.tensor(records[0]["losses"]), torch.tensor(records[0]["reference_losses"]),
                              rtol=1e-5, atol=1e-6):
            failures.append(f"{model_name} {name}: losses {records[0]['losses']} != reference "
                            f"{records[0]['reference_losses']}")
        failures += [f"{model_name} {name}: {p}"
                     for p in coverage_problems([r["names"] for r in records], records[0]["all_names"])]
    assert not failures, "\n".join(failures)
