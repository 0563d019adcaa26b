"""Planning sharded stage replicas (ZeRO-1/2/3 per stage): exact memory and communication figures per level,
the simulator against the separate reference on sharded plans, what ``sharding="auto"`` picks, the request's
checks, and a plan file written by ``fxpipe plan --sharding`` read back."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from reference_sim import reference_run
from test_oracle_simulate import assert_agrees, rich_setup
from torch.distributed.pipelining import pipe_split

from fxpipe.cli import main
from fxpipe.core.chain import Block, CostChain
from fxpipe.core.cluster import Cluster, DeviceSpec, LinkSpec, parse_cluster
from fxpipe.core.costgraph import Affine
from fxpipe.core.plan import Plan, StagePlan
from fxpipe.core.planfile import load_plan_file
from fxpipe.core.sharding import SHARDING_LEVELS
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.latency import analytic_iteration_time
from fxpipe.passes.partition.request import InfeasiblePlanError, PlanningError
from fxpipe.planning import plan_markers
from fxpipe.sim.sharding_cost import sharding_comm
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import StageCost, stage_memory_bytes

GiB = 2**30


def test_memory_per_device_of_each_level_by_hand() -> None:
    # P = 1000 parameter bytes on 4 replicas, Adam (weights, grads, 2 moments); the whole stage is one FSDP unit
    cost = StageCost(rows=1, forward_s=0.0, backward_s=0.0, param_bytes=1000, activation_bytes=0.0,
                     input_bytes=0.0, output_bytes=0.0)
    figures = {level: stage_memory_bytes(cost, 1, "adam", sharding=level, replicas=4, num_microbatches=3)
               for level in SHARDING_LEVELS}
    # none 4P; ZeRO-1: gathered weights P + shard P/4, full gradients P, moments 2P/4; ZeRO-2/3 from the second
    # micro-batch: gathered weights P, new gradients P, the previous backward's kept reduce-scatter input P,
    # weight and gradient shards 2P/4, moments 2P/4
    assert figures == {"none": 4000, "optimizer": 2750, "gradients": 4000, "parameters": 4000}
    # one micro-batch: no reduce-scatter input is kept from an earlier backward
    single = {level: stage_memory_bytes(cost, 1, "adam", sharding=level, replicas=4, num_microbatches=1)
              for level in SHARDING_LEVELS}
    assert single == {"none": 4000, "optimizer": 2750, "gradients": 2750, "parameters": 2750}
    # SGD keeps no state: ZeRO-1 costs the shard on top of the gathered weights; one replica has nothing to split
    assert stage_memory_bytes(cost, 1, "sgd", sharding="optimizer", replicas=4, num_microbatches=3) == 2250
    assert stage_memory_bytes(cost, 1, "adam", sharding="parameters", replicas=1) == 4000
    with pytest.raises(ValueError, match="needs num_microbatches >= 1.*got None"):
        stage_memory_bytes(cost, 1, "adam", sharding="gradients", replicas=4)


def test_memory_per_device_with_one_fsdp_unit_per_block_by_hand() -> None:
    # P = 1000 bytes in 4 blocks of U = 250 on 4 replicas, Adam (f = 4: f P / r = 1000)
    cost = StageCost(rows=1, forward_s=0.0, backward_s=0.0, param_bytes=1000, activation_bytes=0.0,
                     input_bytes=0.0, output_bytes=0.0, unit_bytes=250.0)

    def figures(num_microbatches: int, **options: object) -> dict[str, int]:
        return {level: stage_memory_bytes(cost, 1, "adam", sharding=level, replicas=4,
                                          num_microbatches=num_microbatches, **options)  # type: ignore[arg-type]
                for level in SHARDING_LEVELS}

    # ZeRO-1 as one unit (weights kept, full gradients); ZeRO-2 the weights P + f P / r + one unit's gradients and
    # the previous unit's kept reduce-scatter input; ZeRO-3 f P / r + a unit, the next unit's flat output and copy,
    # the previous flat output and the kept input
    assert figures(3) == {"none": 4000, "optimizer": 2750, "gradients": 2500, "parameters": 2250}
    # one micro-batch: ZeRO-3 peaks in the second unit's backward, before two units' gradient shards exist
    assert figures(1) == {"none": 4000, "optimizer": 2750, "gradients": 2000, "parameters": 1875}
    # ZeRO-3 keeping the weights from forward to backward holds what ZeRO-2 holds
    assert figures(3, reshard_after_forward=False)["parameters"] == 2500
    # a recomputed stage is one unit (its checkpoint spans the stage): the whole-stage figures
    assert stage_memory_bytes(cost, 1, "adam", True, sharding="parameters", replicas=4, num_microbatches=3) == 4000


def _net(num_hosts: int = 1, per_host: int = 4, memory_bytes: int = 2**40, name: str = "dev") -> Cluster:
    device = DeviceSpec(name, memory_bytes, (("float32", 1e13),), 1e12)
    return Cluster("net", num_hosts, per_host, device, LinkSpec(1e9, 1e-5), LinkSpec(1e8, 1e-4))


def test_communication_of_each_level_by_hand() -> None:
    net = _net()
    # a ring reduce-scatter or all-gather of 4e8 bytes over 4 devices: 3 steps of 1e-5 s latency and a quarter
    # of the bytes at 1e9 B/s, plus one copy through the flat buffer (read + write) at 1e12 B/s
    half = 3 * 1e-5 + 3 * 1e8 / 1e9 + 2 * 4e8 / 1e12
    comms = {level: sharding_comm(net, level, (0, 1, 2, 3), 4e8, 4e8) for level in SHARDING_LEVELS}
    assert comms["none"] == (0.0, 0.0, 0.0, 0.0)
    assert comms["optimizer"] == pytest.approx((half, 0.0, 0.0, half))  # (start, per F, per B, tail)
    assert comms["gradients"] == pytest.approx((half, 0.0, half, 0.0))
    assert comms["parameters"] == pytest.approx((0.0, half, 2 * half, 0.0))
    assert comms["gradients"].step_seconds(8) == pytest.approx(9 * half)
    assert sharding_comm(net, "parameters", (3,), 4e8, 4e8) == (0.0, 0.0, 0.0, 0.0)
    # across hosts the slower inter-host link carries the ring: 2 devices, half the bytes each step
    across = sharding_comm(_net(2, 1), "optimizer", (0, 1), 4e8, 4e8)
    assert across.start_s == pytest.approx(1e-4 + 2e8 / 1e8 + 2 * 4e8 / 1e12)


def test_measured_reduce_scatter_and_all_gather_links_replace_half_an_allreduce_within_a_host() -> None:
    # calibration fits each collective as one pass around the ring: latencies + (R-1)/R of the bytes
    net = replace(_net(), reduce_scatter_collective=LinkSpec(2e8, 1e-3), all_gather_collective=LinkSpec(5e8, 2e-4))
    copy = 2 * 4e8 / 1e12
    scatter, gather = 3 * 1e-3 + 3 * 1e8 / 2e8 + copy, 3 * 2e-4 + 3 * 1e8 / 5e8 + copy
    comms = sharding_comm(net, "parameters", (0, 1, 2, 3), 4e8, 4e8)
    assert comms == pytest.approx((0.0, gather, gather + scatter, 0.0))
    assert sharding_comm(net, "optimizer", (0, 1, 2, 3), 4e8, 4e8) == pytest.approx((gather, 0.0, 0.0, scatter))
    # the unsharded allreduce keeps its own link; across hosts the measured (intra-host) figures do not apply
    assert net.collective_link((0, 1)) == net.intra_host
    across = replace(_net(2, 1), reduce_scatter_collective=LinkSpec(1.0, 1.0), all_gather_collective=LinkSpec(1.0, 1.0))
    assert sharding_comm(across, "optimizer", (0, 1), 4e8, 4e8) == sharding_comm(_net(2, 1), "optimizer", (0, 1),
                                                                                4e8, 4e8)
    assert Cluster.from_json(net.to_json()) == net


def _layers(num_blocks: int, param_bytes: int, seconds: float = 1e-3, saved: float = 1e3) -> CostChain:
    blocks = tuple(Block(f"b{i}", (f"n{i}",), Affine(0.0, seconds), Affine(0.0, 2 * seconds), param_bytes,
                         Affine(0.0, saved)) for i in range(num_blocks))
    return CostChain(blocks, tuple(Affine(0.0, 1e3) for _ in range(num_blocks - 1)), Affine(0, 1e3), Affine(0, 1e2))


def test_a_dp_stage_sharded_per_level_simulates_its_collectives_exactly() -> None:
    """One stage of 2 replicas, M=2, no buckets, on CPU ranks (FSDP2 blocks on gloo: nothing overlaps,
    fxpipe.sim.unit_overlap): every collective adds where the table says."""
    chain = _layers(2, 10**8)
    net = _net(1, 2, name="CPU")
    times = {}
    for level in SHARDING_LEVELS:
        plan = Plan(8, 2, (StagePlan(0, 0, 2, 2, (0, 1), sharding=level),), allreduce_bucket_bytes=0)
        times[level] = simulate(plan, chain, net).iteration_time_s
        assert times[level] == pytest.approx(reference_run(plan, chain, net).iteration_time_s, rel=1e-12)
        assert times[level] == pytest.approx(analytic_iteration_time(plan, chain, net), rel=1e-12)
    half = sharding_comm(net, "optimizer", (0, 1), 2e8, 2e8).start_s
    # one FSDP unit per block: each collective runs per unit, on half the bytes (one more latency each)
    units = sharding_comm(net, "optimizer", (0, 1), 2e8, 2e8, num_units=2).start_s
    assert units == pytest.approx(half + net.intra_host.latency_s)  # two ring steps' latencies, the same bytes
    assert times["optimizer"] - times["none"] == pytest.approx(2 * (units - half))  # RS + AG against one allreduce
    assert times["gradients"] - times["none"] == pytest.approx(3 * units - 2 * half)  # AG + 2 RS (M = 2) - AR
    assert times["parameters"] - times["none"] == pytest.approx(6 * units - 2 * half)  # 2 x (AG + AG + RS) - AR


@pytest.mark.parametrize("first_seed", [0, 100])
def test_simulator_matches_the_reference_on_sharded_plans(first_seed: int) -> None:
    for seed in range(first_seed, first_seed + 60):
        plan, chain, net, options = rich_setup(seed)
        pick = random.Random(seed + 7 * 10**6)
        stages = tuple(replace(stage, sharding=pick.choice(SHARDING_LEVELS) if stage.replicas > 1 else "none")
                       for stage in plan.stages)
        plan = plan.with_updates(stages=stages)
        where = f"seed {seed}: {plan.layout} {[s.sharding for s in stages]} {plan.schedule}, {options}"
        assert_agrees(plan, chain, net, where, **options)


def _dp_case(memory_bytes: float) -> tuple[CostChain, Cluster]:
    """4 blocks of 1e8 parameter bytes on one host of 4 devices with ``memory_bytes`` each; plans are forced
    to one stage of 4 replicas (layout 'dp'), so only the sharding level decides what fits. P = 4e8, M = 4,
    one FSDP unit per block (U = P/4): none 4P, ZeRO-1 2P + 3P/4 = 2.75P, ZeRO-2 P + P + 2U = 2.5P, ZeRO-3
    P + 5U = 2.25P (activations are tiny)."""
    return _layers(4, 10**8), _net(memory_bytes=int(memory_bytes))


@pytest.mark.parametrize("memory_p, expected", [(4.1, "none"), (2.8, "optimizer"), (2.6, "gradients"),
                                                (2.3, "parameters"), (2.2, None)])
def test_auto_takes_no_sharding_when_it_fits_else_the_fastest_level_that_fits(memory_p: float,
                                                                             expected: str | None) -> None:
    chain, net = _dp_case(memory_p * 4e8)
    if expected is None:  # below ZeRO-3's figure nothing fits
        with pytest.raises(InfeasiblePlanError):
            partition(chain, net, 16, layout="dp", sharding="auto", num_microbatches=4)
        return
    plan = partition(chain, net, 16, layout="dp", sharding="auto", num_microbatches=4)
    assert [stage.sharding for stage in plan.stages] == [expected]
    assert plan.stages[0].peak_memory_bytes <= net.device.memory_bytes
    result = simulate(plan, chain, net)
    assert result.iteration_time_s == pytest.approx(plan.predicted.iteration_time_s)  # type: ignore[union-attr]
    assert result.peak_memory_bytes == (plan.stages[0].peak_memory_bytes,)
    if expected != "none":
        with pytest.raises(InfeasiblePlanError, match="sharding='auto'"):
            partition(chain, net, 16, layout="dp", num_microbatches=4)


def test_auto_weighs_sharding_against_recomputation() -> None:
    """Stage 0 of a 2:2 pipeline holds 2 micro-batches in flight. Kept, its activations do not fit; recomputing
    them (+F per micro-batch) or sharding the optimizer state (one reduce-scatter and one all-gather per
    step) both make room: auto takes the faster, sharding, and is no slower than either alone."""
    chain = _layers(4, 10**7, seconds=1e-2, saved=1e6)  # 2 blocks per stage: 8e7 bytes kept for weights (Adam)
    # stage 0: 8e7 + 2 x 1.6e7 kept > 1.05e8; recompute 9.6e7; ZeRO-1 2P + 3P/2 = 7e7, + 3.2e7
    net = _net(memory_bytes=105 * 10**6)
    options = {"layout": "2:2", "num_microbatches": 4, "warmup_policy": "A"}
    with pytest.raises(InfeasiblePlanError):
        partition(chain, net, 64, recompute="never", **options)  # type: ignore[arg-type]
    plan = partition(chain, net, 64, sharding="auto", **options)  # type: ignore[arg-type]
    recomputed = partition(chain, net, 64, **options)  # type: ignore[arg-type]
    sharded = partition(chain, net, 64, sharding="auto", recompute="never", **options)  # type: ignore[arg-type]
    # recompute narrowed to the blocks that make it fit (fxpipe.passes.partition.selective)
    assert "block" in recomputed.stages[0].block_recompute and recomputed.stages[0].sharding == "none"
    assert (plan.stages[0].sharding, plan.stages[0].recompute) == ("optimizer", False)
    assert plan.predicted.iteration_time_s <= min(  # type: ignore[union-attr]
        sharded.predicted.iteration_time_s, recomputed.predicted.iteration_time_s) * (1 + 1e-9)  # type: ignore[union-attr]
    assert plan.predicted.iteration_time_s < recomputed.predicted.iteration_time_s  # type: ignore[union-attr]


def test_auto_is_never_slower_than_the_unsharded_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search ranks by the pivot model, so its best sharded plan can lose to the best unsharded one; a
    planner whose auto search comes out twice as slow gives way to the unsharded plan, with a note."""
    from fxpipe.passes.partition import dapple

    chain, net = _layers(6, 10**7), _net(2, 2)
    real = dapple.PLANNERS["dapple"]

    def poor_search(request: Any) -> Plan:
        plan = real(request)
        if request.sharding != "auto":
            return plan
        slow = replace(plan.predicted, iteration_time_s=2 * plan.predicted.iteration_time_s)  # type: ignore[type-var]
        return plan.with_updates(predicted=slow, stages=tuple(replace(stage, sharding="optimizer") if stage.replicas > 1
                                                              else stage for stage in plan.stages))

    monkeypatch.setitem(dapple.PLANNERS, "dapple", poor_search)
    unsharded = partition(chain, net, 32)
    plan = partition(chain, net, 32, sharding="auto")
    assert plan.with_updates(notes=(), planning_time_s=0.0) == unsharded.with_updates(planning_time_s=0.0)
    assert any("best unsharded plan" in note and "predicted faster" in note for note in plan.notes), plan.notes


