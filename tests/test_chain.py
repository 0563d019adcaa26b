"""Cost chain: exact cut bytes (skip edges), forbidden non-tensor cuts, coarsening limits and totals."""

from __future__ import annotations

import pytest
from conftest import SHARED_PROFILES as PROFILES
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.core.chain import ChainError, build_chain
from fxpipe.core.costgraph import Affine, CostGraph, CostNode
from fxpipe.passes.profiles_io import read_profile


def _node(name: str, *inputs: str, out: float = 1.0, fwd: float = 1.0, module: str = "", tensor: bool = True,
          params: int = 0) -> CostNode:
    return CostNode(name, inputs, forward_s=Affine(0.0, fwd), backward_s=Affine(0.0, 2 * fwd),
                    output_bytes=Affine(1.0, out), saved_bytes=Affine(0.0, out), param_bytes=params,
                    module_path=module, tensor_output=tensor)


def _skip_graph() -> CostGraph:
    # x -> a -> b -> c(b, x) -> d(c, a): x is read by a and c, a by b and d (skip edges).
    nodes = (_node("x", out=10), _node("a", "x", out=20), _node("b", "a", out=30),
             _node("c", "b", "x", out=40), _node("d", "c", "a", out=50))
    return CostGraph(nodes, input_bytes=Affine(0.0, 10.0))


def test_cut_bytes_with_skip_edges_are_exact() -> None:
    chain = build_chain(_skip_graph(), max_blocks=None)
    assert [block.node_names for block in chain.blocks] == [("x",), ("a",), ("b",), ("c",), ("d",)]
    # after x: x | after a: x, a | after b: x, a, b | after c: a, c  (each value once per cut)
    assert chain.cut_bytes == (Affine(1, 10), Affine(2, 30), Affine(3, 60), Affine(2, 60))
    assert chain.input_bytes == Affine(0.0, 10.0)
    assert chain.output_bytes == Affine(1.0, 50.0)


def test_bert_mask_crosses_every_layer_cut() -> None:
    mask = _node("mask", out=7)
    layers = [_node("layer0", "mask", out=100)]
    for index in range(1, 6):
        layers.append(_node(f"layer{index}", f"layer{index - 1}", "mask", out=100))
    chain = build_chain(CostGraph((mask, *layers)), max_blocks=None)
    assert chain.cut_bytes[0] == Affine(1, 7)
    assert all(cut == Affine(2, 107) for cut in chain.cut_bytes[1:])


def test_non_tensor_values_never_cross_a_block_boundary() -> None:
    nodes = (_node("x"), _node("size", "x", tensor=False), _node("a", "x"), _node("b", "a", "size"),
             _node("c", "b"))
    chain = build_chain(CostGraph(nodes), max_blocks=None)
    assert [block.node_names for block in chain.blocks] == [("x",), ("size", "a", "b"), ("c",)]
    assert len(chain.cut_bytes) == 2


def _long_graph(num_nodes: int) -> CostGraph:
    nodes = []
    for index in range(num_nodes):
        inputs = [f"n{index - 1}"] if index else []
        if index >= 3 and index % 4 == 0:
            inputs.append(f"n{index - 3}")  # residual
        nodes.append(_node(f"n{index}", *inputs, out=float(index % 5 + 1), fwd=float(index % 7 + 1),
                           module=f"h.{index // 10}.op{index % 10}", params=index % 3))
    return CostGraph(tuple(nodes))


