"""Tests for measure_costs: default blocks, affine fits, purity, and use by to_cost_graph."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from fxpipe.passes import profile
from fxpipe.passes.costs import annotate_costs, to_cost_graph
from fxpipe.passes.profile import ProfileError, default_blocks, fit_times, measure_costs

torch.set_num_threads(1)


def _model() -> tuple[fx.GraphModule, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))
    gm = fx.symbolic_trace(model)
    inputs = (torch.randn(4, 512),)
    gm.meta["fxpipe.example_inputs"] = inputs
    return gm, inputs


def test_default_blocks_follow_layer_paths() -> None:
    gm, _ = _model()
    assert default_blocks(gm) == [("_0",), ("_1",), ("_2",)]


def test_measured_costs_are_fitted_and_leave_the_graph_unchanged() -> None:
    gm, inputs = _model()
    measured = measure_costs(gm, inputs, batch_sizes=(16, 64), warmup=1, repeats=3)
    assert [block.name for block in measured.blocks] == ["0", "1", "2"]
    assert measured.batch_sizes == (16, 64)
    assert all(p.grad is None for p in gm.parameters())
    big, relu, _ = measured.blocks
    assert big.forward_s.at(64) > relu.forward_s.at(64)  # 2 x 512 x 512 FLOPs per row vs one max
    assert big.backward_s.at(64) > 0
    for block in measured.blocks:
        for time in (block.forward_s, block.backward_s):
            assert time.fixed >= 0 and time.per_sample >= 0


def test_to_cost_graph_spreads_block_time_over_nodes() -> None:
    gm, inputs = _model()
    blocks = [("_0", "_1"), ("_2",)]
    measured = measure_costs(gm, inputs, blocks=blocks, batch_sizes=(4, 8), warmup=0, repeats=1)
    graph = to_cost_graph(annotate_costs(gm), measured=measured)
    by_name = graph.by_name()
    first = measured.blocks[0]
    total = by_name["_0"].forward_s + by_name["_1"].forward_s
    assert total.fixed == pytest.approx(first.forward_s.fixed) and total.per_sample == pytest.approx(
        first.forward_s.per_sample
    )
    # the Linear does 2 x 512 x 512 FLOPs per row, the ReLU 512: the Linear gets almost all the time
    assert by_name["_0"].forward_s.per_sample >= 0.99 * first.forward_s.per_sample
    with pytest.raises(ValueError, match="measure_costs"):
        to_cost_graph(annotate_costs(gm), measured=measure_costs(gm, inputs, blocks=[("_0",)], repeats=1))


def test_bad_arguments_say_what_to_pass() -> None:
    gm, inputs = _model()
    with pytest.raises(ProfileError, match="batch_sizes"):
        measure_costs(gm, inputs, batch_sizes=(4, 4))
    with pytest.raises(ProfileError, match="default_blocks"):
        measure_costs(gm, inputs, blocks=[("nope",)])


def test_fit_is_exact_on_a_line_and_non_negative_on_noise() -> None:
    for fitted in (fit_times((2, 8), 0.3, 0.9), fit_times((8, 2), 0.9, 0.3)):
        assert fitted.fixed == pytest.approx(0.1) and fitted.per_sample == pytest.approx(0.1)
    noisy = fit_times((2, 8), 0.5, 0.4)
    assert noisy.per_sample == 0 and noisy.fixed == pytest.approx(0.45)
    assert fit_times((2, 8), 0.1, 0.8).fixed == 0


def test_measured_costs_name_the_inputs_device() -> None:
    gm, inputs = _model()
    measured = measure_costs(gm, inputs, blocks=[("_0", "_1", "_2")], batch_sizes=(2, 4), warmup=0, repeats=1)
    assert measured.device == "cpu"
    assert profile.device_of(gm, inputs) == torch.device("cpu")
    assert profile.device_of(gm, [1.5]) == torch.device("cpu")  # no tensor argument: the parameters' device


def _recorded_synchronize(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    calls: list[object] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    return calls


def test_cuda_timing_synchronizes_around_every_timed_region(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recorded_synchronize(monkeypatch)
    gm, inputs = _model()
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(profile, "device_of", lambda module, args: cuda)
    forward_s, backward_s = profile.run_once(gm, inputs)
    assert calls == [cuda] * 4  # before and after the forward, before and after the backward
    assert forward_s > 0 and backward_s > 0
    profile.synchronizer(torch.device("cpu"))()
    assert len(calls) == 4  # CPU runs never synchronize


def test_cpu_timing_never_touches_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _recorded_synchronize(monkeypatch)
    gm, inputs = _model()
    profile.time_module(gm, inputs, warmup=0, repeats=1)
    assert calls == []