def test_none_is_the_default_and_plans_exactly_as_before() -> None:
    chain, net = _layers(6, 10**7), _net(2, 2)
    default = partition(chain, net, 32)
    assert default == partition(chain, net, 32, sharding="none").with_updates(
        planning_time_s=default.planning_time_s)
    assert {stage.sharding for stage in default.stages} == {"none"}


def test_explicit_levels_per_stage_and_their_checks() -> None:
    chain, net = _layers(4, 10**7), _net(2, 2)
    plan = partition(chain, net, 16, layout="2:2", sharding=["parameters", "none"])
    assert [stage.sharding for stage in plan.stages] == ["parameters", "none"]
    assert simulate(plan, chain, net).iteration_time_s == pytest.approx(plan.predicted.iteration_time_s)  # type: ignore[union-attr]
    one = partition(chain, net, 16, layout="2:1", sharding="optimizer")
    assert [stage.sharding for stage in one.stages] == ["optimizer", "none"]  # one replica: nothing to split
    with pytest.raises(PlanningError, match="stage count is the planner's choice"):
        partition(chain, net, 16, sharding=["optimizer", "none"])
    with pytest.raises(PlanningError, match="3 per-stage levels.*2 stages"):
        partition(chain, net, 16, layout="2:2", sharding=["optimizer", "none", "none"])
    with pytest.raises(PlanningError, match="layout stage 1 has 1 replica"):
        partition(chain, net, 16, layout="2:1", sharding=["optimizer", "gradients"])
    with pytest.raises(PlanningError, match="'zero3' is unknown"):
        partition(chain, net, 16, sharding="zero3")


