"""Sequence-parallel column linears keep only their input's token share for backward (passes/tp_sequence_columns):
the same outputs and gradients as the linears on the gathered input (fp32 and under bf16 autocast), the share is
all they save, and a sequence-parallel member's saved bytes drop by the gathered inputs' (T-1)/T."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_tensor_parallel_shard import AttentionBlock, _members, _weighted_sum
from torch import Tensor
from tp_threads import ThreadGroup, run_members

from fxpipe import passes
from fxpipe.core import meta
from fxpipe.passes import tensor_parallel_ops as ops
from fxpipe.passes.tp_sequence_columns import keep_token_shares


@contextmanager
def _saved_bytes(found: list[int]) -> Iterator[None]:
    """Append the bytes of every distinct storage autograd saves inside the block to ``found``."""
    seen: set[int] = set()

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            found.append(storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def _linears(width: int = 16, outs: tuple[int, ...] = (24, 8), bias: tuple[bool, ...] = (True, False),
             ) -> list[tuple[Tensor, Tensor | None]]:
    torch.manual_seed(0)
    return [(torch.randn(out, width, requires_grad=True), torch.randn(out, requires_grad=True) if has else None)
            for out, has in zip(outs, bias, strict=True)]


def _weights_for(out: Tensor) -> Tensor:
    return torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)


@pytest.mark.parametrize(("degree", "autocast"), [(2, False), (4, False), (2, True)])
def test_op_matches_linears_on_the_gathered_input(degree: int, autocast: bool) -> None:
    """Member j holds rows j of each weight (a column-parallel split) and tokens j of the input."""
    linears = _linears()
    x = torch.randn(2, 8, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        expected = [F.linear(x, weight, bias) for weight, bias in linears]
    sum((out.float() * _weights_for(out)).sum() for out in expected).backward()
    group = ThreadGroup(degree)

    def shard(tensor: Tensor | None, rank: int) -> Tensor | None:
        return None if tensor is None else tensor.detach().chunk(degree, 0)[rank].clone().requires_grad_()

    def work(rank: int) -> tuple[list[Tensor], Tensor, list[Tensor], list[int]]:
        key = f"test-seq-columns-{degree}-{autocast}-{rank}"
        ops.register_group(key, group.member(rank))
        share = x.detach().chunk(degree, 1)[rank].clone().requires_grad_()
        params = [p for weight, bias in linears for p in (shard(weight, rank), shard(bias, rank)) if p is not None]
        saved: list[int] = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _saved_bytes(saved):
            outs = ops.sequence_columns(share, key, 1, tuple(b is not None for _, b in linears), *params)
        sum((out.float() * _weights_for(full).chunk(degree, -1)[rank]).sum()
            for out, full in zip(outs, expected, strict=True)).backward()
        assert share.grad is not None
        return [out.detach() for out in outs], share.grad, [p.grad for p in params], saved

    results = run_members(degree, work)
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    for rank, (outs, _, grads, saved) in enumerate(results):
        for out, reference in zip(outs, expected, strict=True):
            assert out.dtype == reference.dtype
            torch.testing.assert_close(out, reference.detach().chunk(degree, -1)[rank], **tolerance)
        references = [p.grad.chunk(degree, 0)[rank] for pair in linears for p in pair if p is not None]
        for grad, reference in zip(grads, references, strict=True):
            assert grad is not None and grad.dtype == reference.dtype
            torch.testing.assert_close(grad, reference, **tolerance)
        # saved: the token share in the compute dtype and the weights as they are, not the gathered input
        share_bytes = x.numel() // degree * (2 if autocast else 4)
        assert sorted(saved) == sorted([share_bytes, *(4 * w.numel() // degree for w, _ in linears)])
    input_grad = torch.cat([grad for _, grad, _, _ in results], 1)  # member j holds its tokens' gradient
    torch.testing.assert_close(input_grad, x.grad, **tolerance)
    assert group.counts == [3] * degree  # forward all-gather; backward all-gather and reduce-scatter


def test_frozen_weight_gets_no_gradient() -> None:
    (weight, bias), = _linears(outs=(8,), bias=(True,))
    weight.requires_grad_(False)
    group = ThreadGroup(2)

    def work(rank: int) -> tuple[Tensor | None, Tensor | None]:
        key = f"test-seq-columns-frozen-{rank}"
        ops.register_group(key, group.member(rank))
        b = bias.detach().clone().requires_grad_()
        (out,) = ops.sequence_columns(torch.randn(2, 4, 16), key, 1, (True,), weight, b)
        out.sum().backward()
        return weight.grad, b.grad

    for weight_grad, bias_grad in run_members(2, work):
        assert weight_grad is None and bias_grad is not None


def test_rewrite_leaves_gathers_with_other_readers() -> None:
    """Only gathers read as nothing but linear inputs are rewritten; the others keep their graph."""
    gm = passes.trace(AttentionBlock(), torch.randn(2, 8, 32))
    member = _members(gm, 2, sequence_parallel=True)[0][0]
    targets = [node.target for node in member.module.graph.nodes]
    assert targets.count(ops.sequence_columns) == 2 and ops.gather_sequence not in targets
    assert F.linear in targets  # the row linears (out, down) stay
    graph = copy.deepcopy(member.module.graph)
    assert keep_token_shares(graph) == 0  # nothing left to rewrite
    for node in member.module.graph.nodes:
        if node.target is ops.sequence_columns:
            assert node.meta[meta.TP_ORIGIN] in ("q", "gate")


def _member_saved_bytes(degree: int, keep_shares: bool) -> int:
    """Bytes member 0 of a sequence-parallel AttentionBlock saves for backward (threads, every member running)."""
    gm = passes.trace(AttentionBlock(), torch.randn(2, 8, 32))
    stages, _ = _members(gm, degree, sequence_parallel=True)
    if not keep_shares:  # the members as they were before: each column linear reading the gathered input
        for stage in stages:
            _undo(stage.module)
    x = gm.meta[meta.EXAMPLE_INPUTS][0]

    def work(rank: int) -> int:
        torch.set_num_threads(1)
        saved: list[int] = []
        with _saved_bytes(saved):
            out = stages[rank].module(x)
        _weighted_sum(out).backward()
        return sum(saved)

    return int(run_members(degree, work)[0])


def _undo(module: Any) -> None:
    graph = module.graph
    for node in list(graph.nodes):
        if node.target is not ops.sequence_columns:
            continue
        x, key, dim, biases, *params = node.args
        with graph.inserting_before(node):
            gathered = graph.call_function(ops.gather_sequence, (x, key, dim))
            position = 0
            for index, has_bias in enumerate(biases):
                args = (gathered, *params[position:position + 1 + has_bias])
                position += 1 + has_bias
                linear = graph.call_function(F.linear, args)
                (user,) = [u for u in node.users if u.args[1] == index]
                user.replace_all_uses_with(linear)
                graph.erase_node(user)
        graph.erase_node(node)
    module.recompile()


@pytest.mark.parametrize("degree", [2, 4])
def test_member_saves_the_gathered_inputs_once_less(degree: int) -> None:
    """The drop is the two gathered inputs (q, k, v's and gate and up's), less the token share each now saves."""
    before, after = _member_saved_bytes(degree, False), _member_saved_bytes(degree, True)
    gathered = 2 * 8 * 32 * 4
    assert before - after == 2 * gathered - 2 * gathered // degree


@pytest.mark.parametrize("model_name", ["gpt-mini", "attention"])
def test_costs_mark_the_columns_the_rewrite_fuses(model_name: str) -> None:
    """The cost graph's token-share columns (fxpipe.passes.tp_costs) are the linears the member's rewrite fuses,
    and the regather falls on the first of each fused group."""
    import fxpipe
    from fxpipe.passes.tp_costs import annotate_tensor_parallel

    if model_name == "gpt-mini":
        model, inputs = fxpipe.models.build("gpt-mini", n_layer=2)
        gm = passes.trace(model, inputs[0])
    else:
        gm = passes.trace(AttentionBlock(), torch.randn(2, 8, 32))
    annotated = copy.deepcopy(gm)
    annotate_tensor_parallel(annotated, gm.meta[meta.EXAMPLE_INPUTS])
    figures = {node.name: node.meta.get(meta.TENSOR_PARALLEL) for node in annotated.graph.nodes}
    shares = {name for name, figure in figures.items() if figure is not None and figure.sequence_saved_share}
    regathers = {name for name, figure in figures.items() if figure is not None and figure.regather}
    stages, _ = _members(gm, 2, sequence_parallel=True)
    fused = [node for node in stages[0].module.graph.nodes if node.target is ops.sequence_columns]
    assert {node.meta[meta.TP_ORIGIN] for node in fused} == regathers and len(fused) == len(regathers) > 0
    read = {user.meta[meta.TP_ORIGIN] for node in fused for user in node.users}
    assert read == shares


def _split_run(order: list[str], split: bool, degree: int = 2) -> tuple[list[dict[str, Tensor]], list[int], list[int]]:
    """Member graphs of a sequence-parallel AttentionBlock run in threads through ``order`` ("F0", "B0", "W0", ...:
    forward, input-gradient and weight-gradient passes of two micro-batches, as zero-bubble orders them; with
    ``split`` False, "B" is the whole backward and "W" nothing). Returns each member's parameter gradients and the
    collectives member 0 ran in the B and in the W passes."""
    from fxpipe.runtime.autograd.split_backward import backward_inputs, backward_weights

    torch.manual_seed(0)
    gm = passes.trace(AttentionBlock(), torch.randn(2, 8, 32))
    inputs = [torch.randn(2, 8, 32) for _ in range(2)]
    stages, group = _members(gm, degree, sequence_parallel=True)
    calls = {"B": 0, "W": 0}

    def work(rank: int) -> dict[str, Tensor]:
        torch.set_num_threads(1)
        module = stages[rank].module
        params = list(module.parameters())
        held: dict[int, Any] = {}
        for step in order:
            kind, index = step[0], int(step[1])
            before = group.counts[rank]
            if kind == "F":
                x = inputs[index].clone().requires_grad_()
                held[index] = (x, _weighted_sum(module(x)))
            elif kind == "B" and split:
                x, loss = held[index]
                _, held[index] = backward_inputs([loss], [None], [x], params)
            elif kind == "B":
                held[index][1].backward()
            elif split:
                backward_weights(held.pop(index))
            if rank == 0 and kind in calls:
                calls[kind] += group.counts[rank] - before
        return {name: param.grad for name, param in module.named_parameters()}

    grads = run_members(degree, work)
    return grads, [calls["B"]], [calls["W"]]


@pytest.mark.parametrize("order", [["F0", "F1", "B0", "B1", "W0", "W1"], ["F0", "B0", "F1", "W0", "B1", "W1"]])
def test_split_backward_is_exact_and_gathers_only_for_weights(order: list[str]) -> None:
    """Zero-bubble's split backward over the fused columns: the same gradients as one backward; B runs no gather
    of the column inputs (their weight gradients wait for W), W only those gathers (one per fused input per
    micro-batch), never the input gradient's reduce-scatter. Before, W re-ran the whole fused backward, collectives
    included, in an order that could differ between members (parameter groups iterated from a set): silently
    wrong weight gradients."""
    expected, whole_b, _ = _split_run(order, split=False)
    for _ in range(3):  # the old order differed between processes (id-hashed sets); threads share one heap
        got, split_b, split_w = _split_run(order, split=True)
        for member_got, member_expected in zip(got, expected, strict=True):
            for name, grad in member_expected.items():
                torch.testing.assert_close(member_got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert split_w == [2 * 2]  # two fused inputs (attention's, the MLP's), two micro-batches: one all-gather each
    assert split_b[0] == whole_b[0] - split_w[0]


def test_parameter_groups_come_in_parameter_order() -> None:
    """W runs B's parameter groups in order; every member must run them in the same one. They follow the
    parameters' order, for every order the parameters come in (a set of autograd nodes, as before, iterates by
    their ids: the same order for every permutation, and a different one in each process)."""
    import itertools

    from fxpipe.runtime.autograd.split_backward import backward_inputs

    x = torch.randn(4, 3, requires_grad=True)
    weights = [torch.randn(3, 3, requires_grad=True) for _ in range(4)]
    for ordered in itertools.permutations(weights):
        out = x
        for weight in weights:
            out = out @ weight
        _, work = backward_inputs([out.sum()], [None], [x], list(ordered))
        assert work is not None
        held = [work.params_by_node[next(iter(group["params"]))] for group in work.param_groups]
        assert [id(weight) for weight in held] == [id(weight) for weight in ordered]


def test_export_metadata_assertions_read_the_token_share() -> None:
    """HF Llama through torch.export: the ``_assert_tensor_metadata`` nodes on token rows (they assert nothing once
    traced) read the member's share; before, each gathered its tokens: two all-gathers per layer in forward that
    nothing used and the cost model did not charge."""
    from fxpipe import hf_examples

    model, inputs = hf_examples.llama(kv_heads=2)
    stages, _ = _members(passes.trace(model, inputs), 2, sequence_parallel=True)
    graph = stages[0].module.graph
    asserts = [node for node in graph.nodes if "_assert_tensor_metadata" in str(node.target)]
    assert asserts and not any(arg.target in (ops.gather_from_group, ops.gather_sequence)
                               for node in asserts for arg in node.all_input_nodes)
    assert sum(node.target is ops.sequence_columns for node in graph.nodes) == 4  # 2 layers: attention and MLP
