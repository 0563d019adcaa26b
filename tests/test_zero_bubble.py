"""Zero-bubble (split backward): schedule tables and memory, simulator and pivot model, planner choice, exact B/W."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from planner_cases import chain, cluster
from test_schedule import normalized, parse, table
from test_simulate import cluster as sim_cluster
from test_simulate import plan_of, uniform_chain

from fxpipe.core.schedule import (
    Action,
    Op,
    ScheduleError,
    early_backward,
    inflight_peak,
    lower,
    make_schedule,
    validate_schedule,
    zero_bubble,
)
from fxpipe.passes.partition.dapple import partition
from fxpipe.passes.partition.latency import analytic_iteration_time, pipeline_latency
from fxpipe.runtime.autograd.split_backward import backward_inputs, backward_weights
from fxpipe.sim.simulate import simulate
from fxpipe.sim.stagecost import split_backward_times, step_end_sync_time


def test_zero_bubble_table_three_stages() -> None:
    assert normalized(zero_bubble(3, 5, "A")) == table("""
        zero_bubble_A    0    1    2    3    4    5    6    7    8    9    10    11    12    13    14
        stage 0          F0   F1   F2   B0   W0   F3   B1   W1   F4   B2   B3    W2    B4    W3    W4
        stage 1          F0   F1   B0   W0   F2   B1   W1   F3   B2   W2   F4    B3    B4    W3    W4
        stage 2          F0   B0   W0   F1   B1   W1   F2   B2   W2   F3   B3    W3    F4    B4    W4
    """)


@pytest.mark.parametrize("policy", ["A", "B"])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(1, 1), (2, 2), (3, 5), (4, 8), (4, 16), (5, 3)])
def test_zero_bubble_is_valid_and_holds_what_early_backward_holds(num_stages: int, num_microbatches: int,
                                                                  policy: str) -> None:
    zb = zero_bubble(num_stages, num_microbatches, policy)
    validate_schedule(zb)
    eb = early_backward(num_stages, num_microbatches, policy)
    assert zb.split_backward and not eb.split_backward
    assert [inflight_peak(zb, s) for s in range(num_stages)] == [inflight_peak(eb, s) for s in range(num_stages)]
    for stage_index in range(num_stages):  # same F and B order as early backward, W added
        assert [a for a in zb.per_stage[stage_index] if a.op is not Op.WEIGHT] == list(eb.per_stage[stage_index])


def test_lowering_puts_w_without_transfers_and_the_allreduce_after_the_last_w() -> None:
    lowered = lower(zero_bubble(2, 2))
    assert [str(a) for a in lowered[0]] == ["F0", "SA0", "F1", "SA1", "RG0", "B0", "RG1", "B1", "W0", "W1", "AR"]
    assert [str(a) for a in lowered[1]] == ["RA0", "F0", "B0", "SG0", "W0", "RA1", "F1", "B1", "SG1", "W1", "AR"]


@pytest.mark.parametrize(("rows", "message"), [
    ("F0 B0 W0 F1 B1\nF0 B0 W0 F1 B1 W1", "W of micro-batches \\[1\\] never runs"),
    ("F0 W0 B0 F1 B1 W1\nF0 B0 W0 F1 B1 W1", "runs W0 before B0"),
    ("F0 B0 W0 W0 F1 B1 W1\nF0 B0 W0 F1 B1 W1", "repeats W0"),
])
def test_validator_names_bad_weight_actions(rows: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(parse("bad", rows, 2))


def test_a_schedule_holds_w_for_every_stage_or_none() -> None:
    schedule = parse("half", "F0 B0 W0\nF0 B0", 1)
    with pytest.raises(ScheduleError, match="stage 1: W of micro-batches \\[0\\] never runs"):
        validate_schedule(schedule)
    assert make_schedule("zb", 2, 3).name == "zero_bubble_A"
    assert Action(Op.WEIGHT, 3).__str__() == "W3"


@pytest.mark.parametrize("num_microbatches", [8, 16])
def test_simulated_bubble_is_lower_than_early_backward_at_s4(num_microbatches: int) -> None:
    # Backward is twice forward and split evenly, so F = B = W = 1/8 s per micro-batch of 8 rows.
    chain_ = uniform_chain(4, param_bytes=0)
    results = {name: simulate(plan_of((1, 1, 1, 1), 1, 8, num_microbatches, name), chain_, sim_cluster())
               for name in ("early_backward", "zero_bubble")}
    eb, zb = results["early_backward"], results["zero_bubble"]
    unit = 2.0**-3
    # closed forms: early backward (M + S - 1)(F + B + W); zero-bubble M (F + B + W) + (S - 1)(F + B); then
    # the loss allreduce ending the step
    sync = step_end_sync_time(sim_cluster(), range(4))
    assert eb.iteration_time_s == (num_microbatches + 3) * 3 * unit + sync
    assert zb.iteration_time_s == num_microbatches * 3 * unit + 3 * 2 * unit + sync
    assert zb.bubble_fraction < eb.bubble_fraction
    assert zb.inflight_microbatches == eb.inflight_microbatches == (4, 3, 2, 1)
    assert zb.peak_memory_bytes == eb.peak_memory_bytes
    weights = [e for e in zb.events if e.op == "W"]
    assert len(weights) == 4 * num_microbatches
    assert {e.end_s - e.start_s for e in weights if e.stage_index > 0} == {unit}
    assert {e.end_s - e.start_s for e in weights if e.stage_index == 0} == {0.0}  # its whole backward is in B


def test_weight_fraction_is_configurable_and_checked() -> None:
    chain_ = uniform_chain(2, param_bytes=0)
    plan = plan_of((1, 1), 1, 8, 4, "zero_bubble")
    assert split_backward_times(1.0, 1, 0.25) == (0.75, 0.25)
    assert split_backward_times(1.0, 0, 0.25) == (1.0, 0.0)
    eb = simulate(plan_of((1, 1), 1, 8, 4), chain_, sim_cluster())
    # with no W at all, zero-bubble is early backward
    assert simulate(plan, chain_, sim_cluster(), weight_fraction=0.0).iteration_time_s == eb.iteration_time_s
    assert simulate(plan, chain_, sim_cluster(), weight_fraction=0.5).iteration_time_s < eb.iteration_time_s
    with pytest.raises(ValueError, match="weight_fraction must be in"):
        simulate(plan, chain_, sim_cluster(), weight_fraction=1.5)


@pytest.mark.parametrize("num_microbatches", [4, 8])
def test_pivot_model_is_exact_for_equal_stages(num_microbatches: int) -> None:
    chain_ = uniform_chain(4, param_bytes=0)
    plan = plan_of((1, 1, 1, 1), 1, 8, num_microbatches, "zero_bubble")
    assert analytic_iteration_time(plan, chain_, sim_cluster()) == simulate(plan, chain_, sim_cluster()).iteration_time_s
    # without W the formula is DAPPLE's
    assert pipeline_latency([1.0] * 3, [2.0] * 3, [0.0] * 3, 4, (), [0.0] * 3) == pipeline_latency(
        [1.0] * 3, [2.0] * 3, [0.0] * 3, 4)


@pytest.fixture
def no_switch_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The choice mechanics alone: under auto, any strictly faster schedule replaces early backward."""
    from fxpipe.passes.partition import scoring

    monkeypatch.setattr(scoring, "AUTO_SWITCH_MARGIN", 0.0)


