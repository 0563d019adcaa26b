"""Sequence shards across a stage boundary: two sequence-parallel stages of the same T (threads, one communicator
per member) pass member j's token share to member j, and give one process's outputs and gradients exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from test_tensor_parallel_shard import AttentionBlock, _weighted_sum
from torch import Tensor, fx
from tp_threads import ThreadGroup, full_gradient, run_members

from fxpipe import passes
from fxpipe.passes import tensor_parallel_ops as ops
from fxpipe.passes.tp_shard import TensorParallelStage, shard_stage


def _output_node(gm: fx.GraphModule) -> str:
    (output,) = [node for node in gm.graph.nodes if node.op == "output"]
    return str(output.args[0])


def _shard(gm: fx.GraphModule, group: ThreadGroup, name: str, boundary: frozenset[str]) -> list[TensorParallelStage]:
    members = []
    for rank in range(group.size):
        key = f"test-seqshard-{name}-{group.size}-{rank}"
        ops.register_group(key, group.member(rank))
        members.append(shard_stage(copy.deepcopy(gm), group.size, rank, group_key=key, sequence_parallel=True,
                                   sequence_boundary=boundary))
    return members


@pytest.mark.parametrize("degree", [2, 4])
def test_two_stages_exchange_token_shares(degree: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    first, second = (passes.trace(AttentionBlock(), x) for _ in range(2))
    # one process: the two stages in a row
    reference_x = x.clone().requires_grad_()
    ref_first, ref_second = copy.deepcopy(first), copy.deepcopy(second)
    middle = ref_first(reference_x)
    expected = ref_second(middle)
    _weighted_sum(expected).backward()
    group = ThreadGroup(degree)
    senders = _shard(first, group, "first", frozenset({_output_node(first)}))
    receivers = _shard(second, group, "second", frozenset({"x"}))
    assert all(s.sequence_boundary == {_output_node(first)} for s in senders)
    assert all(r.sequence_boundary == {"x"} for r in receivers)

    def work(rank: int) -> tuple[Tensor, Tensor, Tensor]:
        torch.set_num_threads(1)
        member_x = x.clone().requires_grad_()
        sent = senders[rank].module(member_x)
        received = sent.detach().requires_grad_()  # what the transport would carry: this member's share only
        output = receivers[rank].module(received)
        _weighted_sum(output).backward()
        assert received.grad is not None
        sent.backward(received.grad)  # the gradient goes back share to share
        assert member_x.grad is not None
        return sent.detach(), output.detach(), member_x.grad

    results = run_members(degree, work)
    shares = [sent for sent, _, _ in results]
    # each member sends 1/T of the boundary value: its own tokens, in member order
    assert all(share.numel() * degree == middle.numel() for share in shares)
    torch.testing.assert_close(torch.cat(shares, 1), middle.detach(), rtol=1e-5, atol=1e-5)
    for _, output, input_grad in results:
        torch.testing.assert_close(output, expected.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(input_grad, reference_x.grad, rtol=1e-4, atol=1e-5)
    for members, reference in ((senders, ref_first), (receivers, ref_second)):
        for parameter in members[0].parameters:
            grads = [(m.parameters[i], m.module.get_parameter(m.parameters[i].path).grad)
                     for m in members for i, p in enumerate(m.parameters) if p.path == parameter.path]
            torch.testing.assert_close(full_gradient(grads), reference.get_parameter(parameter.path).grad,
                                       rtol=1e-4, atol=1e-5, msg=lambda text, n=parameter.name: f"{n}: {text}")


def test_boundary_applies_only_to_sequence_parallel_token_rows() -> None:
    x = torch.randn(2, 8, 32)
    gm = passes.trace(AttentionBlock(), x)
    group = ThreadGroup(2)
    members = _shard(gm, group, "whole", frozenset({"x", _output_node(gm), "no_such_value"}))
    # without sequence parallelism nothing is split, so nothing crosses split either
    plain = shard_stage(copy.deepcopy(gm), 2, 0, group_key="test-seqshard-whole-2-0",
                        sequence_boundary=frozenset({"x"}))
    assert plain.sequence_boundary == frozenset()
    assert members[0].sequence_boundary == {"x", _output_node(gm)}