@pytest.mark.parametrize("max_blocks", [1, 2, 7, 64, 500, 1000])
def test_coarsening_respects_max_blocks_and_keeps_totals(max_blocks: int) -> None:
    graph = _long_graph(1000)
    chain = build_chain(graph, max_blocks=max_blocks)
    assert 1 <= chain.num_blocks <= max_blocks
    # Balancing may merge light neighbours, but the limit is used nearly fully; 1000 keeps every node.
    assert chain.num_blocks >= 0.85 * max_blocks
    assert chain.num_blocks == 1000 or max_blocks < 1000
    names = [name for block in chain.blocks for name in block.node_names]
    assert names == [node.name for node in graph.nodes]
    # Integer-valued costs: the block sums equal the graph totals exactly.
    assert Affine.total(block.forward_s for block in chain.blocks) == graph.total("forward_s")
    assert Affine.total(block.backward_s for block in chain.blocks) == graph.total("backward_s")
    assert Affine.total(block.saved_bytes for block in chain.blocks) == graph.total("saved_bytes")
    assert sum(block.param_bytes for block in chain.blocks) == graph.total_param_bytes
    fine = build_chain(graph, max_blocks=None)
    position_cut = dict(zip((block.node_names[-1] for block in fine.blocks), fine.cut_bytes, strict=False))
    for block, cut in zip(chain.blocks, chain.cut_bytes, strict=False):
        assert cut == position_cut[block.node_names[-1]]


def test_coarse_blocks_are_balanced() -> None:
    chain = build_chain(_long_graph(1000), max_blocks=16)
    work = [(block.forward_s + block.backward_s).at(1) for block in chain.blocks]
    assert max(work) <= 1.3 * min(work)


def test_module_boundary_wins_a_near_tie() -> None:
    # 10 equal nodes; modules m.0 = nodes 0..3, m.1 = 4..9. The exact half (after node 4) is inside
    # m.1; the boundary after node 3 is within a quarter block of it and is chosen.
    nodes = [_node(f"n{i}", *([f"n{i - 1}"] if i else []), module="m.0" if i < 4 else "m.1") for i in range(10)]
    chain = build_chain(CostGraph(tuple(nodes)), max_blocks=2)
    assert chain.blocks[0].node_names == ("n0", "n1", "n2", "n3")


def test_cheap_cut_wins_a_near_tie() -> None:
    # Same module everywhere; node 5's output is tiny, so the cut after it beats the exact half.
    nodes = [_node(f"n{i}", *([f"n{i - 1}"] if i else []), out=1.0 if i == 5 else 1000.0) for i in range(10)]
    chain = build_chain(CostGraph(tuple(nodes)), max_blocks=2)
    assert chain.blocks[0].node_names[-1] == "n5"
    assert chain.cut_bytes == (Affine(1.0, 1.0),)


def test_bad_arguments() -> None:
    with pytest.raises(ChainError, match="max_blocks"):
        build_chain(_skip_graph(), max_blocks=0)
    with pytest.raises(ChainError, match="empty"):
        build_chain(CostGraph(()))


def test_ten_thousand_nodes_is_fast() -> None:
    graph = _long_graph(10_000)  # the time limit (2 s) lives in benchmarks/unit_speed.py
    chain = build_chain(graph, max_blocks=64)
    assert chain.num_blocks == 64


@pytest.mark.needs_profiles
def test_bert_profile_chain_balances_layers() -> None:
    chain = build_chain(read_profile(PROFILES / "bert-48-pbs-2.txt", profile_batch_size=2), max_blocks=8)
    work = [(block.forward_s + block.backward_s).at(2) for block in chain.blocks]
    assert chain.num_blocks == 8
    assert max(work) <= 1.05 * min(work)


@st.composite
def _random_dags(draw: st.DrawFn) -> CostGraph:
    num_nodes = draw(st.integers(1, 12))
    nodes = []
    for index in range(num_nodes):
        inputs = draw(st.sets(st.integers(0, index - 1), max_size=3)) if index else set()
        nodes.append(_node(f"n{index}", *(f"n{i}" for i in sorted(inputs)), out=float(index + 1)))
    return CostGraph(tuple(nodes))


@settings(max_examples=60, deadline=None)
@given(_random_dags())
def test_cut_bytes_match_brute_force(graph: CostGraph) -> None:
    chain = build_chain(graph, max_blocks=None)
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    for cut_index, cut in enumerate(chain.cut_bytes):
        crossing = {
            producer for node in graph.nodes[cut_index + 1:] for producer in node.inputs
            if position[producer] <= cut_index
        }
        expected = Affine.total(graph.by_name()[name].output_bytes for name in sorted(crossing, key=lambda name: position[name]))
        assert cut == expected