def test_auto_keeps_early_backward_unless_another_schedule_is_clearly_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpipe.passes.partition import scoring
    from fxpipe.passes.partition.request import AUTO_SWITCH_MARGIN

    heavy = chain([1.0, 1.0], [10**9, 10**9])
    net = cluster(1, 2, intra=1e9)
    times = {name: partition(heavy, net, 8, schedule=name).predicted for name in ("early_backward", "zero_bubble")}
    assert times["early_backward"] is not None and times["zero_bubble"] is not None
    gain = 1 - times["zero_bubble"].iteration_time_s / times["early_backward"].iteration_time_s
    assert 0 < gain < AUTO_SWITCH_MARGIN  # zero-bubble predicted faster, but within the model's error
    assert partition(heavy, net, 8, schedule="auto").schedule == "early_backward"
    monkeypatch.setattr(scoring, "AUTO_SWITCH_MARGIN", gain / 2)
    assert partition(heavy, net, 8, schedule="auto").schedule == "zero_bubble"


def test_planner_picks_zero_bubble_when_predicted_faster_and_keeps_early_backward_otherwise(no_switch_margin: None) -> None:
    # heavy weights on a slow link make a 1:1 pipeline; its second stage has W to defer
    heavy = chain([1.0, 1.0], [10**9, 10**9])
    net = cluster(1, 2, intra=1e9)
    auto = partition(heavy, net, 8, schedule="auto")
    eb = partition(heavy, net, 8, schedule="early_backward")
    assert auto.layout == eb.layout == "1:1"
    assert auto.schedule == "zero_bubble" and eb.schedule == "early_backward"
    assert auto.predicted is not None and eb.predicted is not None
    assert auto.predicted.iteration_time_s < eb.predicted.iteration_time_s
    assert auto.to_json_dict()["schedule"] == "zero_bubble"
    # plain data parallelism has nothing to overlap: the default schedule stays
    dp = partition(chain([1.0, 1.0], [0, 0]), cluster(1, 2), 8, schedule="auto")
    assert dp.layout == "dp" and dp.schedule == "early_backward"
    # the baselines keep early backward
    compared = partition(heavy, net, 8, compare=True, schedule="auto")
    assert compared.schedule == "zero_bubble" and compared.baselines


