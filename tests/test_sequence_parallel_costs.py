"""Tensor-parallel stages are costed as compile runs them: with sequence parallelism (norms, dropout and residual
adds between pairs on token shards) only when asked for, else those nodes run whole on every group member.

Before, the cost graph split every such node by T whatever the runtime did, while ``fxpipe.compile`` runs without
sequence parallelism by default: a tensor-parallel plan's member time and saved bytes were charged as if they were
split. The oracle here is the cost graph node by node; the chain's blocks must add up to it.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest

from fxpipe.compile_options import CompileOptions
from fxpipe.compile_plan import _check_sequence_parallel
from fxpipe.core.chain import build_chain, without_sequence_parallel
from fxpipe.core.cluster import parse_cluster
from fxpipe.core.costgraph import ZERO
from fxpipe.core.hardware import LinkSpec
from fxpipe.core.plan import Plan
from fxpipe.core.planfile import load_plan_file
from fxpipe.planning import costed_model, load_model, plan_chain
from fxpipe.sim.tensor_parallel_cost import ring_seconds, splits, tensor_parallel_saved, tensor_parallel_times

CLUSTER = "1x4:h100"
FREE_LINK = LinkSpec(1e30, 0.0)  # the group's collectives cost nothing: compute alone


@pytest.fixture(scope="module")
def costed() -> object:
    model, inputs = load_model("gpt-mini", device="meta")
    return costed_model(model, inputs, parse_cluster(CLUSTER), costs="analytic", max_blocks=None, precision="bf16")


def _member_oracle(graph: object, degree: int, sequence_parallel: bool) -> tuple[float, float]:
    """One group member's forward + backward seconds and saved bytes at one row, summed node by node (the loss
    included): a node splits its share of both by T, a token-row node only under sequence parallelism."""
    seconds = saved = 0.0
    loss = [graph.loss] if graph.loss is not None else []  # type: ignore[attr-defined]  (it runs with the last block)
    for node in [*graph.nodes, *loss]:  # type: ignore[attr-defined]
        time_share = node.tp_time_share if sequence_parallel or not node.tp_sequence else 0.0
        saved_share = node.tp_saved_share if sequence_parallel or not node.tp_sequence else 0.0
        if not sequence_parallel:  # column linears keep their whole input then
            saved_share -= node.tp_sequence_saved_share
        seconds += (node.forward_s.at(1.0) + node.backward_s.at(1.0)) * (1 - time_share + time_share / degree)
        saved += node.saved_bytes.at(1.0) * (1 - saved_share + saved_share / degree)
    return seconds, saved


def test_token_row_nodes_between_pairs_are_marked_and_set_no_divisor(costed: object) -> None:
    graph = costed.cost_graph  # type: ignore[attr-defined]
    marked = [node for node in graph.nodes if node.tp_sequence]
    assert marked, "gpt-mini's layer norms and residual adds sit between its pairs"
    assert all(node.tp_time_share == 1.0 and node.tp_divisor == 0 and node.tp_param_bytes == 0 for node in marked)
    assert any("norm" in node.name or "add" in node.name for node in marked)
    chain = costed.chain  # type: ignore[attr-defined]
    assert any(block.tp is not None and block.tp.sequence_time_share > 0 for block in chain.blocks)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_members_time_and_saved_bytes_add_up_node_by_node(costed: object, degree: int,
                                                            sequence_parallel: bool) -> None:
    graph = costed.cost_graph  # type: ignore[attr-defined]
    chain = build_chain(graph, max_blocks=None)
    chain = chain if sequence_parallel else without_sequence_parallel(chain)
    assert all(splits(block, degree) or block.tp is None or block.tp.divisor % degree for block in chain.blocks)
    cluster = replace(parse_cluster(CLUSTER), tensor_parallel_collective=FREE_LINK)
    forward, backward = tensor_parallel_times(chain, cluster, 0, chain.num_blocks, 1.0, degree)
    saved = tensor_parallel_saved(chain, 0, chain.num_blocks, degree).at(1.0)
    seconds, saved_bytes = _member_oracle(graph, degree, sequence_parallel)
    assert forward + backward == pytest.approx(seconds, rel=1e-9)
    assert saved == pytest.approx(saved_bytes, rel=1e-9)


def test_without_sequence_parallel_takes_out_only_the_token_row_shares(costed: object) -> None:
    chain = costed.chain  # type: ignore[attr-defined]
    plain = without_sequence_parallel(chain)
    assert without_sequence_parallel(plain) is plain  # nothing left to take out
    changed = 0
    for before, after in zip(chain.blocks, plain.blocks, strict=True):
        if before.tp is None or before.tp.sequence_time_share == before.tp.sequence_saved_share == 0:
            assert after.tp == before.tp
            continue
        changed += 1
        if after.tp is None:  # its only split was token-row nodes
            assert before.tp.divisor == 0 and before.tp.param_bytes == 0
            assert before.tp.time_share == pytest.approx(before.tp.sequence_time_share)
            continue
        assert after.tp.time_share == pytest.approx(before.tp.time_share - before.tp.sequence_time_share)
        assert after.tp.saved_share == pytest.approx(before.tp.saved_share - before.tp.sequence_saved_share)
        assert (after.tp.param_bytes, after.tp.comm_bytes, after.tp.divisor) == \
            (before.tp.param_bytes, before.tp.comm_bytes, before.tp.divisor)
        assert after.tp.sequence_time_share == after.tp.sequence_saved_share == 0
        assert after.tp.regather_bytes == ZERO
    assert changed > 0


@pytest.mark.parametrize("degree", [2, 4])
def test_column_inputs_gathered_again_are_charged_in_backward_only(costed: object, degree: int) -> None:
    """Under sequence parallelism each column linear's input is gathered once more in backward (its linears keep
    only the token share): backward's collectives exceed forward's by exactly those all-gathers."""
    graph = costed.cost_graph  # type: ignore[attr-defined]
    chain = build_chain(graph, max_blocks=None)
    regathered = [node for node in graph.nodes if node.tp_regather_bytes != ZERO]
    # gpt-mini's 4 layers: the attention's and the MLP's inputs, and the vocabulary head's
    assert len(regathered) == 9 and all(node.tp_sequence_saved_share == 1.0 for node in regathered)
    link = LinkSpec(1e9, 1e-5)
    slow, free = (replace(parse_cluster(CLUSTER), tensor_parallel_collective=spec) for spec in (link, FREE_LINK))
    for sequence_parallel in (True, False):
        costed_chain = chain if sequence_parallel else without_sequence_parallel(chain)
        (forward, backward), (forward_free, backward_free) = (
            tensor_parallel_times(costed_chain, cluster, 0, chain.num_blocks, 1.0, degree) for cluster in (slow, free))
        extra = sum(ring_seconds(link, node.tp_regather_bytes.at(1.0), degree) for node in regathered) \
            if sequence_parallel else 0.0
        assert extra >= 0 and (backward - backward_free) - (forward - forward_free) == pytest.approx(extra, rel=1e-9)
    assert sum((block.tp.regather_bytes for block in chain.blocks if block.tp is not None), ZERO) == \
        sum((node.tp_regather_bytes for node in regathered), ZERO)


def test_the_plan_is_costed_and_marked_as_compile_will_run_it(costed: object) -> None:
    chain, cluster = costed.chain, parse_cluster(CLUSTER)  # type: ignore[attr-defined]
    plain = plan_chain(chain, cluster, 16, layout="1x4", num_microbatches=4, precision="bf16")
    sharded = plan_chain(chain, cluster, 16, layout="1x4", num_microbatches=4, precision="bf16",
                         sequence_parallel=True)
    assert (plain.sequence_parallel, sharded.sequence_parallel) == (False, True)
    assert plain.predicted is not None and sharded.predicted is not None
    assert plain.predicted.iteration_time_s > sharded.predicted.iteration_time_s
    assert plain.stages[0].activation_bytes > sharded.stages[0].activation_bytes
    assert "sequence_parallel" not in json.loads(plain.to_json())  # absent = False: older files keep their bytes
    assert Plan.from_json(sharded.to_json()).sequence_parallel is True
    # without tensor parallelism the option changes nothing
    flat = [plan_chain(chain, cluster, 16, layout="4", num_microbatches=4, precision="bf16", sequence_parallel=sp)
            for sp in (False, True)]
    assert flat[0].predicted == flat[1].predicted


def test_a_plan_costed_the_other_way_warns_at_compile(costed: object) -> None:
    chain, cluster = costed.chain, parse_cluster(CLUSTER)  # type: ignore[attr-defined]
    sharded = plan_chain(chain, cluster, 16, layout="1x4", num_microbatches=4, precision="bf16", sequence_parallel=True)
    with pytest.warns(RuntimeWarning, match="costed with sequence parallelism but the job runs without it"):
        _check_sequence_parallel(sharded, CompileOptions(None, 16, plan=sharded))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_sequence_parallel(sharded, CompileOptions(None, 16, plan=sharded, sequence_parallel=True))
        flat = plan_chain(chain, cluster, 16, layout="4", num_microbatches=4, precision="bf16",
                          sequence_parallel=True)
        _check_sequence_parallel(flat, CompileOptions(None, 16, plan=flat))  # no tensor-parallel stage: nothing to say


def test_fxpipe_plan_takes_the_option_and_writes_it_with_the_chain_it_costed(tmp_path: object,
                                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from fxpipe.cli import main

    written = {}
    for flag in ((), ("--sequence-parallel",)):
        out = tmp_path / f"plan{len(flag)}.json"  # type: ignore[operator]
        code = main(["plan", "gpt-mini", "--cluster", CLUSTER, "--global-batch", "16", "--layout", "1x4",
                     "--costs", "analytic", "--precision", "bf16", *flag, "--json", str(out), "--no-run-info"])
        assert (code, capsys.readouterr().err) == (0, "")
        written[bool(flag)] = json.loads(out.read_text())
        plan, chain, _ = load_plan_file(out)  # the shares read back as written
        assert plan.sequence_parallel is bool(flag) and chain is not None
        assert [block.tp.sequence_time_share for block in chain.blocks if block.tp is not None] == [
            block["tp"].get("sequence_time_share", 0.0) for block in written[bool(flag)]["cost_chain"]["blocks"]
            if "tp" in block]
        assert any(block.tp.regather_bytes != ZERO for block in chain.blocks if block.tp is not None) is bool(flag)
    assert "sequence_parallel" not in written[False] and written[True]["sequence_parallel"] is True
    # sequence parallelism saves memory (its time can go either way: it gathers column inputs again in backward)
    assert written[False]["stages"][0]["activation_bytes"] > written[True]["stages"][0]["activation_bytes"]
    assert written[False]["predicted"]["iteration_time_s"] != written[True]["predicted"]["iteration_time_s"]
    # the file's chain is the one each plan was costed on: token-row shares only where they split
    for sequence_parallel, data in written.items():
        shares = [block["tp"].get("sequence_time_share", 0.0) for block in data["cost_chain"]["blocks"] if "tp" in block]
        assert any(shares) is sequence_parallel