def test_compare_keeps_the_baselines_unsharded() -> None:
    chain, net = _dp_case(2.8 * 4e8)
    plan = partition(chain, net, 16, layout="dp", sharding="auto", compare=True, num_microbatches=4)
    assert plan.stages[0].sharding == "optimizer"
    assert dict(plan.baselines)["dp"].iteration_time_s is None  # plain DP does not fit unsharded


def test_plan_file_round_trip_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", "gpt-mini", "--cluster", "dgx-h100:1", "--global-batch", "16", "--max-blocks", "6",
            "--costs", "analytic", "--layout", "4:4", "--sharding", "optimizer,parameters", "--json", str(out),
            "--no-run-info"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "sharding" in printed and "parameters" in printed  # the stages table's column
    data = json.loads(out.read_text())
    assert [stage["sharding"] for stage in data["stages"]] == ["optimizer", "parameters"]
    plan, chain, cluster = load_plan_file(out)
    assert chain is not None and cluster is not None
    assert [stage.sharding for stage in plan.stages] == ["optimizer", "parameters"]
    result = simulate(plan, chain, cluster)
    assert result.iteration_time_s == pytest.approx(data["predicted"]["iteration_time_s"], rel=1e-9)
    assert list(result.peak_memory_bytes) == data["predicted"]["peak_memory_bytes"]