def test_split_overhead_stretches_b_and_w_alike_in_the_simulator_and_the_pivot_model() -> None:
    # F = 1/8 s and backward = 2/8 s per micro-batch of 8 rows; splitting costs half the backward again
    # on stage 1 (B = W = 1.5/8 s); stage 0 runs its fused backward (2/8 s) in B, untouched.
    unit, num_microbatches = 2.0**-3, 4
    chain_ = uniform_chain(2, param_bytes=0)
    costly = replace(sim_cluster(), split_backward_overhead=0.5)
    plan = plan_of((1, 1), 1, 8, num_microbatches, "zero_bubble")
    assert split_backward_times(2 * unit, 1, 0.5, 0.5) == (1.5 * unit, 1.5 * unit)
    assert split_backward_times(2 * unit, 0, 0.5, 0.5) == (2 * unit, 0.0)
    result = simulate(plan, chain_, costly)
    # stage 1 never waits after its first F: 1 + M (F + B + W), then stage 0's last B after stage 1's last B
    sync = step_end_sync_time(costly, [0, 1])  # the loss allreduce ending the step
    assert result.iteration_time_s == (1 + num_microbatches * 4 - 1.5 + 2) * unit + sync
    assert {e.end_s - e.start_s for e in result.events if e.stage_index == 1 and e.op in ("B", "W")} == {1.5 * unit}
    assert analytic_iteration_time(plan, chain_, costly) == result.iteration_time_s
    # without the overhead zero-bubble beats early backward ((M + S - 1)(F + B)); with it, it loses
    eb_plan = plan_of((1, 1), 1, 8, num_microbatches)
    early = simulate(eb_plan, chain_, costly).iteration_time_s
    assert early == simulate(eb_plan, chain_, sim_cluster()).iteration_time_s == 5 * 3 * unit + sync
    assert simulate(plan, chain_, sim_cluster()).iteration_time_s == 14 * unit + sync < early < result.iteration_time_s
    with pytest.raises(ValueError, match="split backward overhead must be >= 0"):
        split_backward_times(1.0, 1, 0.5, -0.1)
    with pytest.raises(ValueError, match="split_backward_overhead must be >= 0"):
        replace(sim_cluster(), split_backward_overhead=-1.0)


def test_buckets_overlap_the_last_backward_or_the_last_w() -> None:
    chain_ = uniform_chain(4)  # two blocks per stage: a bucket per block, the first ready halfway through backward
    for schedule in ("early_backward", "zero_bubble"):
        plan = plan_of((2, 2), 2, 8, 4, schedule).with_updates(allreduce_bucket_bytes=2**10)
        result = simulate(plan, chain_, sim_cluster())
        for stage_index in range(2):
            last = max(e.end_s for e in result.events if e.stage_index == stage_index and e.op != "AR")
            started = result.allreduce_start_s[stage_index]
            # the first bucket launches inside the last backward, or under split backward inside the last W;
            # stage 0's W is empty (its B ran the whole backward): its buckets start as that W ends
            if schedule == "zero_bubble" and stage_index == 0:
                assert started == last
            else:
                assert started < last
        if schedule == "zero_bubble":  # stage 1's first bucket (its last block) is full halfway through its W
            last_w = max((e for e in result.events if e.stage_index == 1 and e.op == "W"), key=lambda e: e.end_s)
            assert result.allreduce_start_s[1] == pytest.approx((last_w.start_s + last_w.end_s) / 2)
        assert analytic_iteration_time(plan, chain_, sim_cluster()) == pytest.approx(result.iteration_time_s,
                                                                                     rel=0.05)


def test_split_overhead_turns_auto_to_early_backward(no_switch_margin: None) -> None:
    heavy = chain([1.0, 1.0], [10**9, 10**9])
    free, costly = cluster(1, 2, intra=1e9), replace(cluster(1, 2, intra=1e9), split_backward_overhead=1.0)
    assert partition(heavy, free, 8, schedule="auto").schedule == "zero_bubble"
    auto = partition(heavy, costly, 8, schedule="auto")
    zb = partition(heavy, costly, 8, schedule="zero_bubble", layout=auto.layout,
                   num_microbatches=auto.num_microbatches)
    assert auto.schedule == "early_backward"
    assert auto.predicted is not None and zb.predicted is not None
    assert zb.predicted.iteration_time_s > auto.predicted.iteration_time_s
    # the pivot model, the simulator and the plan's prediction charge the same overhead
    assert zb.predicted.analytic_iteration_time_s == analytic_iteration_time(zb, heavy, costly)
    assert analytic_iteration_time(zb, heavy, costly) > analytic_iteration_time(zb, heavy, free)
    assert zb.predicted.iteration_time_s == simulate(zb, heavy, costly).iteration_time_s


