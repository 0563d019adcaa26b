"""The planner choosing virtual stages: forced layouts with v chunks per group, "auto" against one stage per group,
memory, exhaustive search over cuts, the API and CLI surfaces, and the errors."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from fxpipe.cli import main
from fxpipe.core.chain import Block, BlockTensorParallel, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, validate_plan
from fxpipe.passes.partition import dapple, virtual_search
from fxpipe.passes.partition.candidates import CandidateCosts
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.request import InfeasiblePlanError
from fxpipe.passes.partition.virtual_request import VirtualStagesError
from fxpipe.passes.partition.virtual_search import Trial, chunk_plan, scaled_balanced_cuts
from fxpipe.sim.virtual_simulate import simulate_virtual

BIG = 2**40


def uniform_chain(num_blocks: int, forward_s: float = 1e-3, param_bytes: int = 10**6, saved: float = 1e5,
                  cut: float = 1e3) -> CostChain:
    blocks = tuple(Block(f"b{i}", (), Affine(0, forward_s), Affine(0, 2 * forward_s), param_bytes, Affine(0, saved))
                   for i in range(num_blocks))
    return CostChain(blocks, tuple(Affine(0, cut) for _ in range(num_blocks - 1)), Affine(0, 1e3), Affine(0, 1e2))


def uneven_chain(times: list[float]) -> CostChain:
    blocks = tuple(Block(f"b{i}", (), Affine(0, t), Affine(0, 2 * t), 10**6, Affine(0, 1e5))
                   for i, t in enumerate(times))
    return CostChain(blocks, tuple(Affine(0, 1e4) for _ in range(len(times) - 1)), Affine(0, 1e3), Affine(0, 1e2))


def fast_cluster(num_devices: int = 4, memory_bytes: int = BIG, bandwidth: float = 100e9) -> Cluster:
    """One host, fast links: the bubble dominates a pipeline with M = G."""
    return Cluster(f"1x{num_devices}", 1, num_devices, DeviceSpec("dev", memory_bytes, (("float32", 1e13),), 1e12),
                   LinkSpec(bandwidth, 1e-6), LinkSpec(bandwidth, 1e-6))


def test_forced_layout_with_two_virtual_stages_gives_eight_chunks_on_four_groups() -> None:
    chain = uniform_chain(16)
    plan = partition(chain, fast_cluster(), 4, layout="1:1:1:1", num_microbatches=4, virtual_stages=2,
                     schedule="interleaved")
    assert (plan.layout, plan.virtual_stages, plan.num_groups, len(plan.stages)) == ("1:1:1:1", 2, 4, 8)
    assert plan.chunk_groups == (0, 1, 2, 3, 0, 1, 2, 3) and plan.chunk_layout == "loop"
    assert plan.schedule == "interleaved" and plan.allreduce_bucket_bytes == 0
    assert [(s.first_block, s.stop_block) for s in plan.stages] == [(2 * c, 2 * c + 2) for c in range(8)]
    for chunk, stage in enumerate(plan.stages):  # every chunk lists its group's devices
        assert stage.devices == plan.stages[plan.chunks_of_group(plan.chunk_groups[chunk])[0]].devices
    validate_plan(plan)
    again = simulate_virtual(plan, chain, fast_cluster())
    assert plan.predicted is not None and again.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s)
    assert [s.peak_memory_bytes for s in plan.stages] == list(again.peak_memory_bytes)
    assert Plan.from_json(plan.to_json()) == plan


def test_zbv_lays_the_chunks_out_as_a_v() -> None:
    plan = partition(uniform_chain(16), fast_cluster(), 8, layout="1:1:1:1", virtual_stages=2, schedule="zbv")
    assert plan.chunk_groups == (0, 1, 2, 3, 3, 2, 1, 0) and plan.chunk_layout == "v" and plan.schedule == "zbv"
    validate_plan(plan)


def test_forced_tensor_parallel_groups_run_chunks_of_their_share() -> None:
    split = BlockTensorParallel(0.9, 10**6, 0.9, Affine(0.0, 1e4), 0)
    chain = uniform_chain(16)
    chain = replace(chain, blocks=tuple(replace(block, tp=split) for block in chain.blocks))
    plan = partition(chain, fast_cluster(), 4, layout="1x2:1x2", num_microbatches=4, virtual_stages=2,
                     schedule="interleaved")
    assert (plan.layout, plan.chunk_groups) == ("1x2:1x2", (0, 1, 0, 1))
    assert all(stage.tensor_parallel == 2 and len(stage.devices) == 2 for stage in plan.stages)
    validate_plan(plan)
    assert plan.predicted is not None
    assert simulate_virtual(plan, chain, fast_cluster()).iteration_time_s == pytest.approx(plan.predicted.iteration_time_s)


def test_default_stays_one_stage_per_group_without_searching(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the virtual search ran although virtual stages were not asked for")

    monkeypatch.setattr(dapple, "plan_virtual", refuse)
    plan = partition(uniform_chain(16), fast_cluster(), 4, layout="1:1:1:1")
    assert plan.virtual_stages == 1 and plan.chunk_groups == ()


def test_auto_picks_virtual_stages_where_the_bubble_dominates() -> None:
    chain = uniform_chain(16, param_bytes=10**8)  # DP does not fit in 5 GB: the plan pipelines
    cluster = fast_cluster(memory_bytes=5 * 10**9)
    plain = partition(chain, cluster, 4)
    chosen = partition(chain, cluster, 4, virtual_stages="auto")
    assert plain.virtual_stages == 1 and plain.num_stages > 1
    assert chosen.virtual_stages > 1 and chosen.schedule == "interleaved"
    assert chosen.predicted is not None and plain.predicted is not None
    assert chosen.predicted.iteration_time_s < 0.9 * plain.predicted.iteration_time_s
    validate_plan(chosen)


def test_auto_keeps_one_stage_per_group_where_memory_forbids_more() -> None:
    """Values crossing the cuts dominate memory (each in-flight micro-batch keeps its chunk's input), and a group's
    chunks hold more micro-batches in flight together than one stage does: with exactly one stage's memory per
    device, "auto" keeps one stage per group and a forced v = 2 is infeasible."""
    chain = uniform_chain(16, saved=1e3, cut=1e8)
    roomy = partition(chain, fast_cluster(bandwidth=1e15), 4, layout="1:1:1:1", num_microbatches=4,
                      virtual_stages="auto", recompute="never")
    assert roomy.virtual_stages > 1  # with room, chunks win
    plain = partition(chain, fast_cluster(bandwidth=1e15), 4, layout="1:1:1:1", num_microbatches=4, recompute="never")
    limit = max(stage.peak_memory_bytes for stage in plain.stages)  # exactly what one stage per group needs
    tight = fast_cluster(memory_bytes=limit, bandwidth=1e15)
    kept = partition(chain, tight, 4, layout="1:1:1:1", num_microbatches=4, virtual_stages="auto", recompute="never")
    assert kept.virtual_stages == 1 and "no plan with virtual stages fits" in kept.notes[-1]
    with pytest.raises(InfeasiblePlanError, match="virtual_stages=2"):
        partition(chain, tight, 4, layout="1:1:1:1", num_microbatches=4, virtual_stages=2, recompute="never")


@pytest.mark.parametrize(("num_microbatches", "auto_v"), [(2, 2), (4, 1)])
def test_chosen_plan_matches_exhaustive_search_over_v_and_cuts(num_microbatches: int, auto_v: int) -> None:
    """Two groups, an uneven 8-block chain, M = G (the bubble pays for chunks) and M = 2G (it does not): "auto" is
    no slower than one stage per group nor than any v in 2..4 with any cuts, and a forced v = 2 is the best cut."""
    chain = uneven_chain([1e-3, 4e-3, 2e-3, 1e-3, 3e-3, 1e-3, 2e-3, 5e-3])
    cluster, batch = fast_cluster(2), num_microbatches  # one row per micro-batch
    common = {"layout": "1:1", "num_microbatches": num_microbatches, "schedule": "interleaved"}
    chosen = partition(chain, cluster, batch, virtual_stages="auto", **common)  # type: ignore[arg-type]
    forced = partition(chain, cluster, batch, virtual_stages=2, **common)  # type: ignore[arg-type]
    plain = partition(chain, cluster, batch, layout="1:1", num_microbatches=num_microbatches)
    model = CandidateCosts(chain, cluster, batch, "adam", BIG)
    groups = tuple((stage.devices, stage.tensor_parallel) for stage in plain.stages)
    best = {v: min(simulate_virtual(chunk_plan(model, Trial(groups, v, "interleaved", 1, (*cuts, 8)), "dapple"),
                                    chain, cluster).iteration_time_s
                   for cuts in itertools.combinations(range(1, 8), 2 * v - 1)) for v in (2, 3, 4)}
    assert chosen.predicted is not None and forced.predicted is not None and plain.predicted is not None
    assert chosen.virtual_stages == auto_v
    assert chosen.predicted.iteration_time_s <= min(plain.predicted.iteration_time_s, *best.values()) * (1 + 1e-9)
    assert forced.predicted.iteration_time_s <= best[2] * (1 + 1e-9)


def test_scaled_cuts_balance_time_per_replica() -> None:
    assert scaled_balanced_cuts([1.0] * 6, [1, 1, 1]) == [2, 4, 6]
    assert scaled_balanced_cuts([1.0] * 6, [2, 1]) == [4, 6]  # the 2-replica chunk takes twice the blocks
    with pytest.raises(ValueError, match="cannot cut"):
        scaled_balanced_cuts([1.0], [1, 1])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"virtual_stages": 4, "schedule": "zbv"}, "exactly 2 chunks"),
    ({"virtual_stages": 5}, "makes 20 chunks"),
    ({"virtual_stages": 2, "num_microbatches": 2}, "M >= G"),
    ({"virtual_stages": "two"}, "'auto' or a positive integer"),
    ({"virtual_stages": 0}, "'auto' or a positive integer"),
    ({"schedule": "interleaved"}, "virtual_stages=1"),
    ({"virtual_stages": 2, "schedule": "gpipe"}, "no virtual-stage form"),
    ({"virtual_stages": 2, "planner": "uniform"}, "only 'dapple'"),
    ({"virtual_stages": 2, "layout": "4"}, "one device group"),
])
def test_impossible_requests_name_the_value_and_the_fix(kwargs: dict[str, object], match: str) -> None:
    options: dict[str, object] = {"layout": "1:1:1:1", **kwargs}
    with pytest.raises(VirtualStagesError, match=match):
        partition(uniform_chain(16), fast_cluster(), 4, **options)  # type: ignore[arg-type]


def test_search_stays_bounded() -> None:
    """The trials per request: structures x v x schedules x at most 2 MICROBATCH_NEIGHBOURS + 1 micro-batch sizes."""
    chain = uniform_chain(16, param_bytes=10**8)
    cluster = fast_cluster(memory_bytes=5 * 10**9)
    plain = partition(chain, cluster, 64)
    request = dapple.PlanRequest(chain=chain, cluster=cluster, global_batch_size=64, memory_limit_bytes=5 * 10**9)
    virtual = dapple.virtual_request("auto", "auto", planner="dapple", num_stages=None, sharding="none")
    assert virtual is not None
    found = list(virtual_search.trials(request, virtual, plain, forced=False))
    per_structure = 3 * 3 * (2 * virtual_search.MICROBATCH_NEIGHBOURS + 1)  # v in 2, 4, 8; three schedules
    depths = [chain.num_blocks // v for v in virtual_search.AUTO_VIRTUAL_STAGES]
    assert 0 < len(found) <= len(virtual_search.group_structures(plain, 4, False, depths)) * per_structure


def test_cli_plans_virtual_stages_and_compare_shows_v(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code = main(["plan", "mlp", "--cluster", "dapple-b", "--global-batch", "8", "--costs", "analytic", "--layout",
                 "1:1", "--num-microbatches", "4", "--virtual-stages", "2", "--compare", "--json", str(out),
                 "--no-run-info"])
    printed = capsys.readouterr().out
    assert code == 0
    plan = Plan.load(out)
    assert (plan.virtual_stages, plan.chunk_groups, plan.schedule) == (2, (0, 1, 0, 1), "interleaved")
    assert "virtual stages=2 (loop: 4 chunks on 2 groups)" in printed
    header = next(line for line in printed.splitlines() if line.startswith("planner"))
    assert header.split()[:4] == ["planner", "layout", "v", "M"]
    assert any(line.split()[:3] == ["dapple_v1", "1:1", "1"] for line in printed.splitlines())
    with pytest.raises(SystemExit):
        main(["plan", "mlp", "--cluster", "dapple-b", "--global-batch", "8", "--virtual-stages", "0"])


def test_fxpipe_plan_takes_virtual_stages() -> None:
    import fxpipe

    model, example_inputs = fxpipe.models.build("mlp")
    plan = fxpipe.plan(model, example_inputs, cluster="dapple-b", global_batch_size=8, costs="analytic", layout="1:1",
                       num_microbatches=4, virtual_stages=2, schedule="zbv")
    assert (plan.virtual_stages, plan.chunk_groups, plan.schedule) == (2, (0, 1, 1, 0), "zbv")
    with pytest.raises(fxpipe.VirtualStagesError, match="exactly 2 chunks"):
        fxpipe.plan(model, example_inputs, cluster="dapple-b", global_batch_size=8, costs="analytic", layout="1:1",
                    virtual_stages=3, schedule="zbv")
