"""Multi-rank exact training: every plan and schedule gives one-process gradients and parameters (gloo, CPU)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import fxpipe
from fxpipe import models as zoo
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


def _reference(entry: zoo.ModelEntry, batches: list[Any]) -> dict[str, Any]:
    return train_reference(zoo.build(entry.name, **entry.tiny_overrides)[0], entry.loss_fn, batches)


def _run_config(entry: zoo.ModelEntry, config: Config, batches: list[Any], reference: dict[str, Any]) -> dict[str, Any]:
    model, example_inputs = zoo.build(entry.name, **entry.tiny_overrides)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), config.replicas, GLOBAL_BATCH,
                          config.num_microbatches, schedule=config.schedule, warmup_policy=config.warmup_policy)
    pipe = fxpipe.compile(model, example_inputs, loss_fn=entry.loss_fn, global_batch_size=GLOBAL_BATCH, plan=plan)
    return {**train_and_compare(pipe, batches, reference), "stage": pipe.stage_index}


def _train_all_configs(rank: int, world_size: int, store_dir: str, model_name: str) -> list[dict[str, Any]]:
    entry = zoo.get(model_name)
    batches = [entry.make_batch(GLOBAL_BATCH, 100 + step, **entry.tiny_overrides) for step in range(NUM_STEPS)]
    reference = _reference(entry, batches)
    records = []
    for index, config in enumerate(CONFIGS):
        if rank >= sum(config.replicas):
            continue  # this plan uses fewer ranks; this one sits it out
        join_world(store_dir, f"{model_name}-{index}", rank, sum(config.replicas))
        try:
            record = _run_config(entry, config, batches, reference)
        finally:
            leave_world()
        records.append({"config": str(config), "reference_losses": reference["losses"],
                        "all_names": sorted(reference["params"]), **record})
    return records


@pytest.mark.parametrize("model_name", ["mlp", "skipnet", "tied-lm"])
def test_every_plan_trains_like_one_process(model_name: str, tmp_path: Any) -> None:
    per_rank = run_ranks(_train_all_configs, WORLD_SIZE, tmp_path, model_name)
    by_config: dict[str, list[dict[str, Any]]] = {}
    for records in per_rank:
        for record in records:
            by_config.setdefault(record["config"], []).append(record)
    assert len(by_config) == len(CONFIGS)
    failures = []
    for name, records in by_config.items():
        problems = [p for r in records for p in r["problems"]]
        losses = {tuple(r["losses"]) for r in records}
        if problems:
            failures.append(f"{name}: {problems[:4]}")
        if len(losses) != 1:
            failures.append(f"{name}: ranks report different losses {losses}")
        if not torch.allclose(torch.tensor(records[0]["losses"]), torch.tensor(records[0]["reference_losses"]),
                              rtol=1e-5, atol=1e-6):
            failures.append(f"{name}: losses {records[0]['losses']} != reference {records[0]['reference_losses']}")
        failures += [f"{name}: {p}" for p in coverage_problems([r["names"] for r in records], records[0]["all_names"])]
    assert not failures, "\n".join(failures)
