"""Values saved on both sides of a cut: the fake run's re-saves, the chain's per-block entries, and the bytes a
stage ``[first, stop)`` adds for the received copies it saves again (each storage once per stage)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from torch import fx, nn

from fxpipe.core.block_sums import block_sums
from fxpipe.core.chain import Block, CostChain, build_chain
from fxpipe.core.costgraph import Affine, CostGraph, CostGraphError, CostNode
from fxpipe.core.meta import COST
from fxpipe.core.planfile import chain_from_json, chain_to_json
from fxpipe.passes.costs import BATCH, annotate_costs, to_cost_graph
from fxpipe.passes.partition.block_partition import coarsen_chain
from fxpipe.passes.tracing import trace
from fxpipe.sim.stagecost import activation_peak_bytes, resaved_bytes, stage_cost, stage_memory_bytes

torch.set_num_threads(1)

RELU_OUT = 32 * 4  # bytes per row of the ReLU's output (32 float32 features)


def _linear_relu_linear() -> tuple[fx.GraphModule, CostChain]:
    """Linear(16, 32) -> ReLU -> Linear(32, 8), one block per node (no loss costed: the estimate's log-softmax
    of the 8 outputs is the last block's own)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    annotated = annotate_costs(trace(model, (torch.randn(4, 16),)))
    return annotated, build_chain(to_cost_graph(annotated), max_blocks=None)


def test_the_relu_output_the_second_linear_saves_again_is_a_resave_of_the_relu() -> None:
    annotated, _ = _linear_relu_linear()
    costs = {node.name: node.meta[COST] for node in annotated.graph.nodes if COST in node.meta}
    assert costs["_1"].saved_bytes == RELU_OUT * BATCH and costs["_1"].resaved == ()
    assert costs["_2"].saved_bytes == 0  # counted once, at the ReLU
    assert costs["_2"].resaved == (("_1", RELU_OUT * BATCH),)
    assert costs["_0"].resaved == ()


def test_a_stage_cut_between_the_relu_and_the_second_linear_counts_the_relu_output() -> None:
    _, chain = _linear_relu_linear()
    assert [block.node_names for block in chain.blocks] == [("_0",), ("_1",), ("_2",)]
    assert [block.resaved for block in chain.blocks] == [(), (), ((1, Affine(0.0, RELU_OUT)),)]
    rows = 4
    own = [block.saved_bytes.at(rows) for block in chain.blocks]  # 16*4, 32*4, the loss estimate's 8*4 per row
    assert own == [16 * 4 * rows, RELU_OUT * rows, 8 * 4 * rows]
    expected = {(0, 1): own[0], (0, 2): own[0] + own[1], (0, 3): sum(own), (1, 2): own[1], (1, 3): own[1] + own[2],
                (2, 3): own[2] + RELU_OUT * rows}  # only a stage starting at the second Linear saves its copy
    for (first, stop), num_bytes in expected.items():
        assert resaved_bytes(chain, first, stop) == (Affine(0.0, RELU_OUT) if (first, stop) == (2, 3) else Affine())
        assert stage_cost(chain, first, stop, rows, 1).activation_bytes == num_bytes, (first, stop)
    cost = stage_cost(chain, 2, 3, rows, 1)
    assert activation_peak_bytes(cost, 3, 8) == 3 * (own[2] + RELU_OUT * rows)
    assert stage_memory_bytes(cost, 3) - stage_memory_bytes(replace(cost, activation_bytes=own[2]), 3) \
        == 3 * RELU_OUT * rows


def _three_savers() -> CostGraph:
    """Node a saves a value (100 B/row) that b and c save again; d saves b's output (10 B/row) again."""
    return CostGraph((
        CostNode("a", saved_bytes=Affine(0, 100)),
        CostNode("b", inputs=("a",), saved_bytes=Affine(0, 10), resaved=(("a", Affine(0, 100)),)),
        CostNode("c", inputs=("a", "b"), resaved=(("b", Affine(0, 100)),)),
        CostNode("d", inputs=("b", "c"), resaved=(("b", Affine(0, 10)),)),
    ))


def test_each_stage_counts_a_value_saved_by_several_blocks_once() -> None:
    chain = build_chain(_three_savers(), max_blocks=None)
    assert [block.resaved for block in chain.blocks] == [
        (), ((0, Affine(0, 100)),), ((1, Affine(0, 100)),), ((1, Affine(0, 10)),)]
    extra = {(first, stop): resaved_bytes(chain, first, stop).per_sample
             for first in range(4) for stop in range(first + 1, 5)}
    assert extra == {(0, 1): 0, (0, 2): 0, (0, 3): 0, (0, 4): 0,
                     (1, 2): 100, (1, 3): 100, (1, 4): 100,  # a's value once, though b and c both save it
                     (2, 3): 100, (2, 4): 110,  # a's value (last saved by b) and b's output
                     (3, 4): 10}


def test_merged_blocks_keep_only_resaves_across_their_boundaries() -> None:
    chain = build_chain(_three_savers(), max_blocks=None)
    merged = coarsen_chain(chain, [2, 4])  # [a, b] [c, d]
    assert [block.resaved for block in merged.blocks] == [(), ((0, Affine(0, 110)),)]
    assert resaved_bytes(merged, 1, 2) == resaved_bytes(chain, 2, 4)
    # b, c and d together: a's value once, b's output (saved again by d) no longer crosses a boundary
    assert coarsen_chain(chain, [1, 4]).blocks[1].resaved == ((0, Affine(0, 100)),)


def test_memoised_resaved_bytes_equal_the_direct_sum_on_random_chains() -> None:
    rng = random.Random(7)
    for _ in range(20):
        num_blocks = rng.randint(1, 9)
        blocks = tuple(Block(f"b{i}", (), Affine(), Affine(), 0, resaved=tuple(
            (saver, Affine(rng.choice([0.0, 3.0]), rng.uniform(0, 50)))
            for saver in sorted(rng.sample(range(i), rng.randint(0, i))))) for i in range(num_blocks))
        chain = CostChain(blocks, (Affine(),) * (num_blocks - 1))
        sums = block_sums(chain)
        for first in range(num_blocks):
            for stop in range(first + 1, num_blocks + 1):
                direct = Affine.total(num_bytes for block in blocks[first:stop]
                                      for saver, num_bytes in block.resaved if saver < first)
                memoised = sums.resaved(first, stop)
                assert (memoised.fixed, memoised.per_sample) == pytest.approx((direct.fixed, direct.per_sample),
                                                                              rel=1e-12, abs=1e-12)


def test_plan_files_carry_the_resaves() -> None:
    chain = build_chain(_three_savers(), max_blocks=None)
    data = chain_to_json(chain)
    assert data["blocks"][2]["resaved"] == [[1, [0, 100]]]
    assert chain_from_json(data) == chain
    del data["blocks"][2]["resaved"]  # a plan file written before: no re-saves
    assert chain_from_json(data).blocks[2].resaved == ()


def test_malformed_resaves_are_refused_with_the_fix() -> None:
    with pytest.raises(CostGraphError, match="'b' re-saves a value of 'c', which is not an earlier node"):
        CostGraph((CostNode("a"), CostNode("b", resaved=(("c", Affine(0, 1)),)), CostNode("c")))
    with pytest.raises(CostGraphError, match="use finite non-negative sizes"):
        CostGraph((CostNode("a"), CostNode("b", resaved=(("a", Affine(0, -1)),))))
    with pytest.raises(ValueError, match=r"block 1 \('y'\) re-saves values of blocks \[1\].*in \[0, 1\)"):
        CostChain((Block("x", (), Affine(), Affine(), 0), Block("y", (), Affine(), Affine(), 0,
                                                               resaved=((1, Affine()),))), (Affine(),))


@fx.wrap
def _rows_as_python_int(y: torch.Tensor) -> torch.Tensor:
    return y.new_zeros(int(y.shape[0]), 3) + y[:, :1]  # int() forces a concrete batch size


class _ReluLinearFixedBatch(nn.Module):
    """Linear -> ReLU -> Linear whose result is rebuilt with a Python int batch size, so costing falls back to a fit."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rows_as_python_int(self.second(torch.relu(self.first(x))))


def test_resaves_survive_the_affine_fit() -> None:
    annotated = annotate_costs(fx.symbolic_trace(_ReluLinearFixedBatch()), (torch.randn(4, 16),))
    assert annotated.meta["fxpipe.cost_mode"].startswith("affine-fit")
    costs = {node.name: node.meta[COST] for node in annotated.graph.nodes if COST in node.meta}
    assert costs["second"].resaved == (("relu", 16 * 4 * BATCH),)
    assert to_cost_graph(annotated).by_name()["second"].resaved == (("relu", Affine(0.0, 16 * 4)),)