@pytest.mark.parametrize(("layout", "expected"), [("2:1", "zero_bubble"), ("2:1:1", "zero_bubble"),
                                                ("3:1", "zero_bubble"), ("1:2", "gpipe")])
def test_planner_picks_the_fastest_schedule_with_any_replica_counts(layout: str, expected: str,
                                                                  no_switch_margin: None) -> None:
    # 1:2: GPipe's last stage runs all its backwards early, so its 2-replica allreduce overlaps stage 0
    heavy = chain([1.0, 1.0, 1.0], [10**8, 10**8, 10**8], cut_bytes_per_row=1.0)
    net = cluster(1, 4, intra=1e9)
    auto = partition(heavy, net, 24, layout=layout, num_microbatches=6, schedule="auto")
    forced = {name: partition(heavy, net, 24, layout=layout, num_microbatches=6, schedule=name)
              for name in ("early_backward", "zero_bubble", "gpipe")}
    assert auto.layout == layout and auto.schedule == expected
    times = {name: plan.predicted.iteration_time_s for name, plan in forced.items() if plan.predicted is not None}
    assert auto.predicted is not None and auto.predicted.iteration_time_s == min(times.values()) == times[expected]
    assert times[expected] < times["early_backward"]
    # zero-bubble's memory is early backward's for the same cuts and warm-up policy
    zb = forced["zero_bubble"]
    eb = partition(heavy, net, 24, layout=layout, num_microbatches=6, schedule="early_backward",
                   warmup_policy=zb.warmup_policy)
    assert [(st.first_block, st.stop_block) for st in eb.stages] == [(st.first_block, st.stop_block)
                                                                    for st in zb.stages]
    assert [st.peak_memory_bytes for st in zb.stages] == [st.peak_memory_bytes for st in eb.stages]


class _Block(torch.nn.Module):
    """A stage with a skip path, a parameter used twice and one used off the input's path."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(6, 6)
        self.second = torch.nn.Linear(6, 6)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.first(x)) + x
        return self.second(hidden) * self.scale + self.first(hidden)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


def test_split_backward_equals_one_backward_and_really_defers_w() -> None:
    torch.manual_seed(0)
    reference = _Block()
    split = copy.deepcopy(reference)
    params = list(split.parameters())
    for microbatch_index in range(2):  # the second accumulates into .grad, as a step's micro-batches do
        x, grad_out = torch.randn(5, 6), torch.randn(5, 6)
        leaf = x.clone().requires_grad_(True)
        reference(leaf).backward(grad_out)
        split_leaf = x.clone().requires_grad_(True)
        input_grads, work = backward_inputs([split(split_leaf)], [grad_out], [split_leaf], params)
        assert work is not None
        if microbatch_index == 0:
            # B computed only the group of vectors alone (the scalar scale); the linears' weights and biases wait for W
            assert [name for name, p in split.named_parameters() if p.grad is not None] == ["scale"]
            torch.testing.assert_close(split.scale.grad, reference.scale.grad, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(input_grads[0], leaf.grad, rtol=1e-6, atol=1e-7)
        backward_weights(work)
    expected = _grads(reference)
    assert _grads(split).keys() == expected.keys()
    for name, grad in _grads(split).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7)


def test_split_backward_without_inputs_runs_whole_backward_in_b() -> None:
    torch.manual_seed(0)
    module = _Block()
    loss = module(torch.randn(3, 6)).sum()
    input_grads, work = backward_inputs([loss], [None], [], list(module.parameters()))
    assert input_grads == [] and work is None
    assert all(p.grad is not None for p in module.parameters())


def test_split_backward_falls_back_when_a_parameter_misses_the_input_path() -> None:
    # ``bias`` reaches its own output without meeting the input's path: no captured gradient could
    # give its W, so the whole backward runs in B (exact) rather than losing its gradient.
    bias = torch.nn.Parameter(torch.tensor(2.0))
    weight = torch.nn.Parameter(torch.tensor(3.0))
    x = torch.tensor(4.0, requires_grad=True)
    outputs = [x * weight, bias.exp()]
    input_grads, work = backward_inputs(outputs, [torch.tensor(1.0), torch.tensor(1.0)], [x], [weight, bias])
    assert work is None
    assert input_grads[0] == pytest.approx(3.0)
    assert weight.grad is not None and weight.grad.item() == pytest.approx(4.0)
    assert bias.grad is not None and bias.grad.item() == pytest.approx(torch.tensor(2.0).exp().item())
