"""Issue 34 item 5 (a), from the planner's own output: on one 8-GPU H100 PCIe node (no NVLink), gpt3-13b fine-tuned
at 8192 tokens and a global batch of 8 plans at least 1.2x faster sharded than the best unsharded plan, over both
precisions with fp32 master weights (benchmarks/sharding_study_13b_pcie.md; benchmarks/sharding_pcie.py)."""

from __future__ import annotations

from benchmarks import sharding_pcie
from benchmarks.sharding_study import describe


def test_zero3_beats_every_unsharded_plan_on_a_pcie_node() -> None:
    seq, batch = sharding_pcie.HEADLINE
    cluster = sharding_pcie.pcie_cluster()
    plans = sharding_pcie.pcie_plans(sharding_pcie.pcie_chains(seq, cluster), cluster, batch)
    shown = {f"{precision} {level}": describe(plan) for (precision, level), plan in plans.items()}
    sharded, unsharded = sharding_pcie.fastest(plans, "auto"), sharding_pcie.fastest(plans, "none")
    assert sharded is not None and unsharded is not None, shown
    assert any(stage.sharding == "parameters" for stage in sharded.stages), shown
    assert all(stage.sharding == "none" for stage in unsharded.stages), shown
    speedup = sharding_pcie.speedup(plans)
    assert speedup is not None and speedup >= 1.2, (speedup, shown)