def test_cli_rejects_an_unknown_level(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "gpt-mini", "--cluster", "dgx-h100:1", "--global-batch", "16", "--costs", "analytic",
                 "--sharding", "zero9"])
    assert code == 2
    assert "--sharding 'zero9'" in capsys.readouterr().err


class _Marked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin0, self.lin1 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.lin0(x))
        pipe_split()
        return self.lin1(x)


def test_plan_markers_takes_levels_per_marked_stage() -> None:
    inputs = (torch.ones(4, 8),)
    cluster = parse_cluster("dgx-h100:1")
    plan, _ = plan_markers(_Marked(), inputs, cluster, 32, sharding=["gradients", "parameters"])
    assert plan.num_stages == 2
    assert [s.sharding for s in plan.stages] == [level if s.replicas > 1 else "none"
                                                 for s, level in zip(plan.stages, ("gradients", "parameters"),
                                                                     strict=True)]
    with pytest.raises(PlanningError, match="3 per-stage levels.*2 stages"):
        plan_markers(_Marked(), inputs, cluster, 32, sharding=["none", "none", "none"])


def test_zero_bubble_plans_shard_with_zero1_and_zero2_but_never_zero3() -> None:
    """Zero-bubble runs ZeRO-1/2 (FSDP2 reduces after W) but not ZeRO-3 (a later forward would free the weights a
    pending W needs): where ZeRO-1 fits, a zero-bubble plan takes it; ZeRO-2 asked for runs with its reduce-scatters
    in W (simulator, reference simulator and pivot model agree); an explicit 'parameters' with zero_bubble is
    refused, and schedule='auto' then leaves zero-bubble out."""
    for memory_p, sharding, expected in ((2.8, "auto", "optimizer"), (4.1, "gradients", "gradients")):
        chain, net = _dp_case(memory_p * 4e8)
        plan = partition(chain, net, 16, layout="dp", sharding=sharding, num_microbatches=4, schedule="zero_bubble")
        assert plan.schedule == "zero_bubble" and [stage.sharding for stage in plan.stages] == [expected]
        simulated = simulate(plan, chain, net).iteration_time_s
        assert simulated == pytest.approx(plan.predicted.iteration_time_s)  # type: ignore[union-attr]
        assert simulated == pytest.approx(reference_run(plan, chain, net).iteration_time_s, rel=1e-12)
        assert simulated == pytest.approx(analytic_iteration_time(plan, chain, net), rel=1e-9)
    chain, net = _dp_case(2.4 * 4e8)  # below ZeRO-2's figure (2.5P): only ZeRO-3 (2.25P) would fit
    with pytest.raises(InfeasiblePlanError):
        partition(chain, net, 16, layout="dp", sharding="auto", num_microbatches=4, schedule="zero_bubble")
    chain, net = _dp_case(4.1 * 4e8)
    with pytest.raises(PlanningError, match="schedule='zero_bubble'.*ZeRO-3.*'gradients' or 'optimizer'"):
        partition(chain, net, 16, layout="dp", sharding="parameters", num_microbatches=4, schedule="zero_bubble")
    plan = partition(chain, net, 16, layout="dp", sharding="parameters", num_microbatches=4, schedule="auto")
    assert plan.schedule != "zero_bubble" and [stage.sharding for stage in plan.stages] == ["parameters"]


