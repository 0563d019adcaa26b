"""FSDP units per block: which parameters each unit holds in fx and export graphs (HF Llama, gpt-mini), the stage
graph cut into unit calls computing what it did, and sharded stages of several blocks training exactly on 3 gloo
ranks (2:1 with ZeRO-3 per block, also keeping the weights from forward to backward, and 1:2 with ZeRO-2)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import fx, nn

import fxpipe
from fxpipe import models as zoo
from fxpipe.core.plan import Plan, PlanError
from fxpipe.passes import trace
from fxpipe.runtime.parallel.fsdp_units import unit_paths, unit_program, unit_spans
from tests.exactness_oracle import train_reference
from tests.mp_utils import plan_from_cuts, run_ranks
from tests.test_sharded_stages import (
    GLOBAL_BATCH,
    MODEL,
    NUM_MICROBATCHES,
    _batches,
    _clipped,
    _count_fsdp_collectives,
    _train,
    _world,
)

hf_examples = pytest.importorskip("fxpipe.hf_examples")
OVERRIDES = {**zoo.get(MODEL).tiny_overrides, "n_layer": 4}  # four blocks: two or more per stage


def _outputs(result: Any) -> list[torch.Tensor]:
    values = result.values() if isinstance(result, dict) else result if isinstance(result, (tuple, list)) else [result]
    return [value for value in values if isinstance(value, torch.Tensor)]


def _check_units(gm: fx.GraphModule, inputs: tuple[Any, ...], expected: list[str]) -> None:
    """The units are ``expected``; each holds exactly its block's parameters (the same objects); the cut graph
    computes what ``gm`` does, bit for bit, gradients too, and leaves ``gm``'s parameter names as they were."""
    names_before = [name for name, _ in gm.named_parameters()]
    assert unit_paths(gm) == expected
    program, units = unit_program(gm, unit_spans(gm))
    assert [name for name, _ in gm.named_parameters()] == names_before
    owned = {name: param for name, param in gm.named_parameters()}
    for path, unit in zip(expected, units, strict=True):
        mine = {id(param) for name, param in owned.items() if name.startswith(path + ".")}
        assert {id(param) for param in unit.parameters()} == mine and mine
        assert unit.block is gm.get_submodule(path)  # the block itself: FSDP2's swaps reach the stage's names
    calls = [node.target for node in program.graph.nodes if node.op == "call_module" and str(node.target).startswith("fsdp_unit_")]
    assert calls == [f"fsdp_unit_{index}" for index in range(len(expected))]
    expected_out, found_out = _outputs(gm(*inputs)), _outputs(program(*inputs))
    assert len(expected_out) == len(found_out) > 0
    assert all(torch.equal(a, b) for a, b in zip(expected_out, found_out, strict=True))
    grads = []
    for module in (gm, program):
        module.zero_grad(set_to_none=True)
        sum(value.float().sum() for value in _outputs(module(*inputs)) if value.is_floating_point()).backward()
        grads.append({name: param.grad.clone() for name, param in gm.named_parameters() if param.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_hf_llama_units_are_its_decoder_layers_in_the_export_graph() -> None:
    model, inputs = hf_examples.llama(num_layers=3)
    gm = trace(model, inputs, frontend="export")
    assert all(node.op != "call_module" for node in gm.graph.nodes)  # every weight is read through get_attr
    example = tuple(gm.meta["fxpipe.example_inputs"])
    _check_units(gm, example, ["model.layers.0", "model.layers.1", "model.layers.2"])


@pytest.mark.parametrize("frontend", ["fx", "export"])
def test_gpt_units_are_its_blocks_in_both_front_ends(frontend: str) -> None:
    model, inputs = zoo.build(MODEL, **OVERRIDES)
    gm = trace(model, inputs, frontend=frontend)
    _check_units(gm, tuple(gm.meta["fxpipe.example_inputs"]), ["h.0", "h.1", "h.2", "h.3"])


class _Reused(nn.Module):
    """Block 0's weight is read again after block 1 ran: the stretches overlap, so neither is a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layers[1](self.layers[0](x))
        return self.layers[2](y + self.layers[0].weight.sum())


def test_blocks_whose_reads_interleave_stay_with_the_root() -> None:
    gm = fx.symbolic_trace(_Reused())
    assert unit_paths(gm) == ["layers.2"]
    x = torch.randn(2, 4)
    program, _ = unit_program(gm, unit_spans(gm))
    assert torch.equal(program(x), gm(x))


def test_reshard_after_forward_is_a_zero3_stage_choice_in_plan_json() -> None:
    model, inputs = zoo.build(MODEL, **OVERRIDES)
    plan = plan_from_cuts(trace(model, inputs), (2, 1), GLOBAL_BATCH, NUM_MICROBATCHES)
    kept = plan.with_updates(stages=(replace(plan.stages[0], sharding="parameters", reshard_after_forward=False),
                                     plan.stages[1]))
    text = kept.to_json()
    assert '"reshard_after_forward": false' in text and text.count("reshard_after_forward") == 1
    assert Plan.from_json(text) == kept
    assert "reshard_after_forward" not in plan.to_json()  # absent: the level's default, plans keep their bytes
    with pytest.raises(PlanError, match="reshard_after_forward=False at sharding 'gradients'.*'parameters'"):
        Plan.from_json(text.replace('"parameters"', '"gradients"'))


# (name, replicas, level, reshard_after_forward)
CASES = (("parameters 2:1", (2, 1), "parameters", None), ("parameters kept 2:1", (2, 1), "parameters", False),
         ("gradients 1:2", (1, 2), "gradients", None))


def _compile(replicas: tuple[int, ...], level: str, reshard: bool | None) -> Any:
    model, example_inputs = zoo.build(MODEL, **OVERRIDES)
    plan = plan_from_cuts(trace(copy.deepcopy(model), example_inputs), replicas, GLOBAL_BATCH, NUM_MICROBATCHES)
    stages = tuple(replace(stage, sharding=level, reshard_after_forward=reshard) if stage.replicas > 1 else stage
                   for stage in plan.stages)
    return fxpipe.compile(model, example_inputs, loss_fn=zoo.get(MODEL).loss_fn, global_batch_size=GLOBAL_BATCH,
                          plan=plan.with_updates(stages=stages), schedule="dapple", sync_params="broadcast")


def _run(rank: int, world_size: int, store_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    reference = train_reference(zoo.build(MODEL, **OVERRIDES)[0], zoo.get(MODEL).loss_fn, _batches(),
                                after_backward=_clipped)
    _count_fsdp_collectives()
    results = {}
    for index, (name, replicas, level, reshard) in enumerate(CASES):
        with _world(store_dir, f"units-{index}", rank, world_size):
            pipe = _compile(replicas, level, reshard)
            record = _train(pipe, reference, MODEL)
            sharded = pipe.driver.sharded
            results[name] = {"problems": record["problems"], "collectives": record["collectives"],
                             "units": sharded.num_units if sharded else 0,
                             "blocks": len(sharded.units) if sharded else 0}
    return results


@pytest.mark.multiprocess
def test_sharded_stages_of_several_blocks_train_exactly_per_unit(tmp_path: Path) -> None:
    """Every rank's gradients (3 steps, clipped) and weights match one process; a sharded stage has two or more
    block units; FSDP2's collectives per unit per step are the level's (M = 3): ZeRO-3 2M all-gathers and M
    reduce-scatters, fewer all-gathers when it keeps the forward's weights, ZeRO-2 one and M."""
    failures = []
    for rank, results in enumerate(run_ranks(_run, 3, tmp_path)):
        for name, replicas, level, reshard in CASES:
            record = results[name]
            failures += [f"{name} rank {rank}: {p}" for p in record["problems"][:3]]
            sharded = (rank < 2) if replicas == (2, 1) else (rank >= 1)
            gathers, scatters = record["collectives"]
            if not sharded:
                if record["units"] or (gathers, scatters) != (0, 0):
                    failures.append(f"{name} rank {rank}: unsharded rank ran {record}")
                continue
            if record["blocks"] < 2:
                failures.append(f"{name} rank {rank}: {record['blocks']} block units, want 2 or more")
            want_gathers = {"gradients": (1, 1), "parameters": (2 * NUM_MICROBATCHES, 2 * NUM_MICROBATCHES)}[level]
            if reshard is False:  # gathered in forward, freed by a backward: 1F1B regathers for some backwards
                want_gathers = (NUM_MICROBATCHES, 2 * NUM_MICROBATCHES - 1)
            if not (want_gathers[0] <= gathers <= want_gathers[1] and scatters == NUM_MICROBATCHES):
                failures.append(f"{name} rank {rank}: (all-gathers, reduce-scatters) per unit per step "
                                f"{(gathers, scatters)}, want all-gathers in {want_gathers} and {NUM_MICROBATCHES}")
    assert not failures, "\n".join(failures)
