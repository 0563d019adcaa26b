"""Issue 34 item 5 (a), from the planner's own output: on one 8-GPU H100 PCIe node (no NVLink), a Llama 2 13B-shaped
model fine-tuned on 16 sequences of 16384 tokens plans at least 1.2x faster sharded than the best unsharded plan, over
both precisions with fp32 master weights (benchmarks/sharding_study_13b_pcie.md; benchmarks/sharding_pcie.py)."""

from __future__ import annotations

import pytest

from benchmarks import sharding_pcie
from benchmarks.sharding_study import describe

pytest.importorskip("transformers")  # the model is Hugging Face's LlamaForCausalLM (a test dependency of fxpipe)


def test_zero3_beats_every_unsharded_plan_on_a_pcie_node() -> None:
    name, seq, batch = sharding_pcie.HEADLINES[0]
    cluster = sharding_pcie.pcie_cluster()
    plans = sharding_pcie.pcie_plans(sharding_pcie.pcie_chains(name, seq, cluster), cluster, batch)
    shown = {f"{precision} {level}": describe(plan) for (precision, level), plan in plans.items()}
    sharded, unsharded = sharding_pcie.fastest(plans, "auto"), sharding_pcie.fastest(plans, "none")
    assert sharded is not None and unsharded is not None, shown
    assert any(stage.sharding == "parameters" for stage in sharded.stages), shown
    assert all(stage.sharding == "none" for stage in unsharded.stages), shown
    speedup = sharding_pcie.speedup(plans)
    assert speedup is not None and speedup >= 1.2, (speedup, shown)