def test_zero2_reduce_scatter_under_split_backward_follows_w() -> None:
    """2 stages, the second of 2 ZeRO-2 replicas, zero-bubble: its per-micro-batch reduce-scatter is charged in W,
    after the gradient left for stage 0 (as the runtime runs it), not in B on the gradient's path."""
    chain = _layers(4, 10**8)
    net = _net(1, 3)
    stages = (StagePlan(0, 0, 2, 1, (0,)), StagePlan(1, 2, 4, 2, (1, 2), sharding="gradients"))
    plan = Plan(12, 4, stages, schedule="zero_bubble", allreduce_bucket_bytes=0)
    simulated = simulate(plan, chain, net)
    assert simulated.iteration_time_s == pytest.approx(reference_run(plan, chain, net).iteration_time_s, rel=1e-12)
    unsharded = simulate(plan.with_updates(stages=(stages[0], replace(stages[1], sharding="none"))), chain, net)
    scatter = sharding_comm(net, "gradients", (1, 2), 2e8, 2e8, num_units=2).backward_s  # one unit per block

    def durations(result: Any, op: str) -> list[float]:
        return [event.end_s - event.start_s for event in result.events if event.stage_index == 1 and event.op == op]

    assert scatter > 0 and len(durations(simulated, "W")) == 2 * 4  # 2 replicas x M
    assert durations(simulated, "B") == pytest.approx(durations(unsharded, "B"), rel=1e-12)
    assert durations(simulated, "W") == pytest.approx([w + scatter for w in durations(unsharded, "W")], rel=1e-12)
